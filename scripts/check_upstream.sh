#!/usr/bin/env bash
# The upstream canary: which newest release of transformers, accelerate, TRL, PEFT or
# DeepSpeed breaks hf_ring, and where, before a user finds out. Not part of CI's gate
# (CI runs .ci/run only); its last result is in docs/versions.md.
#
#   bash scripts/check_upstream.sh [--pre] [--dir DIR]
#
# Builds a virtual environment in DIR (default: a new temporary directory) with the newest
# releases the registry serves (--pre: pre-releases too) on top of the torch CI's newest leg
# pins (.ci/constraints-newest.txt: 2.14.1, on this project's machines' disk; TORCH_SPEC
# overrides), installs hf_ring into it
# without dependencies, runs the tests that touch those packages and prints one line per
# package: its version against the tested range, and the accessor, model family or test
# that broke. Exits 1 when something broke.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PRE=()
DIR=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --pre) PRE=(--pre); shift ;;
        --dir) DIR="$2"; shift 2 ;;
        *) echo "usage: $0 [--pre] [--dir DIR]" >&2; exit 2 ;;
    esac
done
DIR="${DIR:-$(mktemp -d "${TMPDIR:-/tmp}/hf_ring_upstream.XXXXXX")}"
mkdir -p "${DIR}"
VENV="${DIR}/venv"
PY="${VENV}/bin/python"
echo "check_upstream: environment in ${VENV}"
if [[ ! -x "${PY}" ]]; then
    "${PYTHON:-python3}" -m venv "${VENV}"
fi
"${PY}" -m pip install --quiet "${TORCH_SPEC:-$(grep '^torch==' "${ROOT}/.ci/constraints-newest.txt")}"
# --upgrade only the packages named; torch stays (it satisfies every one's range).
DS_BUILD_OPS=0 "${PY}" -m pip install --quiet --upgrade "${PRE[@]}" \
    transformers accelerate trl peft deepspeed datasets "pytest>=8" matplotlib packaging tqdm
"${PY}" -m pip install --quiet --no-deps -e "${ROOT}"

cd "${ROOT}"
"${PY}" -m hf_ring.env || true
# The fastest existing tests that cover each package: the accessors and patches, ring_flash
# attention, every model family of the sweep, PEFT's modules under the chunked loss, one
# Trainer, one TRL and one ZeRO parity run.
TESTS=(
    tests/test_versions.py
    tests/test_env.py
    tests/test_patches.py
    tests/test_patches_positions.py
    tests/test_deepspeed_support.py
    tests/test_hf_attention.py
    tests/test_model_sweep.py
    tests/test_peft_chunked_loss.py
    "tests/test_trainer_cp.py::test_same_losses_as_without_cp[cp2]"
    "tests/test_trl.py::test_cp2_logs_what_cp1_logs[sft_padded]"
    "tests/test_trainer_zero.py::test_zero_same_as_one_process[zero3_cp2-2-3]"
)
set +e
"${PY}" -m pytest -q -p no:cacheprovider --junitxml="${DIR}/junit.xml" "${TESTS[@]}" 2>&1 | tee "${DIR}/pytest.log"
set -e
echo
"${PY}" "${ROOT}/scripts/upstream_report.py" "${DIR}/junit.xml" ${PRE[@]+"--pre"}
