"""The hybrid pattern (USP): Ulysses inside groups of consecutive ranks, the ring across them.

A context-parallel group of ``N = U * R`` ranks is cut into ``R`` Ulysses groups of ``U``
consecutive ranks (rank ``g * U + u`` is member ``u`` of group ``g``; consecutive ranks
usually share a node, where the all-to-all is cheap). The members ``u`` of every group
form a ring of ``R`` ranks, across the groups (the slower links carry only P2P blocks,
overlapped with compute).

After the Ulysses all-to-all (ulysses.py), member ``u`` of group ``g`` holds the group's
tokens for ``1/U`` of the heads. With the zigzag or contiguous layout those tokens are
exactly what rank ``g`` of an ``R``-rank ring holds in the same layout (for zigzag: the
group's first chunks form chunk ``g`` of ``2R``, its second chunks chunk ``2R - 1 - g``),
so the ring runs on them unchanged, with its block schedule, windows, softcap and sinks,
and the all-to-all turns the result back. Under the stripe layout a group's tokens (those
whose position mod N falls in the group's ranks) are no layout's shard of ``R`` ranks:
the ring then runs on their explicit positions (``AttentionPlan.positions``), each step one
block masked by position, which needs a backend with a masked kernel.

The subgroups are built up front: ``setup_context_parallel`` builds those its pattern can use
(:func:`build_hybrid_groups`) and the state holds them, so a model's forward never builds a
group (the Hugging Face integration hands the state's to every plan, and refuses a size the
state does not hold). A direct call of the public op over a group no state holds them for
builds them at that call, once per (group, ``ulysses_size``), reused while the default group
they were built over is the current one. Every rank of the default group builds every
subgroup of every context-parallel group, in one order (``new_group``'s own contract), not
only the ranks that belong to them: a group built by its members alone
(``use_local_synchronization``) is named from how many groups each member has seen, so a
rank that had joined one more group before (any ``new_group`` it was not a member of
counts on some ranks only) waits forever under another name than its peers'.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hf_ring.distributed.comm import CommWaitStats
from hf_ring.kernels import AttentionBackend
from hf_ring.patterns.plan import AttentionPlan
from hf_ring.patterns.ring.spans import BidirectionalSpans
from hf_ring.patterns.ulysses import ulysses_attention
from hf_ring.sharding.layouts import shard_indices

# Layouts under which a Ulysses group's tokens are a ring shard of the same layout.
RING_SHARD_LAYOUTS = ("zigzag", "contiguous")


@functools.lru_cache(maxsize=64)
def group_positions(seq: int, world: int, ulysses_size: int, layout: str) -> tuple[torch.Tensor, ...]:
    """Each Ulysses group's global token positions, its ranks' shards one after another:
    int64 ``(ulysses_size * seq / world,)`` CPU tensors, one per group."""
    u = ulysses_size
    return tuple(torch.cat([shard_indices(seq, world, g * u + i, layout) for i in range(u)])
                 for g in range(world // u))


@dataclass(frozen=True)
class HybridGroups:
    """This rank's two subgroups of a hybrid split.

    Attributes:
        ulysses: the ``U`` consecutive ranks of its Ulysses group; ring: the ``R`` ranks with
            the same index in their Ulysses groups.
        ulysses_size, ring_size: U and R.
        group_index: which Ulysses group this rank is in (its rank in ``ring``).
        member: its index inside its Ulysses group (its rank in ``ulysses``).
    """

    ulysses: dist.ProcessGroup
    ring: dist.ProcessGroup
    ulysses_size: int
    ring_size: int
    group_index: int
    member: int


@dataclass
class _BuiltGroups:
    """This rank's subgroups over one default group, by (the CP group's global ranks, U), for
    direct calls of the public op over a group that no state holds them for (a state's own
    are built up front and held by it). Built at the first such call and reused; not per batch.

    The default group is compared by identity through a weak reference, not by ``id()``: a
    new default group can get the id of a destroyed one, and its ranks then got the
    destroyed subgroups. A weak reference neither keeps the old group alive nor matches a
    new one.
    """

    world: Optional[weakref.ref] = None
    groups: dict = field(default_factory=dict)

    def over_current_world(self) -> dict:
        world = dist.group.WORLD
        if self.world is None or self.world() is not world:
            # destroy_process_group() took the subgroups of the old default group with it.
            self.world, self.groups = weakref.ref(world), {}
        return self.groups


_BUILT = _BuiltGroups()


def _split(members: tuple[int, ...], u: int) -> tuple[list[list[int]], list[list[int]]]:
    """The Ulysses groups (``u`` consecutive members) and rings (members of one index) of the
    CP group of global ranks ``members``."""
    ulysses = [list(members[g * u:(g + 1) * u]) for g in range(len(members) // u)]
    rings = [list(members[m::u]) for m in range(u)]
    return ulysses, rings


def _members(group: Optional[dist.ProcessGroup]) -> tuple[int, ...]:
    """The global ranks of ``group`` (None: the default group), in group order."""
    world = dist.get_world_size(group)
    return tuple(dist.get_global_rank(group, r) if group is not None else r for r in range(world))


def build_hybrid_groups(group: Optional[dist.ProcessGroup], sizes: Sequence[int]) -> dict[int, HybridGroups]:
    """This rank's subgroups of ``group`` (None: the default group) for each Ulysses group size
    in ``sizes``, by size. Collective over the whole default group: every rank calls it at once
    with its own CP group and the same sizes; where the CP groups are smaller than the world the
    ranks first gather each other's, so that all build every subgroup in one order."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    members = _members(group)
    keys = [(members, u) for u in sorted(set(sizes))]
    if world == dist.get_world_size():
        every = keys
    else:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, keys)
        every = sorted({key for part in gathered for key in part})
    mine: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for other_members, u in every:
        for ranks in (sub for subs in _split(other_members, u) for sub in subs):
            made = dist.new_group(ranks)
            if other_members == members and u in sizes:
                mine[tuple(ranks)] = made
    built = {}
    for _, u in keys:
        g, member = divmod(rank, u)
        ulysses, rings = _split(members, u)
        built[u] = HybridGroups(mine[tuple(ulysses[g])], mine[tuple(rings[member])], u, world // u, g, member)
    return built


def hybrid_groups(group: Optional[dist.ProcessGroup], ulysses_size: int) -> HybridGroups:
    """The subgroups of ``group`` for Ulysses groups of ``ulysses_size`` consecutive ranks, for a
    direct call of the public op (module docstring): built at the first call over this default
    group, collective over it (every rank must be here at once, with its own CP group), cached."""
    built = _BUILT.over_current_world()
    key = (_members(group), ulysses_size)
    if key not in built:
        built[key] = build_hybrid_groups(group, [ulysses_size])[ulysses_size]
    return built[key]


def hybrid_ring_plan(
    groups: HybridGroups, seq: int, layout: str, causal: bool, scale: float, backend: AttentionBackend,
    window: Optional[int] = None, softcap: Optional[float] = None, comm_stats: Optional[CommWaitStats] = None,
    chunk: Optional[int] = None, spans: Optional[BidirectionalSpans] = None,
    local_doc_lens: Optional[tuple[int, ...]] = None,
) -> AttentionPlan:
    """The plan of the ring across the Ulysses groups for a ``seq``-token sequence sharded
    by ``layout`` over ``U * R`` ranks: the layout's own ring shards under zigzag and
    contiguous, the groups' explicit positions under stripe (a masked kernel needed); the
    bidirectional ``spans`` over the whole sequence, if any. A packed row (each document's
    local length on a rank, ``local_doc_lens``): the ring's packed schedule over the groups,
    each document ``U`` times as long in a group as on a rank."""
    world = groups.ulysses_size * groups.ring_size
    positions = None if layout in RING_SHARD_LAYOUTS else group_positions(seq, world, groups.ulysses_size, layout)
    group_doc_lens = None if local_doc_lens is None else tuple(n * groups.ulysses_size for n in local_doc_lens)
    return AttentionPlan(groups.ring, groups.group_index, groups.ring_size, layout, causal, scale, backend,
                         window=window, comm_stats=comm_stats, softcap=softcap, positions=positions, chunk=chunk,
                         spans=spans, local_doc_lens=group_doc_lens)


def hybrid_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Hybrid attention of this rank's shard by a hybrid ``plan`` (no checks across ranks).

    Args:
        q: ``(batch, local_seq, n_heads, head_dim)``; k, v ``(batch, local_seq, n_kv_heads,
            head_dim)``; one float dtype and device, sharded by ``plan.layout`` over ``U * R`` ranks.
        plan: ``pattern="hybrid"``, with its subgroups (``plan.hybrid``), the Ulysses
            group's collectives (``plan.collectives``) and the ring across the groups
            (``plan.inner``, from :func:`hybrid_ring_plan`).
        sinks: optional float ``(n_heads,)``, differentiable.

    Returns:
        ``out`` like q (differentiable in q, k, v, sinks) and ``lse`` ``(batch, n_heads,
        local_seq)`` float32 (float64 for float64 inputs), or None without ``plan.need_lse``.
    """
    groups = plan.hybrid
    first = groups.group_index * groups.ulysses_size
    return ulysses_attention(q, k, v, plan.inner, plan.collectives, plan.layout, first, plan.world, sinks,
                             pattern="hybrid", need_lse=plan.need_lse, local_doc_lens=plan.local_doc_lens)


__all__ = ["RING_SHARD_LAYOUTS", "group_positions", "HybridGroups", "build_hybrid_groups", "hybrid_attention", "hybrid_groups",
           "hybrid_ring_plan"]
