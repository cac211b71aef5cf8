"""RingDataCollator against a plain reference: pad, shift on the full row, then shard."""

from __future__ import annotations

import random

import pytest
import torch

from hf_ring import RingCollatorConfig, RingDataCollator
from hf_ring.sharding import shard_indices, unshard_packed, unshard_sequence

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

PAD = 99
IGN = -100


def _examples(lengths, seed=0, mask_prompt=True):
    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids = [rng.randrange(0, 90) for _ in range(n)]
        if mask_prompt:
            k = rng.randrange(0, n)
            labels = [IGN] * k + ids[k:]
        else:
            labels = None
        out.append({"input_ids": ids, "labels": labels} if labels is not None else {"input_ids": ids})
    return out


def _round_up(n, m):
    return (n + m - 1) // m * m


def _reference_dense(examples, multiple):
    """Full (unsharded) batch, built with plain lists."""
    length = _round_up(max(len(e["input_ids"]) for e in examples), multiple)
    ids, labels, shifted, pos = [], [], [], []
    for e in examples:
        n = len(e["input_ids"])
        lab = list(e.get("labels") or e["input_ids"])
        ids.append(list(e["input_ids"]) + [PAD] * (length - n))
        full_lab = lab + [IGN] * (length - n)
        labels.append(full_lab)
        shifted.append(full_lab[1:] + [IGN])
        pos.append(list(range(length)))
    return {k: torch.tensor(v) for k, v in
            {"input_ids": ids, "labels": labels, "shift_labels": shifted, "position_ids": pos}.items()}


def _reference_packed(examples, multiple):
    ids, labels, shifted, pos, bounds = [], [], [], [], [0]
    for e in examples:
        n = len(e["input_ids"])
        padded = _round_up(n, multiple)
        lab = list(e.get("labels") or e["input_ids"]) + [IGN] * (padded - n)
        ids += list(e["input_ids"]) + [PAD] * (padded - n)
        labels += lab
        shifted += lab[1:] + [IGN]
        pos += list(range(padded))
        bounds.append(bounds[-1] + padded)
    full = {k: torch.tensor([v]) for k, v in
            {"input_ids": ids, "labels": labels, "shift_labels": shifted, "position_ids": pos}.items()}
    return full, torch.tensor(bounds)


@pytest.mark.parametrize("layout", ["zigzag", "stripe", "contiguous"])
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_dense_equals_shift_then_shard(layout, cp_size):
    examples = _examples([37, 50, 11], seed=cp_size)
    multiple = 2 * cp_size if layout == "zigzag" else cp_size
    ref = _reference_dense(examples, multiple)
    shards = [RingDataCollator(PAD, cp_size=cp_size, cp_rank=r, layout=layout)(examples) for r in range(cp_size)]
    for key, full in ref.items():
        for r, shard in enumerate(shards):
            idx = shard_indices(full.shape[1], cp_size, r, layout)
            assert torch.equal(shard[key], full[:, idx]), (key, r)
        assert torch.equal(unshard_sequence([s[key] for s in shards], dim=1, layout=layout), full), key
    assert set(shards[0]) == {"input_ids", "labels", "shift_labels", "position_ids"}


def test_padding_and_label_edges():
    examples = [{"input_ids": [5, 6, 7], "labels": [IGN, 6, 7]}, {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9]}]
    out = RingDataCollator(PAD, cp_size=1)(examples)
    assert out["input_ids"].shape == (2, 10)  # 9 rounded up to a multiple of 2 * cp_size = 2
    assert out["input_ids"][0].tolist() == [5, 6, 7] + [PAD] * 7
    assert out["labels"][0].tolist() == [IGN, 6, 7] + [IGN] * 7
    # The last real token and all padding learn nothing.
    assert out["shift_labels"][0].tolist() == [6, 7] + [IGN] * 8
    assert out["shift_labels"][1].tolist() == [2, 3, 4, 5, 6, 7, 8, 9, IGN, IGN]
    assert out["position_ids"][1].tolist() == list(range(10))
    assert out["input_ids"].dtype == torch.long


def test_pad_to_multiple_and_attention_mask():
    examples = _examples([13, 5], mask_prompt=False)
    out = RingDataCollator(PAD, cp_size=2, cp_rank=1, pad_to_multiple_of=16, return_attention_mask=True)(examples)
    assert out["input_ids"].shape == (2, 8)  # 16 tokens over 2 ranks
    full = unshard_sequence(
        [RingDataCollator(PAD, cp_size=2, cp_rank=r, pad_to_multiple_of=16, return_attention_mask=True)(examples)
         ["attention_mask"] for r in range(2)], dim=1)
    assert full[0].tolist() == [1] * 13 + [0] * 3
    assert full[1].tolist() == [1] * 5 + [0] * 11


def test_masked_prompt_leaves_some_shards_without_labels():
    # The answer sits at the end: under zigzag only the ranks holding the last chunk learn.
    ids = list(range(1, 33))
    labels = [IGN] * 30 + ids[30:]
    shards = [RingDataCollator(0, cp_size=4, cp_rank=r)([{"input_ids": ids, "labels": labels}]) for r in range(4)]
    valid = [int(s["shift_labels"].ne(IGN).sum()) for s in shards]
    assert valid == [2, 0, 0, 0]  # positions 29 and 30 predict the answer; rank 0 holds chunk 7 (28-31)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_packing_equals_per_document_shift_then_shard(cp_size):
    examples = _examples([7, 16, 3, 21], seed=cp_size)
    ref, bounds = _reference_packed(examples, 2 * cp_size)
    shards = [RingDataCollator(PAD, cp_size=cp_size, cp_rank=r, packing=True)(examples) for r in range(cp_size)]
    for shard in shards:
        assert shard["cu_seq_lens_q"].dtype == torch.int32
        assert shard["cu_seq_lens_q"].tolist() == bounds.tolist()
        assert shard["cu_seq_lens_k"].tolist() == bounds.tolist()
        lengths = (bounds[1:] - bounds[:-1]).tolist()
        assert shard["max_length_q"] == shard["max_length_k"] == max(lengths)
        assert all(n % (2 * cp_size) == 0 for n in lengths)
        assert shard["input_ids"].shape == (1, int(bounds[-1]) // cp_size)
    for key, full in ref.items():
        got = unshard_packed([s[key] for s in shards], bounds, dim=1)
        assert torch.equal(got, full), key


def test_packing_boundaries():
    examples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6, 7, 8]}]
    out = RingDataCollator(PAD, packing=True)(examples)
    assert out["cu_seq_lens_q"].tolist() == [0, 4, 10]
    assert out["input_ids"].tolist() == [[1, 2, 3, PAD, 4, 5, 6, 7, 8, PAD]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]]
    # Token 3 (end of document 0) does not learn token 4 (start of document 1).
    assert out["shift_labels"].tolist() == [[2, 3, IGN, IGN, 5, 6, 7, 8, IGN, IGN]]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cp_size=0), "cp_size"),
        (dict(cp_size=2, cp_rank=2), "cp_rank"),
        (dict(layout="diagonal"), "layout"),
        (dict(packing=True, layout="stripe"), "zigzag"),
        (dict(packing=True, return_attention_mask=True), "attention_mask"),
        (dict(cp_size=2, pad_to_multiple_of=6), "multiple of 4"),
        (dict(cp_size=3, layout="stripe", pad_to_multiple_of=4), "multiple of 3"),
        (dict(pad_token_id=-1), "pad_token_id"),
    ],
)
def test_config_errors(kwargs, match):
    kwargs.setdefault("pad_token_id", PAD)
    with pytest.raises(ValueError, match=match):
        RingCollatorConfig(**kwargs)


@pytest.mark.parametrize(
    "features, match",
    [
        ([], "empty batch"),
        ([{"labels": [1, 2]}], "no 'input_ids'"),
        ([{"input_ids": []}], "no tokens"),
        ([{"input_ids": [1, 2, 3], "labels": [1, 2]}], "one label per token"),
        ([{"input_ids": [[1, 2], [3, 4]]}], "1-d"),
        ([{"input_ids": [1.0, 2.0]}], "integers"),
        ([{"input_ids": [0, 1, 2], "attention_mask": [0, 1, 1]}], "already padded"),
    ],
)
def test_input_errors(features, match):
    with pytest.raises(ValueError, match=match):
        RingDataCollator(PAD, cp_size=2, cp_rank=0)(features)


def test_config_object_and_conflicts():
    cfg = RingCollatorConfig(pad_token_id=PAD, cp_size=2, cp_rank=1)
    collator = RingDataCollator(config=cfg)
    assert collator.config is cfg
    with pytest.raises(ValueError, match="not both"):
        RingDataCollator(PAD, config=cfg)
    with pytest.raises(ValueError, match="pad_token_id"):
        RingDataCollator()
