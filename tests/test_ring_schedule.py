"""The ring schedule against brute force: the blocks each rank computes cover exactly the
query-key pairs a causal mask over global positions allows, once each, and the causal work
is balanced for zigzag and stripe (and not for contiguous)."""

from __future__ import annotations

from typing import Optional, Sequence

import pytest
import torch

from hf_ring.patterns.ring.schedule import step_blocks
from hf_ring.sharding import local_cu_seqlens, packed_shard_indices, shard_indices

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)


def rank_work(layout: str, causal: bool, local_len: int, rank: int, world: int,
              local_doc_lens: Optional[Sequence[int]] = None) -> float:
    """Query-key pairs rank ``rank`` computes over the whole ring (for balance checks)."""
    return sum(b.work for step in range(world)
               for b in step_blocks(layout, causal, local_len, rank, (rank - step) % world, local_doc_lens))


def _covered_pairs(layout, causal, global_idx, world, rank, local_doc_lens=None):
    """Global (query, key) pairs the blocks of ``rank`` visit, with their multiplicity."""
    local = global_idx[rank].numel()
    pairs = []
    for step in range(world):
        src = (rank - step) % world
        for b in step_blocks(layout, causal, local, rank, src, local_doc_lens):
            for qi in range(b.q_start, b.q_end):
                for ki in range(b.k_start, b.k_end):
                    if b.causal and ki - b.k_start > qi - b.q_start:
                        continue
                    pairs.append((int(global_idx[rank][qi]), int(global_idx[src][ki])))
    return pairs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "stripe", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_blocks_cover_exactly_the_visible_pairs(world, layout, causal):
    seq = 6 * world
    idx = [shard_indices(seq, world, r, layout) for r in range(world)]
    for rank in range(world):
        pairs = _covered_pairs(layout, causal, idx, world, rank)
        want = {(int(q), k) for q in idx[rank] for k in range(seq) if not causal or k <= q}
        assert len(pairs) == len(set(pairs)), "a pair is computed twice"
        assert set(pairs) == want


@pytest.mark.parametrize("world", [2, 4])
def test_packed_blocks_stay_within_documents(world):
    doc_lens = [2 * world * n for n in (1, 3, 2)]
    cu = torch.tensor([0, *torch.tensor(doc_lens).cumsum(0).tolist()])
    doc_of = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    local_lens = (local_cu_seqlens(cu, world).diff()).tolist()
    idx = [packed_shard_indices(cu, world, r) for r in range(world)]
    for rank in range(world):
        pairs = _covered_pairs("zigzag", True, idx, world, rank, local_lens)
        want = {(int(q), k) for q in idx[rank] for k in range(int(cu[-1])) if k <= q and doc_of[k] == doc_of[q]}
        assert len(pairs) == len(set(pairs)) and set(pairs) == want


@pytest.mark.parametrize("world", [2, 4, 8])
def test_causal_work_per_rank(world):
    local = 2 * 64
    work = {
        layout: [rank_work(layout, True, local, r, world) for r in range(world)]
        for layout in ("zigzag", "stripe", "contiguous")
    }
    # zigzag: every step is (2c x c) pairs plus the diagonal; exactly equal per rank.
    assert len(set(work["zigzag"])) == 1
    # stripe: rank r sees its own-index key on r + 1 of the N steps, so neighbouring ranks
    # differ by exactly one diagonal (local pairs): (N - 1) * local in all, a share of the
    # work that falls as 2 / local (under 0.1% at 2048 tokens per rank).
    assert max(work["stripe"]) - min(work["stripe"]) == (world - 1) * local
    at_2048 = [rank_work("stripe", True, 2048, r, world) for r in range(world)]
    assert max(at_2048) / min(at_2048) < 1.001
    # contiguous: the last rank does (2N - 1) times the work of the first.
    assert max(work["contiguous"]) / min(work["contiguous"]) == pytest.approx(2 * world - 1, rel=0.02)


def test_packed_work_is_balanced_on_mixed_lengths():
    world = 4
    doc_lens = [8 * n for n in (1, 37, 5, 120, 2, 64, 13)]  # mixed, each a multiple of 2 * world
    local_lens = [n // world for n in doc_lens]
    work = [rank_work("zigzag", True, sum(local_lens), r, world, local_lens) for r in range(world)]
    assert max(work) / min(work) <= 1.05
