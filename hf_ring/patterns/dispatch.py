"""``context_parallel_attn_func``: every context-parallel pattern behind one function.

The patterns split the same exact attention differently across the ranks of a group:

- ``"ring"``: K/V blocks travel around the ring while each rank computes (ring_attention.py).
- ``"allgather"``: K/V are all-gathered once, in their own head count, and each rank
  attends its queries at their global positions; the backward reduce-scatters dK/dV
  (allgather.py; Llama 3's context parallelism).
- ``"ulysses"``: an all-to-all turns sequence shards into head shards, each rank attends
  the full sequence for its heads, and a second all-to-all turns the result back
  (ulysses.py; DeepSpeed Ulysses).
- ``"hybrid"``: Ulysses inside groups of ``ulysses_size`` consecutive ranks, the ring
  across the groups (hybrid.py; USP).

This module validates the call once (locally, then, unless the caller says it did, across
the ranks) and hands a :class:`PatternCall` to the pattern's op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from hf_ring.kernels import AttentionBackend, get_backend
from hf_ring.patterns.allgather import allgather_attention
from hf_ring.patterns.api import group_coords, ring_attention
from hf_ring.distributed.collectives import GroupCollectives
from hf_ring.distributed.comm import CommWaitStats
from hf_ring.patterns.hybrid import hybrid_attention, hybrid_groups
from hf_ring.patterns.plan import RingPlan
from hf_ring.patterns.ulysses import kv_repeat, ulysses_attention
from hf_ring.patterns.validation import check_across_ranks, check_local, float_bits

PATTERNS = ("ring", "allgather", "ulysses", "hybrid")

Output = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class PatternCall:
    """One validated call's settings, the same on every rank of ``group``.

    Attributes:
        group: the context-parallel group (None: the default group, or one process).
        rank, world: this process's index in ``group`` and the group's size.
        layout: how the sequence is sharded (``hf_ring.sharding.LAYOUTS``).
        causal: causal mask over global positions.
        scale: softmax scale.
        backend: the block kernel, resolved for the inputs' device and dtype.
        window: sliding window in tokens (key j visible to query i iff ``0 <= i - j <
            window``), or None.
        softcap: scores become ``softcap * tanh(scores / softcap)``; None: no capping.
        ulysses_size: hybrid only: ranks per Ulysses group.
        comm_stats: optional sink for the time transfers were waited on.
        need_lse: whether the caller wants the lse (Ulysses then sends it back too).
    """

    group: Optional[dist.ProcessGroup]
    rank: int
    world: int
    layout: str
    causal: bool
    scale: float
    backend: AttentionBackend
    window: Optional[int] = None
    softcap: Optional[float] = None
    ulysses_size: Optional[int] = None
    comm_stats: Optional[CommWaitStats] = None
    need_lse: bool = True


def ring_plan(call: PatternCall) -> RingPlan:
    """The call as a :class:`RingPlan` over its whole group."""
    return RingPlan(call.group, call.rank, call.world, call.layout, call.causal, call.scale, call.backend,
                    window=call.window, comm_stats=call.comm_stats, softcap=call.softcap)


def _ring_op(q, k, v, sinks, call: PatternCall):
    return ring_attention(q, k, v, ring_plan(call), sinks)


def _allgather_op(q, k, v, sinks, call: PatternCall):
    return allgather_attention(q, k, v, ring_plan(call), GroupCollectives(call.group, call.comm_stats), sinks)


def _ulysses_op(q, k, v, sinks, call: PatternCall):
    # Every rank attends the whole sequence (in its global order) for its heads: one process's plan.
    local = RingPlan(None, 0, 1, "contiguous", call.causal, call.scale, call.backend, window=call.window,
                     softcap=call.softcap)
    coll = GroupCollectives(call.group, call.comm_stats)
    return ulysses_attention(q, k, v, local, coll, call.layout, 0, call.world, sinks, need_lse=call.need_lse)


def _hybrid_op(q, k, v, sinks, call: PatternCall):
    if call.ulysses_size == 1:  # Ulysses groups of one rank: the ring over all of them
        return _ring_op(q, k, v, sinks, call)
    if call.ulysses_size == call.world:  # one Ulysses group: no ring
        return _ulysses_op(q, k, v, sinks, call)
    groups = hybrid_groups(call.group, call.ulysses_size)
    return hybrid_attention(q, k, v, groups, call.layout, call.causal, call.scale, call.backend, call.window,
                            call.softcap, sinks, call.comm_stats, call.need_lse)


# pattern -> op(q, k, v, sinks, call) -> (out, lse)
_OPS: dict[str, Callable] = {"ring": _ring_op, "allgather": _allgather_op, "ulysses": _ulysses_op,
                             "hybrid": _hybrid_op}


def _check_settings(pattern: str, causal: bool, window, softcap, ulysses_size, world: int) -> None:
    """The call's settings on their own (no tensors): raises ValueError saying what to pass."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown context-parallel pattern {pattern!r}; choose one of {', '.join(PATTERNS)}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int (tokens) or None, got {window!r}")
        if not causal:
            raise ValueError("a sliding window is defined on top of causal attention; pass causal=True")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (
                math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap must be a positive finite float or None, got {softcap!r}")
    if pattern == "hybrid":
        if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) or ulysses_size < 1:
            raise ValueError(f"pattern='hybrid' needs ulysses_size, a positive int dividing the group size "
                             f"({world}), got {ulysses_size!r}")
        if world % ulysses_size:
            raise ValueError(f"ulysses_size={ulysses_size} does not divide the context-parallel group size "
                             f"{world}; the hybrid pattern runs Ulysses inside groups of ulysses_size "
                             "consecutive ranks and the ring across them")
    elif ulysses_size is not None:
        raise ValueError(f"ulysses_size is for pattern='hybrid' only (got pattern={pattern!r})")


def _check_sinks(sinks: Optional[torch.Tensor], n_heads: int) -> None:
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.dim() != 1
                              or sinks.shape[0] != n_heads or not sinks.dtype.is_floating_point):
        got = f"{tuple(sinks.shape)} {sinks.dtype}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a float tensor of shape (n_heads,) = ({n_heads},), got {got}")


def agreement_fields(pattern: str, window, softcap, sinks, ulysses_size) -> list[tuple[str, int]]:
    """What the ranks must agree on besides shapes, layout, mask and scale (as ints)."""
    return [("pattern", PATTERNS.index(pattern) if pattern in PATTERNS else -1),
            ("window", window if isinstance(window, int) and not isinstance(window, bool) else -1
             if window is not None else 0),
            ("softcap_scale", float_bits(softcap) if isinstance(softcap, (int, float)) else 0),
            ("sinks", int(sinks is not None)),
            ("ulysses_size", ulysses_size if isinstance(ulysses_size, int) else 0)]


def context_parallel_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    pattern: str = "ring",
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    layout: str = "zigzag",
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    ulysses_size: Optional[int] = None,
    backend: str = "auto",
    return_lse: bool = False,
    check_ranks: bool = True,
    comm_stats: Optional[CommWaitStats] = None,
) -> Output:
    """Exact attention over a sequence sharded across the ranks of ``group``, by ``pattern``.

    Every rank passes its own shard, taken from the full sequence with
    ``shard_sequence(x, cp_size, cp_rank, dim=1, layout=layout)``.

    Args:
        q: ``(batch, local_seq, n_heads, head_dim)``, float16 / bfloat16 / float32 / float64.
        k, v: ``(batch, local_seq, n_kv_heads, head_dim)``, q's dtype and device;
            ``n_heads % n_kv_heads == 0`` (GQA; K/V travel with their own head count,
            except that Ulysses repeats as few K/V heads as it needs when ``n_kv_heads``
            is smaller than the group).
        group: the context-parallel group (None: the default group; one process when
            torch.distributed is not initialised).
        pattern: ``"ring"``, ``"allgather"``, ``"ulysses"`` or ``"hybrid"`` (module docstring).
        causal: causal mask over global positions.
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        layout: ``"zigzag"``, ``"stripe"`` or ``"contiguous"``; must match the sharding.
        window: sliding window in tokens, as transformers' ``sliding_window``: key j is
            visible to query i iff ``0 <= i - j < window`` (global positions); causal only.
        softcap: logit softcapping (Gemma 2): scores become ``softcap * tanh(scores / softcap)``;
            needs a backend whose kernels take it (``"auto"`` picks one: ``reference`` on
            CPU, ``flash_attn`` on CUDA when installed).
        sinks: optional float ``(n_heads,)``: one extra logit per query head in every row's
            softmax denominator (GPT-OSS), the same on every rank. Differentiable: each rank
            gets the part of the gradient from its own rows and heads; summed over the
            group it is the full gradient.
        ulysses_size: ``pattern="hybrid"`` only: ranks per Ulysses group (consecutive
            ranks of ``group``); must divide the group size.
        backend: block kernel, ``"auto"`` or a name from ``hf_ring.kernels.available_backends``.
        return_lse: also return the log-sum-exp.
        check_ranks: first check that every rank passes the same shapes, dtype and settings
            (one small all-gather and a host sync); pass False only when the caller has.
        comm_stats: a sink for the time the transfers were waited on.

    Returns:
        ``out`` shaped and typed like q, in the same layout, differentiable in q, k, v and
        sinks; with ``return_lse`` also ``lse`` ``(batch, n_heads, local_seq)`` float32
        (float64 for float64 inputs), not differentiable.

    Raises:
        ValueError: bad arguments, or ranks that disagree; NotImplementedError: a
            combination this pattern or backend does not compute, naming one that does.
    """
    rank, world = group_coords(group)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if world > 1 and check_ranks:
        # Agreement first: a setting that is wrong on one rank only must fail on all of them.
        check_across_ranks(group, q, k, v, layout, causal, scale,
                           agreement_fields(pattern, window, softcap, sinks, ulysses_size))
    _check_settings(pattern, causal, window, softcap, ulysses_size, world)
    check_local(q, k, v, layout, causal)
    _check_sinks(sinks, q.shape[2])
    if pattern in ("ulysses", "hybrid"):
        kv_repeat(q.shape[2], k.shape[2], world if pattern == "ulysses" else ulysses_size, pattern)
    kernel = get_backend(backend, q.device, q.dtype, softcap=softcap is not None)
    call = PatternCall(group, rank, world, layout, causal, scale, kernel, window, softcap, ulysses_size, comm_stats,
                       return_lse)
    # One process: every pattern is the ring's single step (local attention), no collective.
    out, lse = _OPS["ring" if world == 1 else pattern](q, k, v, sinks, call)
    return (out, lse) if return_lse else out


__all__ = ["PATTERNS", "PatternCall", "agreement_fields", "context_parallel_attn_func"]
