"""``build_plan``: the one place a context-parallel attention call's plan is made.

Settings are checked, ``pattern="auto"`` is resolved (auto.py), the kernel is resolved by
the kernel policy for what this call needs (``hf_ring.kernels.get_backend``: a masked
kernel for a window shorter than the sequence, softcapping), the hybrid pattern's
subgroups are made, and the plan of the attention a Ulysses or hybrid call runs after its
all-to-all is built inside its plan. Every refusal (a feature a pattern or kernel does not
compute, head counts a pattern cannot split) is raised here, before any transfer and alike
on every rank, which is what lets ``auto`` skip a pattern safely.

Callers: the public ops (api.py) once per call, after their checks across ranks; the
Hugging Face integration once per forward and kind of attention layer. Both then run the
plan with :func:`hf_ring.patterns.run.run_plan`. Nothing here communicates: the hybrid
pattern's subgroups come from the caller's state (built up front by
``setup_context_parallel``); only a direct call of the public op over a group no state
holds them for builds them (``hybrid_groups``, collective over the default group, once).

Must not import transformers, accelerate, or hf_ring's integration or training layers.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from hf_ring.distributed.collectives import Collectives, GroupCollectives
from hf_ring.distributed.comm import CommWaitStats, Transport
from hf_ring.kernels import get_backend
from hf_ring.kernels.base import KernelNeeds
from hf_ring.kernels.value_heads import with_value_head_dim
from hf_ring.patterns.auto import first_that_runs, log_choice_once, packed_candidates, pattern_candidates
from hf_ring.patterns.hybrid import RING_SHARD_LAYOUTS, HybridGroups, hybrid_groups, hybrid_ring_plan
from hf_ring.patterns.plan import PATTERNS, AttentionPlan
from hf_ring.patterns.ring.spans import BidirectionalSpans
from hf_ring.patterns.ulysses import kv_repeat


def check_settings(pattern: str, causal: bool, window, softcap, ulysses_size, world: int) -> None:
    """A call's settings on their own (no tensors): raises ValueError saying what to pass."""
    if pattern not in (*PATTERNS, "auto"):
        raise ValueError(f"unknown context-parallel pattern {pattern!r}; choose one of {', '.join(PATTERNS)} "
                         "or 'auto'")
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
        raise ValueError(f"ulysses_size is for pattern='hybrid' only (got pattern={pattern!r}); 'auto' picks its own")


def build_plan(
    *,
    pattern: str,
    group: Optional[dist.ProcessGroup],
    rank: int,
    world: int,
    layout: str,
    causal: bool,
    scale: float,
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    seq: int,
    value_head_dim: Optional[int] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    local_doc_lens: Optional[tuple[int, ...]] = None,
    ulysses_size: Optional[int] = None,
    chunk: Optional[int] = None,
    comm_stats: Optional[CommWaitStats] = None,
    need_lse: bool = True,
    local_world_size: Optional[int] = None,
    first_rank: int = 0,
    rank_stride: int = 1,
    transport: Optional[Transport] = None,
    collectives: Optional[Collectives] = None,
    spans: Optional[BidirectionalSpans] = None,
    held_hybrid: Optional[Mapping[int, HybridGroups]] = None,
) -> AttentionPlan:
    """The plan of one kind of attention call (settings checked by :func:`check_settings`).

    Args:
        pattern: one of :data:`~hf_ring.patterns.plan.PATTERNS`, or ``"auto"`` (picked by
            auto.py's rule from the heads, ``seq``, the group and its placement; logged
            once per kind of call).
        group, rank, world: the CP group and this process's place in it.
        layout, causal, scale, window, softcap, ulysses_size, comm_stats, need_lse: as in
            ``hf_ring.context_parallel_attn_func``; a window of at least ``seq`` tokens masks
            nothing and is dropped.
        chunk: attention chunks in tokens (``AttentionPlan.chunk``), or None; dropped like
            a window when at least ``seq``.
        backend: the kernel choice, ``"auto"`` or a registered name.
        device, dtype: where and in what the call's tensors are (the kernel must run there).
        n_heads, n_kv_heads, head_dim: the call's query and K/V head counts and q/k head size.
        value_head_dim: the v heads' size when it differs (multi-head latent attention):
            every kernel then runs on zero-padded heads (``kernels.value_heads``), exactly.
        seq: the full sequence's length in tokens (packed: the row's).
        local_doc_lens: packed rows, each document's local length; every pattern.
        local_world_size, first_rank, rank_stride: ``auto`` only, processes per node
            (default: the group is inside one node), the CP group's first global rank and
            how far apart its global ranks are (the TP size).
        transport, collectives: how the ring's blocks, or the other patterns' collectives,
            travel (default: over ``group``; benchmarks pass virtual ones).
        spans: bidirectional spans on top of causal (``AttentionPlan.spans``), validated for
            ``seq`` tokens, or None; every pattern computes them (they need a masked kernel).
        held_hybrid: the hybrid subgroups of ``group`` that the caller's state holds, by
            Ulysses group size (a model's forward passes its state's: a size missing there
            is refused, never built inside a forward); None: built at this call if needed.

    Raises:
        NotImplementedError: a feature the pattern or its kernel does not compute, or head
            counts it cannot split, naming what does; ValueError: a kernel that cannot run here.
    """
    common = dict(group=group, rank=rank, world=world, layout=layout, causal=causal, scale=scale, backend=backend,
                  device=device, dtype=dtype, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                  value_head_dim=value_head_dim or head_dim, seq=seq,
                  window=window if window is not None and window < seq else None, softcap=softcap,
                  chunk=chunk if chunk is not None and chunk < seq else None,
                  local_doc_lens=local_doc_lens, comm_stats=comm_stats, need_lse=need_lse, transport=transport,
                  collectives=collectives, spans=spans, held_hybrid=held_hybrid)
    if world == 1:
        return _build("ring", None, **common)  # one process: the ring's single step, local attention
    if pattern != "auto":
        return _build(pattern, ulysses_size, **common)
    if local_doc_lens is not None:  # packed rows: by the cost model of the row's documents
        candidates = packed_candidates(local_doc_lens, world, n_heads, n_kv_heads, head_dim, device.type)
    else:
        candidates = pattern_candidates(n_heads, n_kv_heads, seq, world, local_world_size or world, first_rank,
                                        rank_stride)
    plan, choice = first_that_runs(candidates, lambda c: _build(c.pattern, c.ulysses_size, **common))
    features = [f for f, on in (("window", common["window"]), ("chunk", common["chunk"]), ("softcap", softcap),
                                ("spans", spans), ("packed", local_doc_lens)) if on is not None]
    log_choice_once(choice, (n_heads, n_kv_heads, *features),
                    f"{seq} tokens over cp={world}, {n_heads}/{n_kv_heads} heads"
                    + (f", {', '.join(features)}" if features else ""))
    return plan


def _build(pattern: str, ulysses_size: Optional[int], *, group, rank, world, layout, causal, scale, backend, device,
           dtype, n_heads, n_kv_heads, head_dim, value_head_dim, seq, window, softcap, local_doc_lens, comm_stats,
           need_lse, transport, collectives, chunk, spans, held_hybrid) -> AttentionPlan:
    if pattern == "hybrid" and ulysses_size == 1:  # Ulysses groups of one rank: the ring over all of them
        pattern, ulysses_size = "ring", None
    if pattern == "hybrid" and ulysses_size == world:  # one Ulysses group: no ring
        pattern, ulysses_size = "ulysses", None
    if pattern in ("ulysses", "hybrid"):
        kv_repeat(n_heads, n_kv_heads, world if pattern == "ulysses" else ulysses_size, pattern)
    position_ring = pattern == "hybrid" and layout not in RING_SHARD_LAYOUTS and causal
    masked = window is not None or chunk is not None or position_ring or spans is not None
    needs = KernelNeeds(masked=masked, softcap=softcap is not None, head_dim=max(head_dim, value_head_dim))
    kernel = with_value_head_dim(get_backend(backend, device, dtype, needs), head_dim, value_head_dim)
    settings = dict(window=window, chunk=chunk, softcap=softcap, comm_stats=comm_stats, spans=spans)
    if pattern == "ring":
        return AttentionPlan(group, rank, world, layout, causal, scale, kernel, local_doc_lens=local_doc_lens,
                             transport=transport, **settings)
    if pattern == "allgather":
        return AttentionPlan(group, rank, world, layout, causal, scale, kernel, pattern=pattern,
                             local_doc_lens=local_doc_lens,
                             collectives=collectives or GroupCollectives(group, comm_stats), **settings)
    if pattern == "ulysses":
        # Every rank attends the whole sequence (in its global order) for its heads: one process's plan.
        # Packed: the documents' whole lengths, in the row's order (the row is put back in it).
        inner = AttentionPlan(None, 0, 1, "zigzag" if local_doc_lens else "contiguous", causal, scale, kernel,
                              window=window, softcap=softcap, chunk=chunk, spans=spans,
                              local_doc_lens=local_doc_lens and tuple(n * world for n in local_doc_lens))
        return AttentionPlan(group, rank, world, layout, causal, scale, kernel, pattern=pattern, need_lse=need_lse,
                             collectives=collectives or GroupCollectives(group, comm_stats), inner=inner,
                             local_doc_lens=local_doc_lens, **settings)
    groups = _hybrid_groups(group, ulysses_size, held_hybrid)
    inner = hybrid_ring_plan(groups, seq, layout, causal, scale, kernel, window, softcap, comm_stats, chunk, spans,
                             local_doc_lens)
    return AttentionPlan(group, rank, world, layout, causal, scale, kernel, pattern=pattern,
                         ulysses_size=ulysses_size, need_lse=need_lse,
                         collectives=collectives or GroupCollectives(groups.ulysses, comm_stats), inner=inner,
                         hybrid=groups, local_doc_lens=local_doc_lens, **settings)


def _hybrid_groups(group: Optional[dist.ProcessGroup], ulysses_size: int,
                   held: Optional[Mapping[int, HybridGroups]]) -> HybridGroups:
    if held is None:
        return hybrid_groups(group, ulysses_size)
    if ulysses_size not in held:
        raise NotImplementedError(
            f"pattern='hybrid' with Ulysses groups of {ulysses_size} ranks: the context-parallel state holds no "
            f"subgroups of that size (it holds {sorted(held) or 'none'}), and none is built inside a forward; set "
            f"the state up with setup_context_parallel(cp_size, pattern='hybrid', ulysses_size={ulysses_size}) "
            "(or RingAttentionPlugin(pattern='hybrid', ulysses_size=...))"
        )
    return held[ulysses_size]


__all__ = ["build_plan", "check_settings"]
