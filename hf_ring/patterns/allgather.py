"""The all-gather pattern (Llama 3's context parallelism): K/V gathered, queries local.

Forward: every rank's K/V is all-gathered in one collective, with K/V's own head count
(with GQA a fraction of q's size), and each rank attends its local queries to the whole
sequence. The gather travels while the blocks on the rank's own K/V (the ring's step 0,
or a packed row's diagonals) run, and is waited for before the first block that needs it.
Which parts of each rank's K/V a local query sees is exactly what the ring computes at
the step that holds that K/V, so the same block schedule (schedule.py, window.py) and
per-step code (``forward_blocks``, ``backward_blocks``) run here, only with every block
present after one transfer: none inside the loop.

Backward: K/V are all-gathered again (not kept from the forward: a full-sequence K/V per
layer would undo the activation memory context parallelism saves; overlapped in the same
way), each rank computes dq and every rank's share of dK/dV from its own rows, and one
reduce-scatter sums the shares onto the ranks that own the K/V. Windows, softcapping and
sinks are computed as in the ring (the plan's kernel settings, ``apply_sinks`` /
``sinks_grad``).

Packed rows (causal, without a window, spans or chunks) take each local chunk of each
document against its document's prefix instead: on a varlen kernel whose causal blocks may
have fewer queries than keys (flash_attn, torch_flash), two calls per layer, every document
at once (``ring/chunk_varlen.py``); on a kernel without a varlen call, a few large calls per
run of equal documents (``ring/prefix.py``). The two varlen calls both need gathered keys,
so there the gather overlaps nothing.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from hf_ring.distributed.collectives import Collectives
from hf_ring.patterns.ring.merge import apply_sinks
from hf_ring.patterns.plan import AttentionPlan
from hf_ring.patterns.ring.attention import (
    KVAttentionFunction, KVPasses, accum_dtype, add_block_dkv, backward_blocks, forward_blocks, unpack_kv,
)
from hf_ring.patterns.ring.chunk_varlen import chunk_backward, chunk_forward, chunk_varlen_runs_here
from hf_ring.patterns.ring.prefix import prefix_backward, prefix_forward, prefix_runs_here


def _sources(plan: AttentionPlan):
    """``(step, src)`` pairs: the ring step whose schedule covers rank ``src``'s K/V; step 0
    is this rank's own."""
    return [(step, (plan.rank - step) % plan.world) for step in range(plan.world)]


def _blocks_forward(plan: AttentionPlan, coll: Collectives, q: torch.Tensor, kv: torch.Tensor):
    """The ring's blocks of every step, every rank's K/V present: accumulated out and lse."""
    s = q.shape[1]
    gathering = coll.start_all_gather(kv)  # travels while step 0 runs on this rank's own K/V
    acc = None
    for step, src in _sources(plan):
        step_kv = kv if step == 0 else gathering.wait()[src]
        acc = forward_blocks(plan, plan.blocks(step, s), q, *unpack_kv(step_kv, q.shape[-1]), acc,
                             plan.span_blocks(step, s))
    return acc


def allgather_forward(
    plan: AttentionPlan, coll: Collectives, q: torch.Tensor, kv: torch.Tensor, sinks: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(b, s, hq, d)``, this rank's K/V stacked ``kv`` ``(2, b, s, hk, d)``, optionally
    ``sinks`` ``(hq,)`` -> out ``(b, s, hq, d)`` in q's dtype and lse ``(b, hq, s)`` float32
    (float64 for float64 inputs)."""
    if chunk_varlen_runs_here(plan):
        out, lse = chunk_forward(plan, coll, q, kv)
    else:
        out, lse = (prefix_forward if prefix_runs_here(plan) else _blocks_forward)(plan, coll, q, kv)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks.detach())
    return out.to(q.dtype), lse


def allgather_backward(
    plan: AttentionPlan, coll: Collectives, dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq ``(b, s, hq, d)``, dk and dv ``(b, s, hk, d)`` (the input dtype) of this rank's
    shard, from ``dout`` ``(b, s, hq, d)``, its ``kv`` ``(2, b, s, hk, d)`` and the
    forward's final ``out`` and ``lse``."""
    if chunk_varlen_runs_here(plan):
        return chunk_backward(plan, coll, dout, q, kv, out, lse)
    if prefix_runs_here(plan):
        return prefix_backward(plan, coll, dout, q, kv, out, lse)
    s = q.shape[1]
    gathering = coll.start_all_gather(kv)  # travels while step 0 runs on this rank's own K/V
    # Row src: this rank's contribution to the gradient of rank src's K/V.
    shares = torch.empty((plan.world, *kv.shape), dtype=accum_dtype(q.dtype), device=q.device)
    dq = None
    for step, src in _sources(plan):
        k, v = unpack_kv(kv if step == 0 else gathering.wait()[src], q.shape[-1])
        dq, block_dkv = backward_blocks(plan, plan.blocks(step, s), dout, q, k, v, out, lse, dq,
                                        plan.span_blocks(step, s))
        add_block_dkv(shares[src], block_dkv, s, True, q.shape[-1])  # each src once: initialise it
    dk, dv = unpack_kv(coll.reduce_scatter(shares), q.shape[-1])  # summed over every rank's rows
    return dq.to(q.dtype), dk.to(kv.dtype), dv.to(kv.dtype)


def allgather_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, coll: Collectives,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The all-gather op (no checks across ranks).

    Args:
        q: ``(batch, local_seq, n_heads, head_dim)``; k, v ``(batch, local_seq, n_kv_heads,
            head_dim)``; one float dtype and device, sharded by ``plan.layout``.
        plan: layout, mask, scale, window, softcap and kernel (its transport is unused).
        coll: the group's collectives (``coll.rank == plan.rank``, ``coll.world == plan.world``).
        sinks: optional float ``(n_heads,)``, differentiable (this rank's rows' part).

    Returns:
        ``out`` like q, differentiable in q, k, v and sinks, and ``lse`` ``(batch, n_heads,
        local_seq)`` float32 (float64 for float64 inputs).
    """
    passes = KVPasses(functools.partial(allgather_forward, plan, coll),
                      functools.partial(allgather_backward, plan, coll))
    return KVAttentionFunction.apply(q, k, v, sinks, passes)


__all__ = ["allgather_attention", "allgather_backward", "allgather_forward"]
