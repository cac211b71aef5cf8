"""The Ulysses pattern (DeepSpeed Ulysses): all-to-all from sequence shards to head shards.

Each of the ``U`` ranks of a Ulysses group holds a shard of the sequence for every head.
One all-to-all per tensor gives every rank all of the group's tokens for ``1/U`` of the
heads; attention then runs over those tokens with nothing else to exchange, and one
all-to-all turns the output back into sequence shards for every head. The backward is the
same exchanges in reverse (the all-to-all is its own inverse), around the kernel's
backward: autograd composes them (collectives.all_to_all).

Pure Ulysses (a group of all ranks) attends the full sequence in its global order; the
hybrid pattern (hybrid.py) takes a Ulysses group's tokens in the order of a ring across
the groups. :func:`seq_to_heads` therefore reorders the received tokens to ``target``
positions, which the caller chooses. A packed row is reordered the same way, document
by document: pure Ulysses puts it in the row's order, where one process's packed schedule
runs each document alone over its whole length; the hybrid puts a Ulysses group's tokens in
the zigzag of the ring across the groups (group ``g`` of ``R`` then holds chunks ``g`` and
``2R-1-g`` of every document, exactly the chunks its ranks held), where the ring's packed
schedule runs.

Heads: ``n_heads`` must be a multiple of ``U``. K/V heads are split the same way when
``n_kv_heads`` is a multiple of ``U``; when it is smaller and divides ``U``, each K/V head
is repeated ``U / n_kv_heads`` times before the exchange (the fewest copies that give
every rank the one K/V head its query heads use). Other head counts are refused, naming
the patterns that take any head count. Sinks are sliced to this rank's heads; their
gradient comes back through the slice (zeros for the other heads).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from hf_ring.distributed.collectives import Collectives, all_to_all
from hf_ring.patterns.plan import AttentionPlan
from hf_ring.patterns.ring.attention import ring_attention
from hf_ring.sharding.layouts import shard_indices
from hf_ring.sharding.packed import packed_shard_indices


def kv_repeat(n_heads: int, n_kv_heads: int, degree: int, pattern: str = "ulysses") -> int:
    """How many times each K/V head is repeated before a Ulysses exchange over ``degree``
    ranks (1: none); raises NotImplementedError for head counts it cannot split."""
    if n_heads % degree:
        raise NotImplementedError(
            f"pattern={pattern!r} splits the {n_heads} query heads over {degree} ranks, which needs "
            f"n_heads to be a multiple of {degree}; use pattern='allgather' or 'ring' (any head count)"
            + (" or 'hybrid' with a ulysses_size dividing n_heads" if pattern == "ulysses" else "")
        )
    if n_kv_heads % degree == 0:
        return 1
    if degree % n_kv_heads == 0:
        return degree // n_kv_heads
    raise NotImplementedError(
        f"pattern={pattern!r} cannot split {n_kv_heads} K/V heads over {degree} ranks (neither divides "
        "the other); use pattern='allgather' or 'ring' (any head count)"
    )


def _orders(seq: int, world: int, ranks: tuple[int, ...], layout: str, target: tuple[int, int, str],
            doc_lens: Optional[tuple[int, ...]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, inverse)`` int64 CPU tensors: the tokens of ``ranks`` (concatenated in that
    order, each sharded by ``layout`` over ``world``) taken in the order of
    ``shard_indices(seq, *target)``, and back. A packed row of documents of ``doc_lens``
    tokens: every document zigzag-sharded on its own, over ``world`` ranks as held and over
    ``target``'s ranks as wanted."""
    if doc_lens is None:
        held = torch.cat([shard_indices(seq, world, r, layout) for r in ranks])
        want = shard_indices(seq, *target)
    else:
        bounds = torch.tensor([0, *doc_lens]).cumsum(0)
        held = torch.cat([packed_shard_indices(bounds, world, r) for r in ranks])
        want = packed_shard_indices(bounds, target[0], target[1])
    sorted_pos, where = torch.sort(held)
    perm = where[torch.searchsorted(sorted_pos, want)]
    if not torch.equal(held[perm], want):
        raise ValueError(f"the tokens of ranks {ranks} are not those of {target} in layout {layout!r}")
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    return perm, inverse


# Every layer of a forward asks for the same shape, so a hit is the rule within a step; a
# run over many lengths (bucketed or packed batches) must not keep every length's tensors
# on the device. 16 shapes cover a bucketed run's lengths at the cost of one small sort and
# copy per miss.
ORDERS_CACHE_SHAPES = 16


@functools.lru_cache(maxsize=ORDERS_CACHE_SHAPES)
def orders(seq: int, world: int, ranks: tuple[int, ...], layout: str, target: tuple[int, int, str],
           device: torch.device, doc_lens: Optional[tuple[int, ...]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_orders` on ``device``, kept for the ``ORDERS_CACHE_SHAPES`` most recently used
    shapes (no copy on the hot path)."""
    return tuple(t.to(device) for t in _orders(seq, world, ranks, layout, target, doc_lens))


def _take(x: torch.Tensor, dim: int, order: Optional[torch.Tensor]) -> torch.Tensor:
    return x if order is None else x.index_select(dim, order)


def seq_to_heads(x: torch.Tensor, coll: Collectives, perm: Optional[torch.Tensor]) -> torch.Tensor:
    """x ``(b, s, h, d)`` (this rank's tokens, every head) -> ``(b, U * s, h / U, d)``: the
    group's tokens, taken in ``perm`` order (None: as received, rank after rank), for this
    rank's heads; differentiable."""
    b, s, h, d = x.shape
    u = coll.world
    x = x.view(b, s, u, h // u, d).permute(2, 0, 1, 3, 4)  # (U, b, s, h/U, d): head slice j to rank j
    x = all_to_all(x, coll)  # entry j: rank j's tokens, my heads
    return _take(x.permute(1, 0, 2, 3, 4).reshape(b, u * s, h // u, d), 1, perm)


def heads_to_seq(y: torch.Tensor, coll: Collectives, inverse: Optional[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`: y ``(b, U * s, h / U, d)`` -> ``(b, s, h, d)``."""
    b, n, hl, d = y.shape
    u = coll.world
    y = _take(y, 1, inverse).view(b, u, n // u, hl, d).permute(1, 0, 2, 3, 4)  # to rank j: its tokens
    y = all_to_all(y, coll)  # entry j: my tokens, rank j's heads
    return y.permute(1, 2, 0, 3, 4).reshape(b, n // u, u * hl, d)


def lse_to_seq(lse: torch.Tensor, coll: Collectives, inverse: Optional[torch.Tensor]) -> torch.Tensor:
    """lse ``(b, h / U, U * s)`` of this rank's heads -> ``(b, h, s)`` of its tokens (no grad)."""
    b, hl, n = lse.shape
    u = coll.world
    with torch.no_grad():
        lse = _take(lse, 2, inverse).view(b, hl, u, n // u).permute(2, 0, 1, 3)
        return coll.all_to_all(lse).permute(1, 0, 2, 3).reshape(b, u * hl, n // u)


def exchange_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor], coll: Collectives,
    perm: Optional[torch.Tensor], pattern: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """q ``(b, s, hq, d)``, k/v ``(b, s, hk, d)``, sinks ``(hq,)`` -> the group's tokens in
    ``perm`` order for this rank's heads: q ``(b, U*s, hq/U, d)``, k/v ``(b, U*s, hk', d)``
    with ``hk' = max(hk, U) / U``, sinks ``(hq/U,)``; differentiable. K and V travel in one
    all-to-all (side by side along head_dim, so each K/V head stays whole)."""
    repeat = kv_repeat(q.shape[2], k.shape[2], coll.world, pattern)
    if repeat > 1:
        k, v = (t.repeat_interleave(repeat, dim=2) for t in (k, v))
    d = k.shape[-1]
    kv = seq_to_heads(torch.cat([k, v], dim=-1), coll, perm)  # (b, U*s, hk', 2d)
    heads = q.shape[2] // coll.world
    local_sinks = None if sinks is None else sinks[coll.rank * heads:(coll.rank + 1) * heads]
    return seq_to_heads(q, coll, perm), kv[..., :d], kv[..., d:], local_sinks


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, coll: Collectives,
    layout: str, first_rank: int, world: int, sinks: Optional[torch.Tensor] = None, pattern: str = "ulysses",
    need_lse: bool = True, local_doc_lens: Optional[tuple[int, ...]] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Ulysses over the group ``coll`` (ranks ``first_rank .. first_rank + U - 1`` of a
    context-parallel group of ``world`` ranks sharded by ``layout``), attention by ``plan``.

    Args:
        q: ``(batch, local_seq, n_heads, head_dim)``; k, v ``(batch, local_seq, n_kv_heads,
            head_dim)``; one float dtype and device.
        plan: the attention over the group's tokens: one process over the whole sequence
            (``world=1``, contiguous: pure Ulysses), or the ring across Ulysses groups
            (hybrid), whose layout fixes the order the group's tokens are taken in; a plan
            with explicit ``positions`` takes them as received (rank after rank).
        sinks: optional float ``(n_heads,)``, differentiable.
        need_lse: send the lse back too (one more, small, all-to-all); else lse is None.
        local_doc_lens: a packed row (batch 1, each document zigzag-sharded on its own over
            the ``world`` ranks): each document's local length. The group's tokens are put
            in ``plan``'s packed order: the row's (pure Ulysses), or the ring's across the
            groups (hybrid), where ``plan`` runs each document alone.

    Returns:
        ``out`` like q (differentiable in q, k, v, sinks) and ``lse`` ``(batch, n_heads,
        local_seq)`` float32 (float64 for float64 inputs), or None.
    """
    seq = q.shape[1] * world
    ranks = tuple(range(first_rank, first_rank + coll.world))
    perm = inverse = None
    if plan.positions is None:
        doc_lens = None if local_doc_lens is None else tuple(n * world for n in local_doc_lens)
        perm, inverse = orders(seq, world, ranks, layout, (plan.world, plan.rank, plan.layout), q.device, doc_lens)
    qh, kh, vh, local_sinks = exchange_inputs(q, k, v, sinks, coll, perm, pattern)
    out, lse = ring_attention(qh, kh, vh, plan, local_sinks)  # (b, U*s, hq/U, d), (b, hq/U, U*s)
    return heads_to_seq(out, coll, inverse), lse_to_seq(lse, coll, inverse) if need_lse else None


__all__ = ["exchange_inputs", "heads_to_seq", "kv_repeat", "lse_to_seq", "orders", "seq_to_heads",
           "ulysses_attention"]
