"""The public context-parallel attention ops: ``context_parallel_attn_func`` (every
pattern), ``ring_flash_attn_func`` (its ring pattern, dense rows) and
``ring_flash_attn_varlen_func`` (the ring over packed rows of several documents).

The patterns split the same exact attention differently across the ranks of a group:

- ``"ring"``: K/V blocks travel around the ring while each rank computes (ring/).
- ``"allgather"``: K/V are all-gathered once, in their own head count, and each rank
  attends its queries at their global positions; the backward reduce-scatters dK/dV
  (allgather.py; Llama 3's context parallelism).
- ``"ulysses"``: an all-to-all turns sequence shards into head shards, each rank attends
  the full sequence for its heads, and a second all-to-all turns the result back
  (ulysses.py; DeepSpeed Ulysses).
- ``"hybrid"``: Ulysses inside groups of ``ulysses_size`` consecutive ranks, the ring
  across the groups (hybrid.py; USP).

Each op checks first that every rank of the group passes the same shapes, dtype and
settings (one small all-gather and a host sync; validation.py), then its arguments
locally, builds the call's plan (build.py) and runs it (run.py), the same entry point
the Hugging Face integration runs its plans through. Callers that established the
agreement already pass ``check_ranks=False``.

Must not import transformers, accelerate, or hf_ring's integration or training layers.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from hf_ring.distributed.active import active_state, resolve_cp_group
from hf_ring.distributed.comm import CommWaitStats
from hf_ring.distributed.groups import group_coords, local_world_size
from hf_ring.patterns.build import build_plan, check_settings
from hf_ring.patterns.plan import PATTERNS
from hf_ring.patterns.ring.spans import BidirectionalSpans, as_spans, spans_fields
from hf_ring.patterns.run import run_plan
from hf_ring.patterns.validation import check_across_ranks, check_local, float_bits, int_hash, name_code
from hf_ring.sharding.packed import check_cu_seqlens

Output = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
# Per batch row, its bidirectional spans as (start, end) global positions, or validated ones.
SpansArg = Union[None, BidirectionalSpans, Sequence[Sequence[tuple[int, int]]]]


def _placement(group: Optional[dist.ProcessGroup], world: int) -> tuple[int, int, int]:
    """``(local_world_size, first_rank, rank_stride)`` of ``group`` for ``pattern="auto"``:
    processes per node as the launcher says, the group's first global rank, and how far
    apart its ranks are (1 where they are not evenly spaced: auto then reads them as
    consecutive)."""
    if world == 1:
        return 1, 0, 1
    ranks = [dist.get_global_rank(group, r) for r in range(world)] if group is not None else list(range(world))
    stride = ranks[1] - ranks[0]
    even = stride > 0 and all(b - a == stride for a, b in zip(ranks, ranks[1:]))
    return local_world_size(dist.get_world_size()), ranks[0], stride if even else 1


def _held_hybrid(group: Optional[dist.ProcessGroup], pattern: str, ulysses_size: Optional[int]):
    """The active state's hybrid subgroups where this call runs over its CP group and they
    cover the call (the state built them up front); None: the call builds its own
    (hf_ring.patterns.hybrid.hybrid_groups)."""
    state = active_state()
    if state is None or group is not state.cp_group or state.world_group is not dist.group.WORLD:
        return None
    held = getattr(state, "hybrid", None) or None
    if held is None or (pattern == "hybrid" and ulysses_size not in held) or (
            pattern == "auto" and state.pattern != "auto"):
        return None
    return held


def _check_sinks(sinks: Optional[torch.Tensor], n_heads: int) -> None:
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.dim() != 1
                              or sinks.shape[0] != n_heads or not sinks.dtype.is_floating_point):
        got = f"{tuple(sinks.shape)} {sinks.dtype}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a float tensor of shape (n_heads,) = ({n_heads},), got {got}")


def agreement_fields(pattern: str, window, softcap, sinks, ulysses_size, backend: str) -> list[tuple[str, int]]:
    """What the ranks must agree on besides shapes, layout, mask and scale (as ints); the
    kernel too: ranks on kernels that differ in what they compute would refuse apart, one
    raising while the others wait in the first transfer."""
    names = (*PATTERNS, "auto")
    return [("pattern", names.index(pattern) if pattern in names else -1),
            ("window", window if isinstance(window, int) and not isinstance(window, bool) else -1
             if window is not None else 0),
            ("softcap_scale", float_bits(softcap) if isinstance(softcap, (int, float)) else 0),
            ("sinks", int(sinks is not None)),
            ("ulysses_size", ulysses_size if isinstance(ulysses_size, int) else 0),
            ("kernel", name_code(backend))]


def documents_fields(bounds: Sequence[int]) -> list[tuple[str, int]]:
    """What ranks must agree on about a packed row's boundaries, as fixed-length fields:
    their count, the last one, and a polynomial hash of all of them (order-sensitive; a
    weighted sum would collide on simple reorderings of document lengths)."""
    return [("cu_seqlens.numel", len(bounds)), ("cu_seqlens[-1]", bounds[-1] if bounds else -1),
            ("cu_seqlens.hash", int_hash(bounds))]


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
    spans: SpansArg = None,
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
        group: the context-parallel group. None: the active state's CP group
            (``setup_context_parallel``); with no active state, the default group (one
            process when torch.distributed is not initialised).
        pattern: ``"ring"``, ``"allgather"``, ``"ulysses"``, ``"hybrid"`` (module docstring)
            or ``"auto"`` (picked from the heads, the length, the group and its placement:
            hf_ring/patterns/auto.py; logged once per kind of call).
        causal: causal mask over global positions.
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        layout: ``"zigzag"``, ``"stripe"`` or ``"contiguous"``; must match the sharding.
        window: sliding window in tokens, as transformers' ``sliding_window``: key j is
            visible to query i iff ``0 <= i - j < window`` (global positions); causal only.
        softcap: logit softcapping (Gemma 2): scores become ``softcap * tanh(scores / softcap)``;
            needs a backend whose kernels take it (``"auto"`` picks one).
        sinks: optional float ``(n_heads,)``: one extra logit per query head in every row's
            softmax denominator (GPT-OSS), the same on every rank. Differentiable: each rank
            gets the part of the gradient from its own rows and heads; summed over the
            group it is the full gradient.
        ulysses_size: ``pattern="hybrid"`` only: ranks per Ulysses group (consecutive
            ranks of ``group``); must divide the group size.
        backend: block kernel, ``"auto"`` (the first in the registry's order that runs here
            and computes the call's window and softcap) or a name from
            ``hf_ring.kernels.available_backends``.
        return_lse: also return the log-sum-exp.
        check_ranks: first check that every rank passes the same shapes, dtype and settings
            (one small all-gather and a host sync); pass False only when the caller has.
        comm_stats: a sink for the time the transfers were waited on.
        spans: bidirectional spans on top of causal (Gemma 3's images, PaliGemma's prefix):
            per batch row, ``(start, end)`` ranges of global positions (sorted, disjoint);
            a query in a span also sees the span's later keys (with a window too, which only
            cuts earlier keys). The same on every rank; causal only; needs a masked kernel
            (``"auto"`` picks one). None: none.

    Returns:
        ``out`` shaped and typed like q, in the same layout, differentiable in q, k, v and
        sinks; with ``return_lse`` also ``lse`` ``(batch, n_heads, local_seq)`` float32
        (float64 for float64 inputs), not differentiable.

    Raises:
        ValueError: bad arguments, or ranks that disagree; NotImplementedError: a
            combination this pattern or backend does not compute, naming one that does.
    """
    group = resolve_cp_group(group, "hf_ring.context_parallel_attn_func")
    rank, world = group_coords(group)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if world > 1 and check_ranks:
        # Agreement first: a setting that is wrong on one rank only must fail on all of them.
        check_across_ranks(group, q, k, v, layout, causal, scale,
                           agreement_fields(pattern, window, softcap, sinks, ulysses_size, backend)
                           + spans_fields(spans))
    check_settings(pattern, causal, window, softcap, ulysses_size, world)
    check_local(q, k, v, layout, causal)
    _check_sinks(sinks, q.shape[2])
    spans = as_spans(spans, q.shape[1] * world)
    lws, first, stride = _placement(group, world)
    plan = build_plan(pattern=pattern, group=group, rank=rank, world=world, layout=layout, causal=causal,
                      scale=scale, backend=backend, device=q.device, dtype=q.dtype, n_heads=q.shape[2],
                      n_kv_heads=k.shape[2], head_dim=q.shape[3], value_head_dim=v.shape[3],
                      seq=q.shape[1] * world, window=window, softcap=softcap, ulysses_size=ulysses_size,
                      comm_stats=comm_stats, need_lse=return_lse, local_world_size=lws, first_rank=first,
                      rank_stride=stride, spans=spans, held_hybrid=_held_hybrid(group, pattern, ulysses_size))
    out, lse = run_plan(q, k, v, plan, sinks)
    return (out, lse) if return_lse else out


def ring_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    layout: str = "zigzag",
    backend: str = "auto",
    return_lse: bool = False,
    check_ranks: bool = True,
    comm_stats: Optional[CommWaitStats] = None,
    sinks: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> Output:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Every rank passes its own shard, taken from the full sequence with
    ``shard_sequence(x, cp_size, cp_rank, dim=1, layout=layout)``.

    Args:
        q: ``(batch, local_seq, n_heads, head_dim)``, float16 / bfloat16 / float32 / float64.
        k, v: ``(batch, local_seq, n_kv_heads, head_dim)``, same dtype and device as q;
            ``n_heads % n_kv_heads == 0``. K/V travel with ``n_kv_heads`` heads.
        group: the context-parallel group. None: the active state's CP group
            (``setup_context_parallel``); with no active state, the default group (a single
            process when torch.distributed is not initialised).
        causal: causal mask over *global* positions (the layout says which tokens a rank holds).
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        layout: ``"zigzag"``, ``"stripe"`` or ``"contiguous"``; must match the sharding.
        backend: block kernel, ``"auto"`` or a name from ``hf_ring.kernels.available_backends``.
        return_lse: also return the log-sum-exp.
        check_ranks: check first that every rank passes the same shapes, dtype, layout,
            causal flag and scale (one small all-gather and a host sync). Pass False only
            when the caller has established that already: a disagreement then hangs or
            corrupts instead of raising.
        comm_stats: a sink for the time the ring waited on transfers.
        sinks: optional ``(n_heads,)`` float tensor: one extra logit per query head in every
            row's softmax denominator (attention sinks, GPT-OSS's ``s_aux``), with its
            gradient; the same on every rank.
        window: sliding window in tokens, as transformers' ``sliding_window``: key j is
            visible to query i iff ``0 <= i - j < window`` (global positions), on top of
            causal (``causal=True`` only). Key blocks wholly outside it are skipped, blocks
            on its edge masked; needs a backend with a masked kernel (``"auto"`` picks
            one; a named backend without one is refused). None: no window.
        softcap: logit softcapping, as in ``context_parallel_attn_func``.

    Returns:
        ``out`` shaped and typed like q; with ``return_lse``, also ``lse``
        ``(batch, n_heads, local_seq)`` float32 (float64 for float64 inputs), not
        differentiable. ``out`` is differentiable in q, k, v.
    """
    group = resolve_cp_group(group, "hf_ring.ring_flash_attn_func")
    return context_parallel_attn_func(
        q, k, v, group=group, pattern="ring", causal=causal, softmax_scale=softmax_scale, layout=layout,
        window=window, softcap=softcap, sinks=sinks, backend=backend, return_lse=return_lse,
        check_ranks=check_ranks, comm_stats=comm_stats,
    )


def ring_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: Union[torch.Tensor, Sequence[int]],
    *,
    group: Optional[dist.ProcessGroup] = None,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
    return_lse: bool = False,
    check_ranks: bool = True,
    comm_stats: Optional[CommWaitStats] = None,
    sinks: Optional[torch.Tensor] = None,
    spans: SpansArg = None,
    window: Optional[int] = None,
    pattern: str = "ring",
    ulysses_size: Optional[int] = None,
) -> Output:
    """Ring attention over a packed row: documents never attend to each other.

    The row's documents are zigzag-sharded one by one (``hf_ring.sharding.shard_packed``),
    so each rank holds an equal share of every document's work.

    Args:
        q: ``(total_local, n_heads, head_dim)``: this rank's tokens of the packed row(s).
        k, v: ``(total_local, n_kv_heads, head_dim)``.
        cu_seqlens: int ``(n_docs + 1,)`` (a tensor, or a list of ints, which avoids a host
            sync), the *global* document boundaries over the full packed sequence,
            starting at 0; every document length a multiple of ``2 * cp_size``; identical
            on every rank of the group.
        group, causal, softmax_scale, backend, return_lse, check_ranks, comm_stats, sinks:
            as in ``ring_flash_attn_func``; ``check_ranks`` also covers the documents.
        spans: bidirectional spans of the packed row (one row: ``[[(start, end), ...]]``,
            global positions of the packed sequence), each inside one document; as in
            ``context_parallel_attn_func``.
        window: sliding window in tokens inside each document (key j visible to query i
            iff ``0 <= i - j < window``, both of one document), on top of causal; needs a
            backend with a masked kernel (``"auto"`` picks one). None: no window.
        pattern: ``"ring"`` (K/V passed around the group), ``"allgather"`` (K/V gathered
            once, Llama 3's: each chunk of each document against its prefix), ``"ulysses"``
            (the row exchanged for heads, each document alone over its whole length),
            ``"hybrid"`` (Ulysses inside groups of ``ulysses_size`` ranks, the ring's packed
            schedule across them) or ``"auto"`` (the ring or the all-gather, by the cost
            model of the row's documents; ``hf_ring.patterns.auto``).
        ulysses_size: for ``pattern="hybrid"`` only, as in ``context_parallel_attn_func``.

    Returns:
        ``out`` ``(total_local, n_heads, head_dim)``; with ``return_lse`` also ``lse``
        ``(n_heads, total_local)``.
    """
    group = resolve_cp_group(group, "hf_ring.ring_flash_attn_varlen_func")
    rank, world = group_coords(group)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    bounds = torch.as_tensor(cu_seqlens, device="cpu").reshape(-1).tolist()
    if world > 1 and check_ranks:
        # Agreement first: a rank whose boundaries are invalid must not raise alone.
        check_across_ranks(group, q, k, v, "zigzag", causal, scale,
                           [*documents_fields(bounds),
                            *agreement_fields(pattern, window, None, sinks, ulysses_size, backend),
                            *spans_fields(spans)])
    check_settings(pattern, causal, window, None, ulysses_size, world)
    doc_lens = check_cu_seqlens(torch.as_tensor(cu_seqlens), world)
    if q.dim() != 3:
        raise ValueError(f"varlen q must be (total_local, n_heads, head_dim), got shape {tuple(q.shape)}")
    local_doc_lens = tuple(n // world for n in doc_lens)
    if sum(local_doc_lens) != q.shape[0]:
        raise ValueError(
            f"cu_seqlens covers {sum(doc_lens)} tokens, i.e. {sum(local_doc_lens)} per rank over "
            f"{world} ranks, but q holds {q.shape[0]} local tokens"
        )
    q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    check_local(q, k, v, "zigzag", causal)
    _check_sinks(sinks, q.shape[2])
    plan = build_plan(pattern=pattern, group=group, rank=rank, world=world, layout="zigzag", causal=causal,
                      scale=scale, backend=backend, device=q.device, dtype=q.dtype, n_heads=q.shape[2],
                      n_kv_heads=k.shape[2], head_dim=q.shape[3], value_head_dim=v.shape[3], seq=sum(doc_lens),
                      window=window, local_doc_lens=local_doc_lens, ulysses_size=ulysses_size, comm_stats=comm_stats,
                      spans=as_spans(spans, sum(doc_lens)), held_hybrid=_held_hybrid(group, pattern, ulysses_size))
    out, lse = run_plan(q, k, v, plan, sinks)
    out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out


__all__ = ["agreement_fields", "context_parallel_attn_func", "documents_fields",
           "ring_flash_attn_func", "ring_flash_attn_varlen_func"]
