"""Public ring attention functions: ``ring_flash_attn_func`` (dense rows) and
``ring_flash_attn_varlen_func`` (packed rows of several documents), and ``ring_attention``,
the op on an already built :class:`~hf_ring.patterns.plan.RingPlan` (no checks across ranks).

Called directly, each public function first checks that every rank of the group passes
the same shapes, dtype and settings (one small all-gather; see validation.py). Callers
that established this already, once for many calls (the Hugging Face integration does
it once per model forward), pass ``check_ranks=False`` or build a plan and call
:func:`ring_attention`, so that the hot path has no collective besides the ring's own
transfers and no host sync.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from hf_ring.kernels import get_backend
from hf_ring.distributed.comm import CommWaitStats
from hf_ring.patterns.plan import RingPlan
from hf_ring.patterns.ring.attention import KVAttentionFunction, ring_passes
from hf_ring.patterns.validation import check_across_ranks, check_local
from hf_ring.sharding.packed import check_cu_seqlens

Output = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def group_coords(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """``(rank, world)`` of this process in ``group``; ``(0, 1)`` without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was passed but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, sinks: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring op on a plan, with local checks only (no communication before the ring).

    Args:
        q: ``(batch, local_seq, n_heads, head_dim)``; k, v: ``(batch, local_seq,
            n_kv_heads, head_dim)``; one float dtype, one device.
        plan: who and what (see :class:`RingPlan`), its backend resolved for q's device
            and dtype; every rank of the ring must pass tensors of the same shapes and
            plans with the same settings.
        sinks: optional ``(n_heads,)`` float tensor, one extra logit per query head in
            every row's softmax denominator (GPT-OSS); differentiable.

    Returns:
        ``out`` like q (differentiable in q, k, v) and ``lse`` ``(batch, n_heads,
        local_seq)`` float32 (float64 for float64 inputs).
    """
    check_local(q, k, v, plan.layout, plan.causal)
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != q.shape[2] or not sinks.dtype.is_floating_point):
        raise ValueError(
            f"sinks must be a float tensor of shape (n_heads,) = ({q.shape[2]},), got "
            f"{tuple(sinks.shape)} {sinks.dtype}"
        )
    return KVAttentionFunction.apply(q, k, v, sinks, ring_passes(plan))


def _window_code(window: Optional[int]) -> int:
    """The window as an agreement field: 0 for None (a window is >= 1), -1 for a value that
    is no int (every rank then fails the plan's own check alike)."""
    if window is None:
        return 0
    return window if isinstance(window, int) and not isinstance(window, bool) else -1


def _scale(q: torch.Tensor, softmax_scale: Optional[float]) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _plan(q, group, rank, world, causal, scale, layout, backend, comm_stats, local_doc_lens=None,
          window=None) -> RingPlan:
    return RingPlan(group, rank, world, layout, causal, scale, get_backend(backend, q.device, q.dtype),
                    local_doc_lens, window=window, comm_stats=comm_stats)


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
) -> Output:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Every rank passes its own shard, taken from the full sequence with
    ``shard_sequence(x, cp_size, cp_rank, dim=1, layout=layout)``.

    Args:
        q: ``(batch, local_seq, n_heads, head_dim)``, float16 / bfloat16 / float32 / float64.
        k, v: ``(batch, local_seq, n_kv_heads, head_dim)``, same dtype and device as q;
            ``n_heads % n_kv_heads == 0``. K/V travel with ``n_kv_heads`` heads.
        group: the context-parallel group (None: the default group; a single process when
            torch.distributed is not initialised).
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
            on its edge masked; needs a backend with a masked kernel (``torch_cpu_flash``,
            ``reference``), else NotImplementedError. None: no window.

    Returns:
        ``out`` shaped and typed like q; with ``return_lse``, also ``lse``
        ``(batch, n_heads, local_seq)`` float32 (float64 for float64 inputs), not
        differentiable. ``out`` is differentiable in q, k, v.
    """
    rank, world = group_coords(group)
    scale = _scale(q, softmax_scale)
    if world > 1 and check_ranks:
        check_across_ranks(group, q, k, v, layout, causal, scale,
                           [("sinks", int(sinks is not None)), ("window", _window_code(window))])
    check_local(q, k, v, layout, causal)  # before the backend is chosen: shape mistakes named as such
    plan = _plan(q, group, rank, world, causal, scale, layout, backend, comm_stats, window=window)
    out, lse = ring_attention(q, k, v, plan, sinks)
    return (out, lse) if return_lse else out


_HASH_PRIME = (1 << 61) - 1  # a Mersenne prime: a polynomial hash over it rarely collides


def documents_fields(bounds: Sequence[int]) -> list[tuple[str, int]]:
    """What ranks must agree on about a packed row's boundaries, as fixed-length fields:
    their count, the last one, and a polynomial hash of all of them (order-sensitive; a
    weighted sum would collide on simple reorderings of document lengths)."""
    digest = 0
    for b in bounds:
        digest = (digest * 1_000_003 + int(b) + 1) % _HASH_PRIME
    return [("cu_seqlens.numel", len(bounds)), ("cu_seqlens[-1]", bounds[-1] if bounds else -1),
            ("cu_seqlens.hash", digest)]


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

    Returns:
        ``out`` ``(total_local, n_heads, head_dim)``; with ``return_lse`` also ``lse``
        ``(n_heads, total_local)``.
    """
    rank, world = group_coords(group)
    scale = _scale(q, softmax_scale)
    bounds = torch.as_tensor(cu_seqlens, device="cpu").reshape(-1).tolist()
    if world > 1 and check_ranks:
        # Agreement first: a rank whose boundaries are invalid must not raise alone.
        check_across_ranks(group, q, k, v, "zigzag", causal, scale,
                           [*documents_fields(bounds), ("sinks", int(sinks is not None))])
    doc_lens = check_cu_seqlens(torch.as_tensor(cu_seqlens), world)
    if q.dim() != 3:
        raise ValueError(f"varlen q must be (total_local, n_heads, head_dim), got shape {tuple(q.shape)}")
    local_doc_lens = tuple(n // world for n in doc_lens)
    if sum(local_doc_lens) != q.shape[0]:
        raise ValueError(
            f"cu_seqlens covers {sum(doc_lens)} tokens, i.e. {sum(local_doc_lens)} per rank over "
            f"{world} ranks, but q holds {q.shape[0]} local tokens"
        )
    plan = _plan(q, group, rank, world, causal, scale, "zigzag", backend, comm_stats, local_doc_lens)
    out, lse = ring_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), plan, sinks)
    out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out


__all__ = ["documents_fields", "group_coords", "ring_attention", "ring_flash_attn_func", "ring_flash_attn_varlen_func"]
