#!/usr/bin/env bash
# Runs the Hugging Face tests (ring_flash, collator, Trainer) against the oldest supported
# transformers (4.57.6, the last 4.x release) in their own virtual environment, .venv-oldest.
#
# Idempotent: the venv is (re)built only when it is missing or its pinned set changed (a
# stamp file holds the pins it was built with), and hf_ring is installed into it (editable,
# without dependencies) only when it does not already point at this checkout.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROOT}/.venv-oldest"
PYTHON="${PYTHON:-python3}"
# torch resolves to the local CPU wheel (pip's find-links); accelerate and datasets are the
# newest releases that install beside transformers 4.57.6 (which needs huggingface_hub < 1).
PINS=(
    "torch==2.13.0"
    "transformers==4.57.6"
    "accelerate==1.15.0"
    "datasets>=3.0,<5"
    "pytest>=8"
    "packaging"
    "tqdm"
)
STAMP="${VENV}/.hf_ring_pins"

if [[ ! -x "${VENV}/bin/python" ]] || [[ "$(cat "${STAMP}" 2>/dev/null)" != "${PINS[*]}" ]]; then
    echo "oldest_transformers: building ${VENV}"
    rm -rf "${VENV}"
    "${PYTHON}" -m venv "${VENV}"
    "${VENV}/bin/python" -m pip install --quiet --upgrade pip
    "${VENV}/bin/python" -m pip install --quiet "${PINS[@]}"
    echo "${PINS[*]}" > "${STAMP}"
fi
# Reinstall hf_ring (editable, no dependencies) only when the venv's points elsewhere.
# (Looked up from / so that the checkout itself is not on the path.)
hf_ring_init="$(cd / && "${VENV}/bin/python" -c 'import importlib.util as u; s = u.find_spec("hf_ring"); print(s.origin if s else "")')"
if [[ "${hf_ring_init}" != "${ROOT}/hf_ring/__init__.py" ]]; then
    "${VENV}/bin/python" -m pip install --quiet --no-deps -e "${ROOT}"
fi

installed="$("${VENV}/bin/python" -c 'import transformers; print(transformers.__version__)')"
if [[ "${installed}" != "4.57.6" ]]; then
    echo "oldest_transformers: expected transformers 4.57.6 in ${VENV}, found ${installed}" >&2
    exit 1
fi

cd "${ROOT}"
"${VENV}/bin/python" -m pytest -q tests/test_hf_attention.py tests/test_hf_attention_distributed.py \
    tests/test_collator.py tests/test_patches.py tests/test_trainer_cp.py tests/test_hot_path.py \
    tests/test_hf_sinks.py tests/test_model_support.py tests/test_model_sweep.py tests/test_hf_patterns.py \
    tests/test_trainer_patterns.py tests/test_long_context_memory.py "$@"
