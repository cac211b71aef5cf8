"""``RingVisionDataCollator(packing=True)``: a batch of image-text samples as one packed row.

In-process, tiny models (tests/vlm_cases.py), transformers 5.x. What every rank of a CP group
gets is ``pack_image_text``'s packed row (each sample a document with its own images,
padding and the model's own positions for it alone), the same on every rank, and this rank's
``shift_labels``: compared exactly (integer tensors, the same pixel values) with
``pack_image_text`` for cp 1, 2 and 4 and every rank, and the ranks' labels put back
(``unshard_packed``) are the per-document shifted labels. With ``model_labels`` (the stock
Trainer at cp 1) the labels carry each document's first token as -100, so the stock model's
own loss over the whole row (it shifts the row) is each sample's loss alone: checked on the
model within 1e-5 relative (float32, the same sums in another order: SDPA over the packed row
against SDPA per sample; measured 0 on this CPU). Refused, each saying what to do: packing without
the model, a model without packing, the stripe layout, PaliGemma (one prefix a row), another
image token than the model's, and the stock path with a model that would build a cache (its
mask would then let the documents attend to each other: shown here to move the loss).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

import hf_ring
from hf_ring.patches.transformers import release_line
from hf_ring.sharding import unshard_packed
from hf_ring.training.collator import RingCollatorConfig, _shift
from hf_ring.training.vision.packing import pack_image_text
from closeness import rel_err
from vlm_cases import FAMILIES, IMAGE, PACKED_SAMPLES, VIDEO, build, tiny_gemma

pytestmark = pytest.mark.skipif(release_line(transformers.__version__) != "5",
                                reason="the multimodal families were read and tested on transformers 5.x")

LOSS_TOL = 1e-5


def _features(samples: list[dict]) -> list[dict]:
    """The packing samples ((1, n) rows) as the collator's features ((n,) rows)."""
    return [{k: (v[0] if k in ("input_ids", "mm_token_type_ids") else v) for k, v in s.items()} for s in samples]


def _collator(model, **kwargs) -> hf_ring.RingVisionDataCollator:
    return hf_ring.RingVisionDataCollator(0, IMAGE, video_token_id=VIDEO, packing=True, model=model, **kwargs)


@pytest.fixture(scope="module")
def qwen():
    model = build(FAMILIES["qwen2_5_vl"][0](), "sdpa")
    model.config.get_text_config().use_cache = False  # what the stock path needs (refused otherwise: below)
    return model


@pytest.mark.parametrize("name", ("qwen2_5_vl", "llava"))
@pytest.mark.parametrize("cp", (1, 2, 4))
def test_each_rank_gets_the_packed_row_and_its_labels(name, cp):
    model = build(FAMILIES[name][0](), "sdpa")
    samples = PACKED_SAMPLES[name](0)
    shards = []
    for rank in range(cp):
        got = _collator(model, cp_size=cp, cp_rank=rank)(_features(samples))
        want = pack_image_text(samples, model, RingCollatorConfig(pad_token_id=0, cp_size=cp, cp_rank=rank,
                                                                  packing=True))
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            same = torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value
            assert same, (key, rank)
        shards.append(got["shift_labels"])
    cu = want["cu_seq_lens_q"]
    full = unshard_packed(shards, cu)
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ids = samples[i]["input_ids"][0]
        expected = torch.full((end - start,), -100)
        expected[:ids.numel() - 1] = ids[1:].masked_fill(torch.isin(ids[1:], torch.tensor([IMAGE, VIDEO])), -100)
        assert torch.equal(full[0, start:end], expected), i


def test_the_stock_models_own_loss_is_each_sample_alone(qwen):
    """model_labels: the stock model shifts the whole row; the first label of each document
    being -100, no document learns the next one's first token."""
    samples = PACKED_SAMPLES["qwen2_5_vl"](0)
    batch = _collator(qwen, model_labels=True)(_features(samples))
    assert torch.equal(_shift(batch["labels"]), _collator(qwen)(_features(samples))["shift_labels"])
    with torch.no_grad():
        packed = qwen(**batch).loss
        total, count = 0.0, 0
        for s in samples:
            ids = s["input_ids"][0]
            labels = ids.masked_fill(torch.isin(ids, torch.tensor([IMAGE, VIDEO])), -100)[1:]
            total += F.cross_entropy(qwen(**s).logits[0, :-1], labels, ignore_index=-100, reduction="sum")
            count += int((labels != -100).sum())
        assert rel_err(packed, total / count) <= LOSS_TOL, rel_err(packed, total / count)
        # Control: with a cache the stock mask is causal over the whole row.
        across = qwen(**batch, use_cache=True).loss
    assert rel_err(across, total / count) > 10 * LOSS_TOL  # measured 4.4e-4: an untrained model, near-uniform


def test_what_it_cannot_pack_is_refused(qwen):
    features = _features(PACKED_SAMPLES["qwen2_5_vl"](0))
    with pytest.raises(ValueError, match="packing=True needs model="):
        _collator(None)
    with pytest.raises(ValueError, match="used only with packing=True"):
        hf_ring.RingVisionDataCollator(0, IMAGE, model=qwen)
    with pytest.raises(ValueError, match="use layout='zigzag' with packing=True"):
        _collator(qwen, cp_size=2, layout="stripe")
    with pytest.raises(NotImplementedError, match="PaliGemma.*one prefix per document"):
        hf_ring.RingVisionDataCollator(0, 120, packing=True, model=tiny_gemma("paligemma", "sdpa"))
    with pytest.raises(ValueError, match="give the collator the model's image token"):
        hf_ring.RingVisionDataCollator(0, IMAGE + 1, packing=True, model=qwen)
    text = qwen.config.get_text_config()
    text.use_cache = True
    try:
        with pytest.raises(ValueError, match="use_cache = False"):
            _collator(qwen, model_labels=True)(features)
        _collator(qwen)(features)  # RingTrainer passes use_cache=False itself
    finally:
        text.use_cache = False


def test_the_plugin_hands_it_the_model(qwen):
    plugin = hf_ring.RingAttentionPlugin(cp_size=1)
    try:
        collator = plugin.make_vision_collator(0, IMAGE, video_token_id=VIDEO, packing=True, model=qwen)
        assert collator.matches(plugin.state) and collator.model is qwen
    finally:
        hf_ring.set_context_parallel_state(None)
