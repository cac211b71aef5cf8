"""Packed rows after an all-gather, on a varlen kernel: one call per local chunk per layer.

After every rank's K/V is gathered, each local chunk ``j`` of each document (rank ``r`` of
``N`` holds chunks ``r`` and ``2N-1-r`` of every document, each ``c`` tokens of ``2Nc``)
sees its document's keys ``[start, start + (j+1)c)``: the chunks before it, all visible,
and its own, causal. That is a causal block with fewer queries than keys, aligned to the
bottom right, which a varlen kernel that declares ``varlen_causal_bottom_right``
(flash-attn) computes for every document at once. So a rank makes two kernel calls per
layer in the forward and two in the backward, whatever the number or lengths of its
documents (Transformer Engine's all-gather CP for packed input does the same), and no
merge: the two chunks cover every local row once.

Each call reads its queries and keys as copies in call order: the local rows of chunk ``j``
of every document, and each document's prefix from the gathered K/V in global order
(``prefix.global_kv``). The backward gathers the K/V again, scatters dq back, adds each
call's dK/dV into the row's global order and reduce-scatters every rank's share onto the
rank that holds those rows.

Must not import transformers, accelerate, or hf_ring's integration or training layers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from hf_ring.distributed.collectives import Collectives
from hf_ring.patterns.plan import AttentionPlan
from hf_ring.patterns.ring.attention import accum_dtype, unpack_kv
from hf_ring.patterns.ring.prefix import global_kv, reduce_scatter_global


@dataclass(frozen=True)
class ChunkCall:
    """One varlen call: local chunk ``j`` of every document against each document's prefix.

    Attributes:
        q_rows: int64 ``(sum c,)``: the local rows of the call's queries, in call order.
        k_rows: int64 ``(sum (j+1) c,)``: the global rows of its keys, in call order.
        cu_q, cu_k: int32 ``(n_docs + 1,)``: each document's queries and keys in the call.
        max_q, max_k: the longest document's query and key counts.
    """

    q_rows: torch.Tensor
    k_rows: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


@functools.lru_cache(maxsize=64)
def chunk_calls(local_doc_lens: tuple[int, ...], rank: int, world: int) -> tuple[ChunkCall, ChunkCall]:
    """The two calls of rank ``rank`` of ``world`` (CPU tensors) for documents of these local
    lengths (each ``2c``, zigzag-sharded per document)."""
    calls = []
    for second, chunk in ((0, rank), (1, 2 * world - 1 - rank)):
        q_rows, k_rows, q_lens, k_lens = [], [], [], []
        local_start = 0
        for n in local_doc_lens:
            c = n // 2
            q_rows.append(torch.arange(local_start + second * c, local_start + (second + 1) * c))
            k_rows.append(torch.arange(local_start * world, local_start * world + (chunk + 1) * c))
            q_lens.append(c)
            k_lens.append((chunk + 1) * c)
            local_start += n
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
                      for lens in (q_lens, k_lens))
        calls.append(ChunkCall(torch.cat(q_rows), torch.cat(k_rows), cu_q, cu_k, max(q_lens), max(k_lens)))
    return calls[0], calls[1]


def chunk_varlen_runs_here(plan: AttentionPlan) -> bool:
    """Whether ``plan`` (all-gather) runs two varlen calls per layer: causal packed rows of
    one batch row, without a window, spans or chunks, on a varlen kernel whose causal blocks
    may have fewer queries than keys (``varlen_causal_bottom_right``)."""
    return (plan.local_doc_lens is not None and plan.causal and plan.window is None and plan.spans is None
            and plan.chunk is None and plan.varlen and plan.backend.varlen_causal_bottom_right)


# Device tensors: a few shapes (a step's layers and passes share one), not every batch's.
@functools.lru_cache(maxsize=4)
def _calls_on(local_doc_lens: tuple[int, ...], rank: int, world: int,
              device: torch.device) -> tuple[tuple[ChunkCall, tuple[torch.Tensor, ...]], ...]:
    """:func:`chunk_calls` with their index tensors (q_rows, k_rows, cu_q, cu_k) on ``device``,
    copied there once per shape, not once per layer."""
    return tuple((call, tuple(t.to(device) for t in (call.q_rows, call.k_rows, call.cu_q, call.cu_k)))
                 for call in chunk_calls(local_doc_lens, rank, world))


def chunk_forward(
    plan: AttentionPlan, coll: Collectives, q: torch.Tensor, kv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(1, s, hq, d)``, this rank's K/V buffer ``kv`` -> out ``(1, s, hq, dv)`` and lse
    ``(1, hq, s)``, both float32 (float64 for float64 inputs), before any sink."""
    kg, vg = unpack_kv(global_kv(coll.all_gather(kv), plan), q.shape[-1])
    dtype = accum_dtype(q.dtype)
    out = torch.empty(*q.shape[:3], vg.shape[-1], dtype=dtype, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=dtype, device=q.device)
    for call, (q_rows, k_rows, cu_q, cu_k) in _calls_on(plan.local_doc_lens, plan.rank, plan.world, q.device):
        block_out, block_lse = plan.backend.varlen_forward(
            q[0].index_select(0, q_rows), kg[0].index_select(0, k_rows), vg[0].index_select(0, k_rows),
            cu_q, cu_k, call.max_q, call.max_k, True, plan.scale)
        out[0].index_copy_(0, q_rows, block_out.to(dtype))
        lse[0].index_copy_(1, q_rows, block_lse.to(dtype))
    return out, lse


def chunk_backward(
    plan: AttentionPlan, coll: Collectives, dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq ``(1, s, hq, d)``, dk and dv ``(1, s, hk, d)`` (the input dtype) of this rank's
    rows, from ``dout``, ``q``, its ``kv`` buffer and the forward's final ``out`` and ``lse``."""
    glob = global_kv(coll.all_gather(kv), plan)
    kg, vg = unpack_kv(glob, q.shape[-1])
    dtype = accum_dtype(q.dtype)
    dq = torch.empty(q.shape, dtype=dtype, device=q.device)  # the two calls write every row once
    d_glob = torch.zeros(glob.shape, dtype=dtype, device=q.device)
    dk_glob, dv_glob = unpack_kv(d_glob, q.shape[-1])
    for call, (q_rows, k_rows, cu_q, cu_k) in _calls_on(plan.local_doc_lens, plan.rank, plan.world, q.device):
        rows = lambda t: t[0].index_select(0, q_rows)  # noqa: E731
        dq_c, dk_c, dv_c = plan.backend.varlen_backward(
            rows(dout), rows(q), kg[0].index_select(0, k_rows), vg[0].index_select(0, k_rows),
            rows(out), lse[0].index_select(1, q_rows), cu_q, cu_k, call.max_q, call.max_k, True, plan.scale)
        dq[0].index_copy_(0, q_rows, dq_c.to(dtype))
        dk_glob[0].index_add_(0, k_rows, dk_c.to(dtype))
        dv_glob[0].index_add_(0, k_rows, dv_c.to(dtype))
    dk, dv = unpack_kv(reduce_scatter_global(coll, plan, d_glob, kv), q.shape[-1])
    return dq.to(q.dtype), dk.to(kv.dtype), dv.to(kv.dtype)


__all__ = ["ChunkCall", "chunk_backward", "chunk_calls", "chunk_forward", "chunk_varlen_runs_here"]
