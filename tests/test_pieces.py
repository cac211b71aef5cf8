"""Pieces (hf_ring.sharding.pieces) describe exactly the tokens each rank holds: read back
as global positions, every rank's pieces are its shard, and in sequence order they tile
each document once, chunk after chunk."""

from __future__ import annotations

import pytest
import torch

from hf_ring.sharding import packed_shard_indices, shard_indices
from hf_ring.sharding.pieces import in_sequence_order, row_pieces

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)


def _positions(piece, doc_starts, doc_lens):
    chunk = doc_lens[piece.doc] // piece.chunks
    start = doc_starts[piece.doc] + piece.chunk * chunk
    return torch.arange(start, start + chunk)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dense_pieces_are_each_ranks_shard(layout, world):
    seq = 24 * world
    pieces = row_pieces(layout, world, seq // world)
    for rank in range(world):
        held = torch.cat([_positions(p, [0], [seq]) for p in pieces[rank]])
        assert torch.equal(held, shard_indices(seq, world, rank, layout))
        assert [p.local_start for p in pieces[rank]] == [sum(q.length for q in pieces[rank][:i])
                                                         for i in range(len(pieces[rank]))]
    order = in_sequence_order(pieces)
    assert torch.equal(torch.cat([_positions(p, [0], [seq]) for p in order]), torch.arange(seq))
    assert [p.first for p in order] == [True] + [False] * (len(order) - 1)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_packed_pieces_follow_each_document(world):
    doc_lens = [2 * world * n for n in (3, 1, 5)]
    starts = [0, doc_lens[0], doc_lens[0] + doc_lens[1]]
    cu = torch.tensor([0, *torch.tensor(doc_lens).cumsum(0).tolist()])
    pieces = row_pieces("zigzag", world, sum(doc_lens) // world, [n // world for n in doc_lens])
    for rank in range(world):
        held = torch.cat([_positions(p, starts, doc_lens) for p in pieces[rank]])
        assert torch.equal(held, packed_shard_indices(cu, world, rank))
    firsts = [(p.doc, p.chunk) for p in in_sequence_order(pieces) if p.first]
    assert firsts == [(0, 0), (1, 0), (2, 0)]


def test_stripe_and_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="one-token runs.*use layout 'zigzag' or 'contiguous'"):
        row_pieces("stripe", 2, 8)
    with pytest.raises(ValueError, match="do not make up"):
        row_pieces("zigzag", 2, 8, [2, 2])
    with pytest.raises(ValueError, match="not a multiple of 2"):
        row_pieces("zigzag", 2, 6, [3, 3])
