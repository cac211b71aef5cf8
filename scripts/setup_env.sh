#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv with hf_ring and what its tests and
# examples need. Idempotent: a second run installs nothing new.
#
# PyTorch: the constraints file pins 2.14.1, the newest build this project's machines carry on
# disk (a CUDA build, run on the CPU here); on a GPU machine install the torch build for your
# CUDA first (an already installed torch that satisfies pyproject's range is kept: only the
# first install below applies the constraints file's torch pin).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HF_RING_VENV:-.venv}"
PY="${PYTHON:-python3}"
# CI's newest leg is a known, committed set: every package pinned by this file (docs/versions.md).
CONSTRAINTS=.ci/constraints-newest.txt
STAMP="$VENV/.hf_ring_constraints"
want="$(sha256sum "$CONSTRAINTS" | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  torch_pin="$(grep '^torch==' "$CONSTRAINTS")"
  echo "[setup] installing $torch_pin"
  "$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" "$torch_pin"
fi
# Reinstalled when the constraints changed since this venv was built, or a package is missing.
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ] \
    || ! "$VENV/bin/python" -c "import hf_ring, pytest, matplotlib, trl, deepspeed" 2>/dev/null; then
  # DeepSpeed ZeRO tests (tests/test_trainer_zero.py); DS_BUILD_OPS=0: no C++ op is prebuilt
  # (and hf_ring's DeepSpeed path builds none at run time either).
  echo "[setup] installing hf_ring[test,trl,deepspeed] (editable), pinned by $CONSTRAINTS"
  grep -v '^torch==' "$CONSTRAINTS" > "$VENV/.hf_ring_constraints_but_torch"
  DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q -c "$VENV/.hf_ring_constraints_but_torch" -e ".[test,trl,deepspeed]"
  echo "$want" > "$STAMP"
fi
"$VENV/bin/python" - <<'PY'
import torch, transformers, accelerate
print(f"[setup] torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}")
PY
