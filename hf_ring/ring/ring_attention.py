"""The ring attention autograd function: forward and backward rings over a process group.

Forward: K and V travel around the ring packed in one buffer (one message per step, with
K/V's own head count); while the next block is in flight the current one is computed
and merged into float32 accumulators (see merge.py).

Backward: the K/V ring runs again, and a second ring carries each K/V block's gradient
accumulator along with it, so that after a full turn plus one hop every rank holds the
summed dK/dV of its own shard. Each block's gradients use the *final* out and lse, which
makes their sum the exact gradient. dq, dk, dv accumulate in float32 (float64 for float64
inputs) and are returned in the input dtype.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hf_ring.kernels import AttentionBackend
from hf_ring.ring.comm import DoubleBuffer, RingExchange
from hf_ring.ring.merge import merge_block_
from hf_ring.ring.schedule import step_blocks


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class RingPlan:
    """What a ring call needs besides the tensors: who we are and which blocks to run."""

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        rank: int,
        world: int,
        layout: str,
        causal: bool,
        scale: float,
        backend: AttentionBackend,
        local_doc_lens: Optional[Sequence[int]] = None,
    ) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.layout, self.causal, self.scale = layout, causal, scale
        self.backend = backend
        self.local_doc_lens = local_doc_lens

    def blocks(self, step: int, local_len: int):
        src = (self.rank - step) % self.world
        return step_blocks(self.layout, self.causal, local_len, self.rank, src, self.local_doc_lens)


def ring_forward(
    plan: RingPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(b, s, hq, d)``, k/v ``(b, s, hk, d)`` -> out ``(b, s, hq, d)`` in q's dtype and
    lse ``(b, hq, s)`` float32 (float64 for float64 inputs)."""
    b, s, hq, d = q.shape
    acc = accum_dtype(q.dtype)
    out = torch.zeros(b, s, hq, d, dtype=acc, device=q.device)
    lse = torch.full((b, hq, s), float("-inf"), dtype=acc, device=q.device)
    kv = DoubleBuffer(torch.stack([k, v]))  # (2, b, s, hk, d)
    exchange = RingExchange(plan.group) if plan.world > 1 else None
    for step in range(plan.world):
        if step + 1 < plan.world:
            exchange.start(kv.current, kv.incoming)
        cur_k, cur_v = kv.current[0], kv.current[1]
        for blk in plan.blocks(step, s):
            block_out, block_lse = plan.backend.forward(
                q[:, blk.q_start : blk.q_end],
                cur_k[:, blk.k_start : blk.k_end],
                cur_v[:, blk.k_start : blk.k_end],
                blk.causal,
                plan.scale,
            )
            merge_block_(
                out[:, blk.q_start : blk.q_end], lse[:, :, blk.q_start : blk.q_end], block_out, block_lse
            )
        if step + 1 < plan.world:
            exchange.wait()
            kv.swap()
    return out.to(q.dtype), lse


def ring_backward(
    plan: RingPlan,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for the local q, k, v given ``dout`` ``(b, s, hq, d)`` and the forward's
    final ``out`` and ``lse``."""
    s = q.shape[1]
    acc = accum_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = DoubleBuffer(torch.stack([k, v]))
    dkv = DoubleBuffer(torch.zeros((2, *k.shape), dtype=acc, device=k.device))
    kv_exchange = RingExchange(plan.group) if plan.world > 1 else None
    dkv_exchange = RingExchange(plan.group) if plan.world > 1 else None
    for step in range(plan.world):
        if step + 1 < plan.world:
            kv_exchange.start(kv.current, kv.incoming)
        cur_k, cur_v = kv.current[0], kv.current[1]
        block_dkv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)
        for blk in plan.blocks(step, s):
            qs, ks = slice(blk.q_start, blk.q_end), slice(blk.k_start, blk.k_end)
            bdq, bdk, bdv = plan.backend.backward(
                dout[:, qs], q[:, qs], cur_k[:, ks], cur_v[:, ks], out[:, qs], lse[:, :, qs],
                blk.causal, plan.scale,
            )
            dq[:, qs] += bdq
            block_dkv[0][:, ks] += bdk
            block_dkv[1][:, ks] += bdv
        if step == 0:
            dkv.current.copy_(block_dkv)
        else:
            # The accumulator for the block we now hold arrives from the previous rank.
            dkv_exchange.wait()
            dkv.swap()
            dkv.current.add_(block_dkv)
        if step + 1 < plan.world:
            kv_exchange.wait()
            kv.swap()
        if plan.world > 1:
            dkv_exchange.start(dkv.current, dkv.incoming)
    if plan.world > 1:
        # One more hop brings every accumulator back to the rank that owns the shard.
        dkv_exchange.wait()
        dkv.swap()
    dk, dv = dkv.current[0], dkv.current[1]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """Autograd wrapper; ``lse`` is returned as a non-differentiable output."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan):
        out, lse = ring_forward(plan, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(ctx.plan, dout.contiguous(), q, k, v, out, lse)
        return dq, dk, dv, None
