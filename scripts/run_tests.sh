#!/usr/bin/env bash
# The README's test command: sets up .venv, runs the whole suite on the newest supported
# transformers, then the Hugging Face tests again on the oldest supported one in its own
# virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -m pytest -q "$@"
if [ -f .ci/oldest_transformers.sh ]; then
  bash .ci/oldest_transformers.sh
fi
