"""``RingVisionDataCollator``: the full image-text batch on every rank, only the labels sharded.

In-process, no model: the labels a rank gets are ``shard_sequence`` of the labels shifted on
the full row (placeholders, padding and each row's last token -100) in the state's layout,
for cp 1, 2 and 4 and each layout, and the shards put back together are the full shifted
labels (exact: integer tensors); everything else is the full batch, the same for every
rank; rows are padded at their end to the layout's multiple. Refusals, each with what to
do: placeholders without pixels and pixels without placeholders, placeholder counts that
disagree with the grids, patches that disagree with the grids, inputs it cannot batch,
already padded rows, ``model_labels`` under CP, a collator that shards for another rank than
the trainer's. The packing mode: tests/test_vision_collator_packing.py.
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from hf_ring.sharding.labels import IGNORE_INDEX

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

PAD, IMAGE, VIDEO = 0, 9, 10


def _feature(n_text: int, grids: list[list[int]], video: list[list[int]] = ()) -> dict:
    """Text tokens, then one image placeholder run per grid (t*h*w/4 tokens), then videos."""
    ids, kinds = list(range(11, 11 + n_text)), [0] * n_text
    for token, kind, gs in ((IMAGE, 1, grids), (VIDEO, 2, video)):
        for g in gs:
            n = g[0] * g[1] * g[2] // 4
            ids += [token] * n + [20]
            kinds += [kind] * n + [0]
    out = {"input_ids": ids, "mm_token_type_ids": kinds}
    if grids:
        out.update(pixel_values=torch.randn(sum(a * b * c for a, b, c in grids), 12), image_grid_thw=torch.tensor(grids))
    if video:
        out.update(pixel_values_videos=torch.randn(sum(a * b * c for a, b, c in video), 12),
                   video_grid_thw=torch.tensor(video), second_per_grid_ts=torch.ones(len(video)))
    return out


FEATURES = [_feature(5, [[1, 4, 4], [1, 2, 4]]), _feature(3, [[1, 2, 2]], video=[[2, 2, 4]])]


def _collator(**kwargs) -> hf_ring.RingVisionDataCollator:
    return hf_ring.RingVisionDataCollator(PAD, IMAGE, video_token_id=VIDEO, spatial_merge_size=2, **kwargs)


@pytest.mark.parametrize("layout", ["zigzag", "stripe", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_full_batch_everywhere_and_the_labels_sharded(cp, layout):
    full = _collator(model_labels=True)(FEATURES) if cp == 1 and layout == "zigzag" else None
    outs = [_collator(cp_size=cp, cp_rank=r, layout=layout)(FEATURES) for r in range(cp)]
    ids = outs[0]["input_ids"]
    length = ids.shape[1]
    assert length % hf_ring.sharding.required_multiple(cp, layout) == 0
    lengths = [len(f["input_ids"]) for f in FEATURES]
    assert length == max(lengths) + (-max(lengths)) % hf_ring.sharding.required_multiple(cp, layout)
    for out in outs:
        assert "labels" not in out and "position_ids" not in out
        for key in ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw",
                    "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
            assert torch.equal(out[key], outs[0][key]), key
    assert outs[0]["pixel_values"].shape[0] == 16 + 8 + 4 and outs[0]["video_grid_thw"].tolist() == [[2, 2, 4]]
    mask = outs[0]["attention_mask"]
    assert mask.sum(1).tolist() == lengths and bool((ids[mask == 0] == PAD).all())
    expected = torch.full_like(ids, IGNORE_INDEX)
    expected[:, :-1] = torch.where((ids == IMAGE) | (ids == VIDEO) | (mask == 0), IGNORE_INDEX, ids)[:, 1:]
    expected[torch.arange(2), torch.tensor(lengths) - 1] = IGNORE_INDEX  # a row's last token predicts nothing
    shards = [o["shift_labels"] for o in outs]
    assert all(s.shape == (2, length // cp) for s in shards)
    for r, s in enumerate(shards):
        assert torch.equal(s, hf_ring.shard_sequence(expected, cp, r, dim=1, layout=layout))
    assert torch.equal(hf_ring.unshard_sequence(shards, dim=1, layout=layout), expected)
    if full is not None:  # the stock model's labels: unshifted, the same masks
        learned = expected[:, :-1] != IGNORE_INDEX
        assert torch.equal(full["labels"][:, 1:][learned], expected[:, :-1][learned])
        assert "shift_labels" not in full


def _error(features, **kwargs) -> str:
    with pytest.raises((ValueError, NotImplementedError)) as info:
        _collator(**kwargs)(features)
    return str(info.value)


def test_bad_inputs_are_refused():
    no_pixels = dict(FEATURES[0])
    del no_pixels["pixel_values"]
    assert "6 image placeholder tokens (id 9) but no pixel_values" in _error([no_pixels])
    no_marks = _feature(5, [])
    no_marks.update(pixel_values=torch.randn(4, 12), image_grid_thw=torch.tensor([[1, 2, 2]]))
    assert "has pixel_values but no image placeholder token" in _error([no_marks])
    wrong_count = dict(FEATURES[0], image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]),
                       pixel_values=torch.randn(32, 12))
    assert "has 6 image placeholder tokens but its image_grid_thw" in _error([wrong_count])
    wrong_patches = dict(FEATURES[0], pixel_values=torch.randn(7, 12))
    assert "pixel_values has 7 patches" in _error([wrong_patches])
    assert "does not know how to batch: ['image_embeds']" in _error([dict(FEATURES[0], image_embeds=[0])])
    assert "some examples have token_type_ids and others not" in _error(
        [dict(FEATURES[0], token_type_ids=[0] * len(FEATURES[0]["input_ids"])), FEATURES[1]])
    padded = dict(FEATURES[0], attention_mask=[1] * 5 + [0] * (len(FEATURES[0]["input_ids"]) - 5))
    assert "already padded" in _error([padded])
    assert "has video inputs but the collator has no video_token_id" in str(
        pytest.raises(ValueError, hf_ring.RingVisionDataCollator(PAD, IMAGE), [FEATURES[1]]).value)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="model_labels=True hands the model its labels"):
        _collator(cp_size=2, model_labels=True)
    with pytest.raises(ValueError, match="must be a positive multiple of 4"):
        _collator(cp_size=2, pad_to_multiple_of=6)
    with pytest.raises(ValueError, match="cp_rank must be"):
        _collator(cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="both 9"):
        hf_ring.RingVisionDataCollator(PAD, IMAGE, video_token_id=IMAGE)


def test_the_plugin_builds_it_for_its_state(tmp_path):
    from accelerate.state import AcceleratorState
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    plugin = hf_ring.RingAttentionPlugin(cp_size=1)
    try:
        collator = plugin.make_vision_collator(PAD, IMAGE)
        assert collator.matches(plugin.state) and isinstance(collator, hf_ring.RingVisionDataCollator)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1)
        with pytest.raises(ValueError, match="make_collator"):
            hf_ring.RingTrainer(model=model, args=args, ring_plugin=plugin,
                                data_collator=hf_ring.RingVisionDataCollator(PAD, IMAGE, cp_size=2))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        hf_ring.set_context_parallel_state(None)
