"""Public ring attention functions: ``ring_flash_attn_func`` (dense rows) and
``ring_flash_attn_varlen_func`` (packed rows of several documents)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from hf_ring.kernels import get_backend
from hf_ring.ring.ring_attention import RingAttentionFunction, RingPlan
from hf_ring.ring.validation import check_across_ranks, check_local
from hf_ring.sharding.packed import check_cu_seqlens


def _group_coords(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was passed but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _run(q, k, v, group, rank, world, causal, softmax_scale, layout, backend, return_lse, local_doc_lens=None):
    check_local(q, k, v, layout, causal)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    kernel = get_backend(backend, q.device, q.dtype)
    plan = RingPlan(group, rank, world, layout, causal, scale, kernel, local_doc_lens)
    out, lse = RingAttentionFunction.apply(q, k, v, plan)
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
):
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

    Returns:
        ``out`` shaped and typed like q; with ``return_lse``, also ``lse``
        ``(batch, n_heads, local_seq)`` float32 (float64 for float64 inputs), not
        differentiable. ``out`` is differentiable in q, k, v.
    """
    rank, world = _group_coords(group)
    if world > 1:
        check_across_ranks(group, q, k, v, layout, causal)
    return _run(q, k, v, group, rank, world, causal, softmax_scale, layout, backend, return_lse)


def ring_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
    return_lse: bool = False,
):
    """Ring attention over a packed row: documents never attend to each other.

    The row's documents are zigzag-sharded one by one (``hf_ring.sharding.shard_packed``),
    so each rank holds an equal share of every document's work.

    Args:
        q: ``(total_local, n_heads, head_dim)``: this rank's tokens of the packed row(s).
        k, v: ``(total_local, n_kv_heads, head_dim)``.
        cu_seqlens: int ``(n_docs + 1,)``, the *global* document boundaries over the full
            packed sequence, starting at 0; every document length a multiple of
            ``2 * cp_size``; identical on every rank of the group.
        group, causal, softmax_scale, backend, return_lse: as in ``ring_flash_attn_func``.

    Returns:
        ``out`` ``(total_local, n_heads, head_dim)``; with ``return_lse`` also ``lse``
        ``(n_heads, total_local)``.
    """
    rank, world = _group_coords(group)
    if world > 1:
        # The document structure is part of what every rank must agree on.
        bounds = [int(b) for b in cu_seqlens.tolist()] if cu_seqlens.dim() == 1 else [-1]
        checksum = sum((i + 1) * b for i, b in enumerate(bounds)) % (1 << 40)
        check_across_ranks(group, q, k, v, "zigzag", causal, (len(bounds), bounds[-1], checksum))
    if q.dim() != 3:
        raise ValueError(f"varlen q must be (total_local, n_heads, head_dim), got shape {tuple(q.shape)}")
    doc_lens = check_cu_seqlens(cu_seqlens, world)
    local_doc_lens = [n // world for n in doc_lens]
    if sum(local_doc_lens) != q.shape[0]:
        raise ValueError(
            f"cu_seqlens covers {sum(doc_lens)} tokens, i.e. {sum(local_doc_lens)} per rank over "
            f"{world} ranks, but q holds {q.shape[0]} local tokens"
        )
    res = _run(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), group, rank, world, causal, softmax_scale,
        "zigzag", backend, True, local_doc_lens,
    )
    out, lse = res[0].squeeze(0), res[1].squeeze(0)
    return (out, lse) if return_lse else out
