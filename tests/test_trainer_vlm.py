"""Image-text models train under context parallelism as plain transformers trains them.

Runs examples/finetune_vlm_long.py for real (float32, a fixed seed, gloo on CPU), as
tests/test_trainer_cp.py runs the text example: at cp 1 in one process it is the **stock**
model (``sdpa``) under the **stock** ``transformers.Trainer``, the model computing its own
loss from ``labels``; at cp 2 on 2 processes (one CP group, zigzag) it is ``ring_flash``
under ``RingTrainer`` with ``RingVisionDataCollator`` (the full batch, images included, on
both ranks; the labels sharded) and the chunked LM-head loss (on by default under CP).
Samples of drawn shapes and their captions, 8 optimizer steps of 2 rows padded to the
longer (images straddle the shards), evaluations at steps 4 and 8 on 3 samples in eval
batches of 2 (a batch of 2 and a batch of 1 of other token counts: the stock eval_loss is
a mean of batch means). Every logged training loss, gradient norm and eval loss within
1e-4 relative: both sides run float32 and differ only in the order of sums (the ring's
online softmax, a gradient summed from two shards, the loss by chunks); measured at most
8.1e-7 (Qwen3-VL's gradient norm), 2.4e-7 for Qwen2.5-VL.

Cases (CASES: a family and its flags, one line each):
Qwen2.5-VL, whose every other sample opens with a 4-frame video of a moving shape;
Qwen3-VL (deepstack features); Qwen2.5-VL with the weights sharded by FSDP2 over both
processes in the cp 2 run (the chunked loss is off there by default); Qwen2.5-VL (videos
included) and Qwen3-VL with ``--packing`` (each batch's 2 samples in one row, each a document
with its own images and M-RoPE positions; the zigzag cut per document puts images across the
shards). A packed case is compared with its family's **padded** stock run, shared with the
padded case: exactness for packed rows means each sample computes as alone, so the same
batches padded are the same function (and this costs no reference run of its own);
test_the_stock_trainer_trains_packed_rows_as_padded_ones shows that the example's
``--packing`` at cp 1 (the stock model on the packed row, its positions' text row telling it
the documents, no cache) gives those figures too. Measured, packed: Qwen2.5-VL cp 2 vs stock
padded <= 9.8e-8, Qwen3-VL <= 1.1e-6 (its gradient norm), stock packed vs stock padded <= 9.8e-8.
Gemma 3 (a SigLIP tower; sliding and full layers, each image one bidirectional span, which
its stock mask builds from ``token_type_ids`` and hf_ring's ring computes), padded, at a
learning rate of 1e-4 (GEMMA3: why): measured 2.3e-7 (loss), 9.0e-6 (gradient norm, where
stock eager and stock sdpa are 6.0e-6 apart), 1.6e-7 (eval loss); packed at cp 2 (each image
a span inside its document, the sliding layers' window inside each document) against the
same padded stock run. The stock model itself packs Gemma 3 wrong (transformers 5.24's
sliding-layer mask on a packed row), so the example's --packing at cp 1 is refused for it:
test_stock_packed_gemma3_is_refused.
test_the_data_is_what_it_says checks the example's pixel layout against transformers' own
Qwen-VL processor and that videos are there; the example's refusals are checked in-process.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

import pytest
import torch
import transformers

from hf_ring.patches.transformers import release_line
from test_trainer_cp import ROOT, STEPS, _assert_same, _eval_losses, _grad_norms, _losses, _run
from test_trainer_fsdp import _accelerate_fsdp, _run as _run_command

pytestmark = pytest.mark.skipif(
    release_line(transformers.__version__) != "5",
    reason="the multimodal families were read and tested on transformers 5.x",
)

EXAMPLE = os.path.join(ROOT, "examples", "finetune_vlm_long.py")
VLM = ["--seq_len", "96", "--max_steps", str(STEPS), "--seed", "3", "--num_train_examples", "16",
       "--num_eval_examples", "3", "--eval_steps", "4", "--per_device_train_batch_size", "2",
       "--per_device_eval_batch_size", "2", "--learning_rate", "1e-3", "--disable_tqdm"]
QWEN2_5_VL, QWEN3_VL, PACKED = ("--model_type", "qwen2_5_vl"), ("--model_type", "qwen3_vl"), ("--packing",)
# Gemma 3 at a tenth of the learning rate: its tiny model amplifies rounding step by step (stock
# eager against stock sdpa, both one process: gradient norms 7.7e-5 apart by step 6 at 1e-3,
# 6.0e-6 at 1e-4), which would leave the 1e-4 check no margin at 1e-3.
GEMMA3 = ("--model_type", "gemma3", "--learning_rate", "1e-4")
# case -> (the example's flags at cp 2; whether that run shards the weights with FSDP2 over both
# processes: examples/accelerate_fsdp_cpu.yaml, as test_trainer_fsdp; the flags of the stock
# cp 1 reference run). A packed case's reference is its family's padded stock run, shared:
# packed exactly, each sample computes as alone, so the same batches padded give the same figures.
CASES = {
    "qwen2_5_vl": (QWEN2_5_VL, False, QWEN2_5_VL),
    "qwen3_vl": (QWEN3_VL, False, QWEN3_VL),
    "qwen2_5_vl_fsdp2": (QWEN2_5_VL, True, QWEN2_5_VL),
    "qwen2_5_vl_packed": (QWEN2_5_VL + PACKED, False, QWEN2_5_VL),
    "qwen3_vl_packed": (QWEN3_VL + PACKED, False, QWEN3_VL),
    "gemma3": (GEMMA3, False, GEMMA3),
    "gemma3_packed": (GEMMA3 + PACKED, False, GEMMA3),
}

sys.path.insert(0, os.path.join(ROOT, "examples"))


def _launch(nproc: int, out_dir: str, args: list[str], fsdp: bool = False) -> dict:
    script = [EXAMPLE, "--output_dir", out_dir, *VLM, *args]
    if fsdp:
        log = _run_command([*_accelerate_fsdp(nproc), *script])
        assert f"[hf_ring] gradients: fsdp2 mesh ({nproc},) over {nproc} processes" in log, log[-3000:]
    else:
        log = _run(nproc, script)
    ranks = re.findall(rf"\[hf_ring\] rank (\d+)/{nproc} \(dist_backend", log)
    assert sorted(map(int, ranks)) == list(range(nproc)), log[-3000:]
    assert ("the stock Trainer, attn_implementation=sdpa" in log) == (nproc == 1), log[-3000:]
    assert ("[hf_ring] packing: the 2 samples of a batch in one row" in log) == ("--packing" in args), log[-3000:]
    with open(os.path.join(out_dir, "trainer_state.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launch each run once, on demand (cases with the same flags share their cp 1 run); keep
    its trainer_state.json."""
    cache: dict[tuple, dict] = {}

    def get(flags: tuple[str, ...], cp: int, fsdp: bool = False) -> dict:
        key = (flags, cp, fsdp)
        if key not in cache:
            out = str(tmp_path_factory.mktemp(f"{flags[1]}{'_packed' * ('--packing' in flags)}_cp{cp}"))
            cache[key] = _launch(cp, out, [*flags, "--cp_size", str(cp)], fsdp=fsdp)
        return cache[key]

    return get


def _compare(ref: dict, got: dict, what: str) -> None:
    """Every logged training loss, gradient norm and eval loss of ``got`` within 1e-4 of ``ref``."""
    losses = _losses(ref)
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in losses.values())
    assert losses[STEPS] < losses[1]  # it learns
    assert sorted(_eval_losses(ref)) == [4, STEPS]
    worst = {}
    for figure, read in (("training loss", _losses), ("gradient norm", _grad_norms), ("eval loss", _eval_losses)):
        _assert_same(read(got), read(ref), f"{what} {figure}")
        worst[figure] = max(abs(read(got)[s] - v) / abs(v) for s, v in read(ref).items())
    print(f"\n{what}: max relative difference " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


@pytest.mark.parametrize("case", CASES)
def test_same_figures_as_plain_transformers(runs, case):
    flags, fsdp, reference = CASES[case]
    _compare(runs(reference, 1), runs(flags, 2, fsdp), f"{case} cp2 vs stock cp1 {' '.join(reference)}")


def test_the_stock_trainer_trains_packed_rows_as_padded_ones(runs):
    """The example's --packing at cp 1: the stock model reads each document from the text row
    of its positions (no cache), and its own loss shifts the row with each document's first
    label -100: the same figures as the same batches padded."""
    _compare(runs(QWEN2_5_VL, 1), runs(QWEN2_5_VL + PACKED, 1), "qwen2_5_vl stock cp1 packed vs padded")


def test_stock_packed_gemma3_is_refused(tmp_path):
    """transformers' own Gemma 3 mask does not keep a packed row's documents apart (its sliding
    layers, tests/test_cp_vlm_packed.py): at cp 1 the example's --packing (the stock model on
    the packed row) is refused, saying to pad; under CP (ring_flash) it is computed."""
    import finetune_vlm_long

    with pytest.raises(ValueError, match="Gemma 3 mask on a packed row is not each document alone"):
        finetune_vlm_long.main(["--model_type", "gemma3", "--packing", "--output_dir", str(tmp_path), *VLM])


def test_the_data_is_what_it_says():
    """The example's Qwen pixel rows are those of transformers' Qwen2-VL processor (PIL
    backend, no resizing or normalising), and Qwen2.5-VL's samples hold videos."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    import vlm_data
    import vlm_models

    image = vlm_data.draw("circle", "red", (0.3, 0.5), 32)
    ours, grid = vlm_data.qwen_patches(image[None], patch=4, merge=2, temporal=2)
    processor = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, do_resize=False,
                                         do_rescale=False, do_normalize=False)
    theirs = processor(images=[image.permute(1, 2, 0).numpy()], return_tensors="pt", input_data_format="channels_last")
    assert grid == theirs["image_grid_thw"][0].tolist() == [1, 8, 8]
    assert torch.allclose(ours, theirs["pixel_values"].float(), atol=1e-6)
    tok = vlm_data.WordTokenizer()
    _, layout = vlm_models.MODEL_TYPES["qwen2_5_vl"](tok, 64, 2, 96)
    rows = vlm_data.shapes_dataset(tok, layout, 4, 96, seed=3)
    assert sum("pixel_values_videos" in r for r in rows) == 2
    assert all(r["input_ids"].count(tok.image_token_id) == 16 * len(r["image_grid_thw"]) for r in rows)


@pytest.mark.parametrize("flag, says", [
    (["--tiled_mlp", "64"], "--tiled_mlp: the tiled MLP is not tested with image-text models"),
    (["--deepspeed", "examples/ds_zero3.json"], "--deepspeed: DeepSpeed is not tested with image-text models"),
    (["--offload_checkpoints"], "--offload_checkpoints: offloaded checkpoints are not tested"),
])
def test_the_example_refuses_what_it_does_not_run(flag, says, capsys):
    import finetune_vlm_long

    with pytest.raises(SystemExit):
        finetune_vlm_long.main(["--cp_size", "2", *flag])
    assert says in capsys.readouterr().err
