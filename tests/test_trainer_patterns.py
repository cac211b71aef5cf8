"""The HF Trainer on Gemma 2 (sliding windows and logit softcapping) under
``--cp_pattern auto`` computes what it computes in one process.

Runs examples/finetune_llama_long.py with ``--config_name`` (the model sweep's tiny
Gemma 2 config: softcap 50 on every layer, an 8-token window on its sliding layers, over
256-token examples) like test_trainer_cp.py: one process with transformers' eager
attention on the full sequences against 2 processes in one CP group with ``ring_flash``
and ``--cp_pattern auto`` (which picks Ulysses there: 4 query heads over 2 ranks of one
node), 8 AdamW steps in float32 on the same batches. The training loss and gradient norm
of every step and the eval loss must agree within 1e-4 relative (measured 2.0e-7,
4.5e-7, 3.9e-8), and every rank must log the line that says which pattern ``auto``
picked and why (one per kind of layer: sliding and full).
"""

from __future__ import annotations

import json
import os
import re

import pytest

from model_sweep_configs import build_config
from test_trainer_cp import COMMON, EXAMPLE, _assert_same, _eval_losses, _grad_norms, _losses, _run

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

MODEL = "gemma2"


def _launch(nproc: int, out_dir: str, args: list[str]) -> tuple[dict, str]:
    """The example on ``nproc`` processes: its trainer_state.json and its output."""
    log = _run(nproc, [EXAMPLE, "--output_dir", out_dir, *COMMON, *args])
    with open(os.path.join(out_dir, "trainer_state.json")) as f:
        return json.load(f), log


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    config_dir = tmp_path_factory.mktemp("config")
    build_config(MODEL).save_pretrained(config_dir)
    common = ["--config_name", str(config_dir), "--per_device_train_batch_size", "2"]
    ref, _ = _launch(1, str(tmp_path_factory.mktemp("cp1")), [*common, "--attn_implementation", "eager"])
    got, log = _launch(2, str(tmp_path_factory.mktemp("cp2")), [*common, "--cp_size", "2", "--cp_pattern", "auto"])
    return ref, got, log


def test_auto_pattern_trains_like_one_process(runs):
    ref, got, log = runs
    _assert_same(_losses(got), _losses(ref), f"{MODEL} training loss")
    _assert_same(_grad_norms(got), _grad_norms(ref), f"{MODEL} gradient norm")
    _assert_same(_eval_losses(got), _eval_losses(ref), f"{MODEL} eval loss")
    # Each rank says once per kind of call what auto picked (training and eval lengths).
    picked = re.findall(r"\[hf_ring\] .*pattern 'auto' picked '(\w+)'", log)
    assert len(picked) >= 2 and len(picked) % 2 == 0, log[-3000:]
