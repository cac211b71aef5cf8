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
Qwen2.5-VL, whose every other sample opens with a 4-frame video of a moving shape, alone and
with two micro-batches a step; Qwen3-VL (deepstack features), with two micro-batches a step
(both families set ``accepts_loss_kwargs=False``, so the stock Trainer trains on the mean of
the micro-batches' own means, which ``RingTrainer``'s ``loss_mean="auto"`` follows: before
it did, cp 2 trained on the step's token mean: training losses 3.6e-4 apart); Qwen2.5-VL with the weights sharded by FSDP2 over both
processes in the cp 2 run (the chunked loss is off there by default); Qwen2.5-VL (videos
included) and Qwen3-VL (two micro-batches a step) with ``--packing`` (each batch's 2 samples in one row, each a document
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
test_a_checkpoint_and_its_processor runs the example's --model_name_or_path on a local
checkpoint (the tiny Qwen2.5-VL saved beside a real processor), cp 2 against the stock cp 1
for 4 steps; test_a_checkpoint_the_example_cannot_size_is_refused checks its refusals.
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
# Two micro-batches a step: Qwen2.5-VL and Qwen3-VL set accepts_loss_kwargs=False, so the stock
# Trainer trains on the mean of the micro-batches' own means (not the step's token mean).
ACCUMULATED = ("--gradient_accumulation_steps", "2")
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
    "qwen2_5_vl_accumulated": (QWEN2_5_VL + ACCUMULATED, False, QWEN2_5_VL + ACCUMULATED),
    "qwen3_vl_accumulated": (QWEN3_VL + ACCUMULATED, False, QWEN3_VL + ACCUMULATED),
    "qwen2_5_vl_fsdp2": (QWEN2_5_VL, True, QWEN2_5_VL),
    "qwen2_5_vl_packed": (QWEN2_5_VL + PACKED, False, QWEN2_5_VL),
    "qwen3_vl_packed_accumulated": (QWEN3_VL + ACCUMULATED + PACKED, False, QWEN3_VL + ACCUMULATED),
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
    if "--model_name_or_path" in args:  # every rank's samples made by the checkpoint's own processor
        loaded = ": Qwen2_5_VLForConditionalGeneration, processor ShapesProcessor (images: Qwen2VLImageProcessorPil"
        assert log.count(loaded) == nproc, log[-3000:]
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


def _compare(ref: dict, got: dict, what: str, steps: int = STEPS) -> None:
    """Every logged training loss, gradient norm and eval loss of ``got`` (``steps`` optimizer
    steps, evaluated every 4) within 1e-4 of ``ref``."""
    losses = _losses(ref)
    assert sorted(losses) == list(range(1, steps + 1)) and all(math.isfinite(v) for v in losses.values())
    assert losses[steps] < losses[1]  # it learns
    assert sorted(_eval_losses(ref)) == list(range(4, steps + 1, 4))
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


def _save_tiny_checkpoint(path: str) -> None:
    """The example's tiny Qwen2.5-VL (examples/vlm_models.py) saved as a checkpoint, with a real
    processor beside it (examples/vlm_sft_data.py: a word tokenizer, transformers' PIL image
    processor) whose class, a Qwen2.5-VL processor without a video processor (torchvision is not
    installed), the checkpoint carries as its own code (``auto_map``): AutoProcessor loads it
    with ``trust_remote_code``. Its text config keeps ``use_cache=True``, as released ones do."""
    from shapes_processor import ShapesProcessor
    from vlm_models import init_untrained, qwen2_5_vl
    from vlm_sft_data import shapes_processor, token_ids

    processor = shapes_processor()
    config, _ = qwen2_5_vl(token_ids(processor), 64, 2, 96)
    config.text_config.use_cache = True
    transformers.set_seed(3)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    init_untrained(model)
    model.save_pretrained(path)
    ShapesProcessor.register_for_auto_class("AutoProcessor")
    processor.save_pretrained(path)


def test_a_checkpoint_and_its_processor(tmp_path, monkeypatch):
    """--model_name_or_path on a local checkpoint (_save_tiny_checkpoint): the model from
    AutoModelForImageTextToText.from_pretrained, the samples made by its processor from
    AutoProcessor.from_pretrained (--trust_remote_code: the processor's class is the
    checkpoint's own code), every token id the checkpoint's. 4 steps of rows of 3 to 5 images
    (--seq_len 128: rows of unequal lengths, padded with the tokenizer's pad token); cp 2 against
    the stock cp 1, within 1e-4 as the cases above (float32 on both sides, only the order of sums
    differs; measured 8.0e-8 training loss, 9.3e-8 gradient norm, 0 eval loss)."""
    checkpoint = str(tmp_path / "tiny-qwen2_5_vl")
    _save_tiny_checkpoint(checkpoint)
    # transformers copies the processor's code into this cache. The cp 1 run fills it first, so
    # the cp 2 run's two ranks find it there and never write the same file at once.
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    flags = ["--model_name_or_path", checkpoint, "--trust_remote_code", "--max_steps", "4", "--seq_len", "128"]
    states = {cp: _launch(cp, str(tmp_path / f"cp{cp}"), [*flags, "--cp_size", str(cp)]) for cp in (1, 2)}
    _compare(states[1], states[2], "qwen2_5_vl checkpoint cp2 vs stock cp1", steps=4)


@pytest.mark.parametrize("saved, says", [
    ("llava", "a llava checkpoint, whose vision config has no spatial_merge_size"),
    ("qwen2_5_vl with a processor class of no known code", "gave a TokenizersBackend, not a processor with an image"),
])
def test_a_checkpoint_the_example_cannot_size_is_refused(saved, says, tmp_path):
    """Refused before any weight is read (a config, and a tokenizer, are all that is saved): a
    family whose processor's placeholders the example does not size, and a checkpoint whose
    processor AutoProcessor gives back as a bare tokenizer: its processor class is neither
    transformers' nor in the checkpoint's code (``auto_map``), as a custom processor saved
    without ``register_for_auto_class``."""
    import finetune_vlm_long
    import vlm_data
    import vlm_models
    from vlm_sft_data import shapes_processor

    tok = vlm_data.WordTokenizer()
    vlm_models.MODEL_TYPES[saved.split()[0]](tok, 64, 2, 96)[0].save_pretrained(tmp_path)
    if saved.startswith("qwen2_5_vl"):
        shapes_processor().tokenizer.save_pretrained(tmp_path)
        with open(tmp_path / "tokenizer_config.json") as f:
            tokenizer_config = json.load(f)
        with open(tmp_path / "tokenizer_config.json", "w") as f:
            json.dump(dict(tokenizer_config, processor_class="ShapesProcessor"), f)
    with pytest.raises((NotImplementedError, ValueError), match=re.escape(says)):
        finetune_vlm_long.main(["--model_name_or_path", str(tmp_path), "--output_dir", str(tmp_path / "out"), *VLM])


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
