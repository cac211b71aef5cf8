"""Adversarial cases of ``placement="by_length"`` (packed rows placed by length): what breaks
because the CP ranks' rows differ in length, where under ``placement="sharded"`` they never do.

1. A layer's plan for the documents a rank holds whole was built from that rank's own token
   count: a sliding window was kept only where the rank's whole documents exceeded it, so a
   kernel without a masked kernel (on CUDA: ``flash_attn``, ``torch_efficient``,
   ``torch_cudnn``; here a CPU stand-in, the CPU flash op without its masked kernel) was
   refused on one rank only, and the others waited in the next collective. Now the window is
   decided from the row's longest document and the kernel checked for it on every rank
   (``ForwardContext._placed_plan``): refused on every rank where a document is longer than
   the window, run (equal to cp 1) where none is.
2. ZeRO-3 with the tiled MLP: each rank tiled its own number of tokens, so the ranks ran
   their MLPs' Linear layers a different number of times, each a ZeRO-3 parameter gather
   over the world: gloo aborted on a collective mismatch ("Received data size doesn't match
   expected size"). The root was the tiled MLP's data-dependent tile count under ZeRO-3 (dp
   2 x cp 1 with packed rows aborted the same way); now every rank runs the group's largest
   count (hf_ring/memory/tiled_mlp.py). Two launches of the example, ~1-2 min.

The contract either way: compute what one process computes, or raise on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import hf_ring
from backend_registry import registered
from closeness import grads_rel_err
from distributed import free_port, run_world
from hf_ring.kernels.torch_cpu import TORCH_CPU_FLASH
from hf_ring.sharding.placement import SHARDED, place_by_length
from test_hf_attention import VOCAB, tiny_config, tiny_model
from test_placement import _loss_and_grads

TOL = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The CPU flash op without its masked kernel: as flash_attn 2, torch_efficient and torch_cudnn
# are on CUDA (no masked_forward), the kernels a user pins with backend= / --attn_backend.
NO_MASK = dataclasses.replace(TORCH_CPU_FLASH, name="cpu_flash_no_mask", masked_forward=None,
                              masked_backward=None, description="torch_cpu_flash without its masked kernel")

# (documents, window): every document whole (none sharded); one rank's whole documents exceed
# the window, the other's do not. (24, 12, 8): 24 on rank 0, 12 + 8 = 20 on rank 1, window 20
# (rank 0's 24-token document really is windowed). (24, 20, 16, 12, 8, 4): 40 and 44, window 40.
WINDOW_CASES = [((24, 12, 8), 20), ((24, 20, 16, 12, 8, 4), 40)]


def _features(docs: tuple[int, ...]) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in docs]


def _batch(docs, cp: int, rank: int, placement: str) -> dict:
    return hf_ring.RingDataCollator(0, cp_size=cp, cp_rank=rank, packing=True, placement=placement)(_features(docs))


def _windowed_on_rank(rank: int, world: int, docs, window: int, placement: str):
    with registered(NO_MASK):
        hf_ring.setup_context_parallel(world, placement=placement, backend=NO_MASK.name, timeout=30)
        batches = [_batch(docs, world, r, placement) for r in range(world)]
        tokens = sum(int((b["shift_labels"] != -100).sum()) for b in batches)
        config = tiny_config("mistral", sliding_window=window)
        model = tiny_model(config, "ring_flash", tiny_model(config, "sdpa", seed=5).state_dict()).train()
        try:
            return _loss_and_grads(model, batches[rank], tokens)
        except Exception as e:  # noqa: BLE001 - the test compares what each rank did
            return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("docs,window", WINDOW_CASES, ids=lambda v: str(v))
def test_a_kernel_refusal_on_whole_documents_is_raised_on_every_rank_or_none(docs, window):
    placement = place_by_length(tuple(docs), 2)
    assert placement.owner.count(SHARDED) == 0
    totals = [sum(placement.whole_lens(r)) for r in (0, 1)]
    assert min(totals) <= window < max(totals), totals
    # Under "sharded" the same row is refused alike on both ranks (the reference behaviour).
    sharded = run_world(2, _windowed_on_rank, docs, window, "sharded")
    assert all(isinstance(r, str) and "masked kernel" in r for r in sharded), sharded
    ranks = run_world(2, _windowed_on_rank, docs, window, "by_length")
    raised = [isinstance(r, str) for r in ranks]
    what = [r[:200] if isinstance(r, str) else "computed" for r in ranks]
    assert all(raised) or not any(raised), f"a rank raised alone: {what}"
    if not any(raised):  # computed: it must be one process's
        full = _batch(docs, 1, 0, "sharded")
        tokens = int((full["shift_labels"] != -100).sum())
        config = tiny_config("mistral", sliding_window=window)
        ref_loss, ref_grads = _loss_and_grads(tiny_model(config, "ring_flash", seed=5).train(), full, tokens)
        loss = sum(r[0] for r in ranks)
        summed = {n: sum(r[1][n] for r in ranks) for n in ref_grads}
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (loss, ref_loss)
        assert grads_rel_err(summed, ref_grads) < 1e-4


# ZeRO-3 with every parameter gathered (persistence threshold 0: a tiny model's weights
# would otherwise all stay resident, as a real model's large MLP weights do not).
ZERO3 = {"zero_optimization": {"stage": 3, "overlap_comm": False, "stage3_param_persistence_threshold": 0},
         "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "zero_allow_untested_optimizer": True}
EXAMPLE_ARGS = ["--seq_len", "512", "--max_steps", "1", "--seed", "3", "--num_train_examples", "64",
                "--eval_steps", "0", "--learning_rate", "1e-3", "--hidden_size", "64", "--disable_tqdm",
                "--packing", "--per_device_train_batch_size", "6", "--no_save_model", "--eval_share", "0.1"]


def _example(tmp_path, name: str, nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    out = str(tmp_path / name)
    script = [os.path.join(ROOT, "examples", "finetune_llama_long.py"), "--output_dir", out, *EXAMPLE_ARGS, *args]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
    if nproc == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), *script]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _first_loss(tmp_path, name: str) -> float:
    with open(tmp_path / name / "trainer_state.json") as f:
        return next(e["loss"] for e in json.load(f)["log_history"] if "loss" in e)


def test_zero3_with_tiled_mlp_on_rows_placed_by_length(tmp_path):
    pytest.importorskip("deepspeed")
    mix = str(tmp_path / "mix.jsonl")
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "make_length_mix.py"), "--out", mix,
                    "--seq_len", "512", "--num_docs", "96"], check=True, capture_output=True)
    ds = tmp_path / "zero3.json"
    ds.write_text(json.dumps(ZERO3))
    data = ["--train_file", mix, "--tiled_mlp", "16"]
    got = _example(tmp_path, "placed", 2, [*data, "--cp_size", "2", "--cp_placement", "by_length",
                                           "--deepspeed", str(ds)])
    log = got.stdout + got.stderr
    if got.returncode != 0:
        # A refusal is within the contract only if it names the feature (on every rank).
        assert "Received data size doesn't match" not in log and "Error" in log and "tiled MLP" in log, log[-4000:]
        return
    ref = _example(tmp_path, "cp1", 1, data)
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-4000:]
    assert abs(_first_loss(tmp_path, "placed") - _first_loss(tmp_path, "cp1")) <= 1e-4 * abs(
        _first_loss(tmp_path, "cp1"))
