"""Sharding index math against plain definitions of each layout."""

from __future__ import annotations

import pytest
import torch

import hf_ring
from hf_ring.sharding import packed_shard_indices, shard_indices, shard_packed, unshard_packed

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "stripe", "contiguous"])
def test_shard_then_unshard_is_identity(cp, layout):
    x = torch.randn(2, 10 * cp, 3)
    shards = [hf_ring.shard_sequence(x, cp, r, dim=1, layout=layout) for r in range(cp)]
    assert all(s.shape == (2, 10, 3) for s in shards)
    assert torch.equal(hf_ring.unshard_sequence(shards, dim=1, layout=layout), x)


def test_layout_definitions():
    # 12 tokens over 3 ranks.
    assert shard_indices(12, 3, 1, "zigzag").tolist() == [2, 3, 8, 9]  # chunks 1 and 4 of 6
    assert shard_indices(12, 3, 1, "stripe").tolist() == [1, 4, 7, 10]
    assert shard_indices(12, 3, 1, "contiguous").tolist() == [4, 5, 6, 7]
    for layout in ("zigzag", "stripe", "contiguous"):
        every = torch.cat([shard_indices(12, 3, r, layout) for r in range(3)])
        assert sorted(every.tolist()) == list(range(12)), layout


def test_shard_along_other_dims():
    x = torch.arange(2 * 3 * 8).view(2, 3, 8)
    got = hf_ring.shard_sequence(x, 2, 1, dim=-1)
    assert torch.equal(got, x[..., [2, 3, 4, 5]])


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="not a multiple of 4"):
        hf_ring.shard_sequence(torch.zeros(1, 6), 2, 0)
    with pytest.raises(ValueError, match="unknown context-parallel layout"):
        hf_ring.shard_sequence(torch.zeros(1, 8), 2, 0, layout="ring")
    with pytest.raises(ValueError, match="cp_rank"):
        hf_ring.shard_sequence(torch.zeros(1, 8), 2, 2)
    with pytest.raises(ValueError, match="same shape"):
        hf_ring.unshard_sequence([torch.zeros(1, 4), torch.zeros(1, 2)])


def test_packed_layout_is_zigzag_per_document():
    cu = torch.tensor([0, 8, 12, 28])  # documents of 8, 4 and 16 tokens, cp 2
    idx = packed_shard_indices(cu, 2, 1).tolist()
    assert idx == [2, 3, 4, 5] + [9, 10] + [16, 17, 18, 19, 20, 21, 22, 23]
    x = torch.randn(1, 28, 5)
    shards = [shard_packed(x, cu, 2, r) for r in range(2)]
    assert torch.equal(unshard_packed(shards, cu), x)


def test_packed_errors():
    with pytest.raises(ValueError, match="not a multiple of 2 \\* cp_size = 4"):
        packed_shard_indices(torch.tensor([0, 8, 10]), 2, 0)
    with pytest.raises(ValueError, match="start at 0"):
        packed_shard_indices(torch.tensor([4, 8]), 2, 0)
    with pytest.raises(ValueError, match="strictly increasing"):
        packed_shard_indices(torch.tensor([0, 8, 8]), 2, 0)
    with pytest.raises(ValueError, match="same packed sequence"):
        shard_packed(torch.zeros(1, 12), torch.tensor([0, 8]), 2, 0)
