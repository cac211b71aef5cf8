#!/usr/bin/env bash
# The README's main job: sets up .venv, then fine-tunes the example's small Llama with
# context parallelism over 2 CPU processes (one CP group of 2) with the HF Trainer under
# `accelerate launch`. Extra arguments go to the example (see its --help), e.g.
#   bash scripts/finetune_cpu.sh --seq_len 4096 --max_steps 20
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/accelerate launch --config_file examples/accelerate_cpu.yaml \
    examples/finetune_llama_long.py --cp_size 2 "$@"
