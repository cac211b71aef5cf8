"""The ring of one process, run as the reference runs it: the kernel on each document, nothing more.

A plan of one process (a rank's whole documents under ``placement="by_length"``, or any
call at ``cp_size == 1``) has one ring step whose blocks are the documents' causal
diagonals. The ring's passes (attention.py) still do what a ring needs and one process
does not: they stack K and V into the buffer a ring step sends, copy each run's results
into float32 accumulators, zero and add into dK/dV accumulators. On many short documents
those copies cost about as much as the attention itself (``benchmarks/placement.py``,
virtual rows: 0.71 of ideal on 64 documents of 64 tokens at cp 2 before this path).

Here each document, or each run of equal documents (one batched call,
``block_runs.py``), or the whole row (one varlen call where the kernel has one) goes
straight to the kernel; the results are laid side by side (one concatenation, none for a
single call), and the backward hands the kernel the very out and lse it returned (the
final ones with a sink). Exact: the same kernel calls on the same rows as the ring's
first step, whose results it would have taken as its accumulators unchanged.

It runs only when every block is a whole, unmasked diagonal tiling the row in order:
:func:`one_process_calls` says so, else the ring's own passes run the plan (windows
cutting a document, bidirectional spans, explicit positions), exactly, only slower.

Must not import torch.distributed, transformers, accelerate, or hf_ring's integration or
training layers.
"""

from __future__ import annotations

from typing import Optional

import torch

from hf_ring.patterns.plan import AttentionPlan
from hf_ring.patterns.ring.block_runs import BlockRun, Call, key_rows, query_rows
from hf_ring.patterns.ring.merge import apply_sinks, sinks_grad
from hf_ring.patterns.ring.schedule import Block


def _tiles_row(blocks: list[Block], length: int) -> bool:
    """Whether the blocks are unmasked diagonals (queries and keys the same rows) that
    cover ``[0, length)`` once, in order."""
    end = 0
    for b in blocks:
        if b.mask is not None or b.q_start != end or (b.q_start, b.q_end) != (b.k_start, b.k_end):
            return False
        end = b.q_end
    return end == length


def one_process_calls(plan: AttentionPlan, local_len: int) -> Optional[list[Block]]:
    """The blocks of a one-process plan when :func:`one_process_attention` may run it,
    else None (a plan over several ranks, spans, explicit positions, or a window or
    chunks that cut a document)."""
    if plan.world != 1 or plan.spans is not None or plan.positions is not None:
        return None
    blocks = plan.blocks(0, local_len)
    return blocks if blocks and _tiles_row(blocks, local_len) else None


def _as_row(t: torch.Tensor, call: Call) -> torch.Tensor:
    """A call's result ``(count, n, h, d)`` (a run) or ``(b, n, h, d)`` as rows of the
    sequence: a run's documents follow each other, so it is ``(1, count * n, h, d)``."""
    return t.reshape(1, -1, *t.shape[2:]) if isinstance(call, BlockRun) else t


def _lse_as_row(lse: torch.Tensor, call: Call) -> torch.Tensor:
    """As :func:`_as_row` for an lse ``(count, h, n)`` -> ``(1, h, count * n)``."""
    return lse.transpose(0, 1).reshape(1, lse.shape[1], -1) if isinstance(call, BlockRun) else lse


def _side_by_side(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _forward(plan: AttentionPlan, blocks: list[Block], q, k, v) -> tuple[list, torch.Tensor, torch.Tensor]:
    """The calls, and out ``(b, s, hq, d)`` and lse ``(b, hq, s)`` as the kernel gave them."""
    be = plan.backend
    if plan.varlen:
        sb = plan.varlen_batch(blocks, q.device)
        out, lse = be.varlen_forward(q[0], k[0], v[0], sb.cu_q, sb.cu_k, sb.max_q, sb.max_k, sb.causal, plan.scale)
        return [sb], out.unsqueeze(0), lse.unsqueeze(0)  # (1, s, hq, d), (1, hq, s)
    calls = plan.kernel_calls(blocks)
    results = [be.forward(query_rows(c, q), key_rows(c, k), key_rows(c, v), c.causal, plan.scale,
                          **plan.kernel_kwargs) for c in calls]
    out = _side_by_side([_as_row(o, c) for c, (o, _) in zip(calls, results)], dim=1)
    lse = _side_by_side([_lse_as_row(lse, c) for c, (_, lse) in zip(calls, results)], dim=2)
    return calls, out, lse


def _backward(plan: AttentionPlan, calls: list, dout, q, k, v, out, lse) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv shaped like q, k, v from the final ``out`` and ``lse`` (those of the forward)."""
    be = plan.backend
    if plan.varlen:
        (sb,) = calls
        grads = be.varlen_backward(dout[0], q[0], k[0], v[0], out[0], lse[0], sb.cu_q, sb.cu_k, sb.max_q,
                                   sb.max_k, sb.causal, plan.scale)
        return tuple(g.unsqueeze(0) for g in grads)
    per_call = [be.backward(query_rows(c, dout), query_rows(c, q), key_rows(c, k), key_rows(c, v),
                            query_rows(c, out), query_rows(c, lse, seq_dim=2), c.causal, plan.scale,
                            **plan.kernel_kwargs) for c in calls]
    return tuple(_side_by_side([_as_row(g[i], c) for c, g in zip(calls, per_call)], dim=1) for i in range(3))


class OneProcessAttention(torch.autograd.Function):
    """Autograd of :func:`one_process_attention`; ``lse`` is a non-differentiable output."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: AttentionPlan, blocks: list[Block]):
        calls, out, lse = _forward(plan, blocks, q, k, v)
        if sinks is not None:
            # As the ring does: the sink rescales the float32 result, then it is cast back.
            out, lse = apply_sinks(out.to(lse.dtype), lse, sinks.detach())
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.plan, ctx.calls = plan, calls
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = _backward(ctx.plan, ctx.calls, dout, q, k, v, out, lse)
        dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None


def one_process_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, blocks: list[Block],
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a one-process plan whose blocks tile the row (:func:`one_process_calls`).

    Args:
        q: ``(batch, seq, n_heads, head_dim)``; k, v ``(batch, seq, n_kv_heads, head_dim)``;
            one float dtype and device (packed rows: batch 1, documents side by side).
        plan: a plan of one process (``plan.world == 1``).
        blocks: ``one_process_calls(plan, seq)``.
        sinks: optional float ``(n_heads,)``, differentiable.

    Returns:
        ``out`` like q (differentiable in q, k, v, sinks) and ``lse`` ``(batch, n_heads,
        seq)`` float32 (float64 for float64 inputs).
    """
    return OneProcessAttention.apply(q, k, v, sinks, plan, blocks)


__all__ = ["one_process_attention", "one_process_calls"]
