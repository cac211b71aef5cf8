"""hf_ring.trl: TRL's vision-language SFT under context parallelism computes what TRL computes without it.

Runs examples/sft_vlm.py for real (float32, fixed seed): TRL's own ``SFTTrainer`` in this
process (the stock Qwen2.5-VL, ``sdpa``) against ``RingSFTTrainer`` on 2 processes forming one
CP group (``ring_flash``, gloo), a tiny Qwen2.5-VL and a real Qwen2.5-VL processor
(examples/vlm_sft_data.py: 1 to 3 images of 16 placeholder tokens per sample, so images
straddle the two ranks' zigzag shards), 6 optimizer steps of 2 samples padded to the longer,
evaluations at steps 3 and 6 on 3 samples (a batch of 2 and one of 1). Two of TRL's formats:

    messages: conversations, no mask: TRL learns every token, the image placeholders included
    prompt_completion: conversational prompt and completion, TRL's default completion-only
        loss (its left-padded prompts flushed left, then the completions)

Compared: every figure logged (loss, grad_norm, eval_loss, and TRL's entropy,
mean_token_accuracy, num_tokens, train and eval) within 1e-4 (tests/test_trl.py's TOL and
why). Measured, absolute: loss <= 4.8e-7, grad_norm <= 1.4e-6 (prompt_completion), entropy
<= 3.0e-7, mean_token_accuracy <= 2.6e-8, eval_loss equal, num_tokens equal. In-process: the collator's batches against TRL's collator's (assistant-only masks
too), what is refused, and the warning where TRL's own loss is a mean of micro-batch means.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import transformers

from hf_ring.patches.transformers import release_line
from test_trl import COMMON, EXAMPLES, _launch, compare, fresh_process_state  # noqa: F401  (a fixture)
from closeness import fake_cp_state

pytestmark = pytest.mark.skipif(
    release_line(transformers.__version__) != "5",
    reason="the multimodal families were read and tested on transformers 5.x",
)

STEPS = 6
# Two micro-batches a step (after test_trl's COMMON, which _launch puts first): Qwen2.5-VL sets
# accepts_loss_kwargs=False, so TRL averages the micro-batches' own means, which RingSFTTrainer's
# loss_mean="auto" follows (docs/trl.md).
ARGS = ["--max_steps", str(STEPS), "--eval_steps", "3", "--num_train_examples", "12", "--num_eval_examples", "3",
        "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2", "--gradient_accumulation_steps",
        "2", "--seed", "3"]
sys.path.insert(0, EXAMPLES)


def _trl_reference(out_dir: str, args: list[str]) -> dict:
    """TRL's own SFTTrainer at cp 1, in this process (imports already paid: the test stays short)."""
    import sft_vlm

    sft_vlm.main([*COMMON, *args, "--output_dir", out_dir, "--trl_reference"])
    with open(os.path.join(out_dir, "trainer_state.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("fmt", ["messages", "prompt_completion"])
def test_cp2_logs_what_trl_logs_at_cp1(tmp_path, fresh_process_state, fmt):
    args = [*ARGS, "--dataset_format", fmt]
    ref = _trl_reference(str(tmp_path / "trl"), args)
    got = _launch("sft_vlm.py", 2, str(tmp_path / "cp2"), args)
    extra = [e.pop("eval_token_loss") for e in got["log_history"] if "eval_token_loss" in e]
    assert len(extra) >= 2  # hf_ring's token mean over the eval set, which TRL does not log
    steps = sorted({e["step"] for e in ref["log_history"] if "loss" in e})
    assert steps == list(range(1, STEPS + 1))
    worst = compare(got, ref)
    assert {"loss", "grad_norm", "eval_loss", "entropy", "mean_token_accuracy", "num_tokens"} <= set(worst)
    losses = [e["loss"] for e in ref["log_history"] if "loss" in e]
    assert losses[-1] < losses[0]  # it learns
    print(f"\n{fmt}: max |cp2 - TRL cp1| per figure over {STEPS} steps: "
          + ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())))


# ---- in one process: the collator against TRL's, the refusals ----


def _trl_collator(processor, **kwargs):
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    return DataCollatorForVisionLanguageModeling(processor=processor, **kwargs)


def _model_config(processor):
    from vlm_models import qwen2_5_vl
    from vlm_sft_data import token_ids

    return qwen2_5_vl(token_ids(processor), 64, 2, 256)[0]


@pytest.mark.parametrize("fmt, masks", [("messages", {}), ("messages", {"assistant_only_loss": True}),
                                        ("prompt_completion", {"completion_only_loss": True})])
def test_collator_hands_every_rank_trls_batch(fmt, masks):
    """At cp 2 both ranks get TRL's rows (padded on to the layout's multiple) and pixels, and
    their label shards put together are TRL's labels shifted on the full row: the same tokens
    learned, image placeholders included where TRL learns them."""
    from vlm_sft_data import sft_vlm_dataset, shapes_processor

    from hf_ring.sharding import unshard_sequence
    from hf_ring.training.trl.sft_collator import NUM_TOKENS_KEY
    from hf_ring.training.trl.sft_vision_collator import RingSFTVisionCollator

    processor = shapes_processor()
    rows = [dict(r) for r in sft_vlm_dataset(fmt, 3, seed=1)]
    trl = _trl_collator(processor, **masks)
    expected = trl([dict(r) for r in rows])
    batches = [RingSFTVisionCollator.for_trl(fake_cp_state(r, 2), trl, _model_config(processor))([dict(x) for x in rows])
               for r in range(2)]
    length = expected["input_ids"].shape[1]
    for batch in batches:
        assert batch["input_ids"].shape[1] % 4 == 0  # zigzag at cp 2: 4 chunks
        assert torch.equal(batch["input_ids"][:, :length], expected["input_ids"])
        assert torch.equal(batch["attention_mask"][:, :length], expected["attention_mask"])
        assert not batch["attention_mask"][:, length:].any()
        assert torch.equal(batch["mm_token_type_ids"][:, :length], expected["mm_token_type_ids"])
        assert torch.equal(batch["pixel_values"], expected["pixel_values"])
        assert torch.equal(batch["image_grid_thw"], expected["image_grid_thw"])
        assert batch[NUM_TOKENS_KEY] == int(expected["attention_mask"].sum())
    shifted = unshard_sequence([b["shift_labels"] for b in batches], dim=1)
    assert torch.equal(shifted[:, : length - 1], expected["labels"][:, 1:])
    assert (shifted[:, length - 1:] == -100).all()
    placeholders_learned = bool((shifted == processor.image_token_id).any())
    assert placeholders_learned == (not masks)


def test_collator_refusals():
    from vlm_sft_data import sft_vlm_dataset, shapes_processor

    from hf_ring import RingVisionDataCollator
    from hf_ring.training.trl.sft_vision_collator import RingSFTVisionCollator, split_batch

    processor = shapes_processor()
    rows = [dict(r) for r in sft_vlm_dataset("messages", 2, seed=1)]
    with pytest.raises(ValueError, match="mask_placeholders=False"):
        RingSFTVisionCollator(_trl_collator(processor), RingVisionDataCollator(0, processor.image_token_id))
    # TRL cuts prompt-completion rows itself, after the processor (which checks its own truncation).
    cut = RingSFTVisionCollator.for_trl(fake_cp_state(0, 2), _trl_collator(processor, max_length=12, completion_only_loss=True),
                                        _model_config(processor))
    with pytest.raises(ValueError, match="max_length=12 cut an example's image placeholder tokens"):
        cut([dict(r) for r in sft_vlm_dataset("prompt_completion", 2, seed=1)])
    batch = dict(_trl_collator(processor)([dict(r) for r in rows]))
    with pytest.raises(NotImplementedError, match=r"\['pixel_attention_mask'\]"):
        split_batch({**batch, "pixel_attention_mask": torch.ones(1)}, [1, 1])
    with pytest.raises(ValueError, match="cannot tell which pixels belong to which example"):
        split_batch(batch, [len(r["images"]) + 1 for r in rows])


@pytest.mark.parametrize("option, says", [({"packing": True}, "packing=False"),
                                          ({"padding_free": True}, "padding_free=False"),
                                          ({"max_length": 64, "truncation_mode": "keep_end"}, "keep_end")])
def test_what_trl_refuses_with_images_ring_refuses_too(tmp_path, fresh_process_state, option, says):
    """Packed or padding-free image-text rows, and keep-end truncation (which can cut images
    off their pixels): TRL refuses them for vision datasets, before hf_ring is reached."""
    from transformers import AutoModelForImageTextToText
    from trl import SFTConfig
    from vlm_sft_data import sft_vlm_dataset, shapes_processor

    from hf_ring import RingAttentionPlugin
    from hf_ring.trl import RingSFTTrainer

    processor = shapes_processor()
    model = AutoModelForImageTextToText.from_config(_model_config(processor))
    config = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **option)
    with pytest.raises(ValueError, match=says):
        RingSFTTrainer(model=model, args=config, train_dataset=sft_vlm_dataset("messages", 2, seed=1),
                       processing_class=processor, ring_plugin=RingAttentionPlugin())


@pytest.mark.parametrize("loss_mean, warns", [("auto", False), ("micro_batches", False), ("tokens", True)])
def test_warns_where_the_mean_departs_from_trl(tmp_path, fresh_process_state, caplog, loss_mean, warns):
    """Qwen2.5-VL sets accepts_loss_kwargs=False: with accumulation TRL's loss is a mean of the
    micro-batches' means, which "auto" follows; the token mean of the step, asked for by name,
    departs from it, and RingSFTTrainer says so."""
    from transformers import AutoModelForImageTextToText
    from trl import SFTConfig
    from vlm_sft_data import sft_vlm_dataset, shapes_processor

    from hf_ring import RingAttentionPlugin
    from hf_ring.trl import RingSFTTrainer

    processor = shapes_processor()
    model = AutoModelForImageTextToText.from_config(_model_config(processor))
    assert model.accepts_loss_kwargs is False
    config = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", gradient_accumulation_steps=2)
    with caplog.at_level("WARNING", logger="hf_ring.training.trainer"):
        trainer = RingSFTTrainer(model=model, args=config, train_dataset=sft_vlm_dataset("messages", 2, seed=1),
                                 processing_class=processor, ring_plugin=RingAttentionPlugin(), loss_mean=loss_mean)
    assert trainer.loss_mean == ("tokens" if loss_mean == "tokens" else "micro_batches")
    said = "loss_mean='tokens' trains on the token mean of the whole step instead" in caplog.text
    assert said == warns, caplog.text


def test_an_unknown_loss_mean_is_refused(tmp_path, fresh_process_state):
    from transformers import AutoModelForImageTextToText
    from trl import SFTConfig
    from vlm_sft_data import shapes_processor

    from hf_ring import RingAttentionPlugin
    from hf_ring.trl import RingSFTTrainer

    processor = shapes_processor()
    model = AutoModelForImageTextToText.from_config(_model_config(processor))
    with pytest.raises(ValueError, match=r"loss_mean='sample' is not one of \('auto', 'tokens', 'micro_batches'\)"):
        RingSFTTrainer(model=model, args=SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none"),
                       processing_class=processor, ring_plugin=RingAttentionPlugin(), loss_mean="sample")
