#!/usr/bin/env bash
# Runs the Hugging Face tests (ring_flash, collator, Trainer) against the oldest supported
# transformers (4.57.6, the last 4.x release) in their own virtual environment, .venv-oldest,
# every package pinned by .ci/constraints-oldest.txt.
#
# Idempotent: the venv is (re)built only when it is missing or its constraints file changed
# (a stamp file holds the file's hash), and hf_ring is installed into it (editable,
# without dependencies) only when it does not already point at this checkout.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROOT}/.venv-oldest"
PYTHON="${PYTHON:-python3}"
# Every package is pinned by the constraints file (torch resolves to the local CPU wheel);
# the names below are what the leg installs, their versions come from that file.
CONSTRAINTS="${ROOT}/.ci/constraints-oldest.txt"
PACKAGES=(torch transformers accelerate datasets pytest packaging tqdm)
TRANSFORMERS="$(sed -n 's/^transformers==//p' "${CONSTRAINTS}")"
STAMP="${VENV}/.hf_ring_pins"
want="$(sha256sum "${CONSTRAINTS}" | cut -d' ' -f1)"

if [[ ! -x "${VENV}/bin/python" ]] || [[ "$(cat "${STAMP}" 2>/dev/null)" != "${want}" ]]; then
    echo "oldest_transformers: building ${VENV}"
    rm -rf "${VENV}"
    "${PYTHON}" -m venv "${VENV}"
    "${VENV}/bin/python" -m pip install --quiet --upgrade pip
    "${VENV}/bin/python" -m pip install --quiet -c "${CONSTRAINTS}" "${PACKAGES[@]}"
    echo "${want}" > "${STAMP}"
fi
# Reinstall hf_ring (editable, no dependencies) only when the venv's points elsewhere.
# (Looked up from / so that the checkout itself is not on the path.)
hf_ring_init="$(cd / && "${VENV}/bin/python" -c 'import importlib.util as u; s = u.find_spec("hf_ring"); print(s.origin if s else "")')"
if [[ "${hf_ring_init}" != "${ROOT}/hf_ring/__init__.py" ]]; then
    "${VENV}/bin/python" -m pip install --quiet --no-deps -e "${ROOT}"
fi

installed="$("${VENV}/bin/python" -c 'import transformers; print(transformers.__version__)')"
if [[ "${installed}" != "${TRANSFORMERS}" ]]; then
    echo "oldest_transformers: expected transformers ${TRANSFORMERS} in ${VENV}, found ${installed}" >&2
    exit 1
fi

cd "${ROOT}"
# What depends on the transformers release runs here. The world of 4 for generation stays with
# the newest leg: it differs from the world of 2 run here only in what hf_ring's own code does.
"${VENV}/bin/python" -m pytest -q tests/test_hf_attention.py tests/test_hf_attention_distributed.py \
    tests/test_collator.py tests/test_patches.py tests/test_trainer_cp.py tests/test_hot_path.py \
    tests/test_hf_sinks.py tests/test_model_support.py tests/test_model_sweep.py tests/test_hf_patterns.py \
    tests/test_long_context_memory.py tests/test_dropout_under_cp.py tests/test_generate.py \
    --deselect "tests/test_generate.py::test_generate_under_cp_is_one_process_generate[4-names1]" "$@"
