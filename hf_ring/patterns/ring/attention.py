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

import functools
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from hf_ring.distributed.comm import DKV_CHANNEL, KV_CHANNEL, BlockStream, DoubleBuffer
from hf_ring.patterns.ring.merge import apply_sinks, merge_block_, sinks_grad
from hf_ring.patterns.ring.block_runs import BlockRun, key_ranges, key_rows, query_rows
from hf_ring.patterns.ring.packed_step import backward_varlen, forward_varlen, varlen_groups
from hf_ring.patterns.plan import AttentionPlan
from hf_ring.patterns.ring.spans import SpanBlock


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V in the one buffer a step sends: stacked ``(2, b, s, hk, d)`` when their heads
    have one size, else side by side ``(b, s, hk, dk + dv)`` (multi-head latent attention),
    each in its own size: nothing is padded before communication."""
    return torch.stack([k, v]) if k.shape == v.shape else torch.cat([k, v], dim=-1)


def unpack_kv(kv: torch.Tensor, k_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of K ``(b, s, hk, k_dim)`` and V in a buffer from :func:`pack_kv` (or one
    shaped like it: the dK/dV accumulators, an all-gathered row)."""
    if kv.dim() == 5:
        return kv[0], kv[1]
    return kv[..., :k_dim], kv[..., k_dim:]


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _covers(spans, length: int) -> bool:
    """Whether the ``(start, end)`` ranges tile ``[0, length)`` exactly."""
    pos = 0
    for start, end in sorted(spans):
        if start != pos:
            return False
        pos = end
    return pos == length


def _whole(blocks, length: int) -> bool:
    """One block that covers every query row: its result can become the accumulator."""
    return len(blocks) == 1 and blocks[0].q_start == 0 and blocks[0].q_end == length


def _block_forward(plan: AttentionPlan, blk, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's kernel on already sliced q ``(b, nq, hq, d)``, k, v ``(b, nk, hk, d)``:
    the masked kernel for a block on a window's edge, else the causal / full one (both
    with the plan's softcap, if any)."""
    if blk.mask is None:
        return plan.backend.forward(q, k, v, blk.causal, plan.scale, **plan.kernel_kwargs)
    return plan.backend.masked_forward(q, k, v, plan.mask(blk, q.device), plan.scale, **plan.kernel_kwargs)


def _block_backward(plan: AttentionPlan, blk, dout, q, k, v, out, lse):
    """As :func:`_block_forward`, for the backward (final ``out`` and ``lse`` of the rows)."""
    if blk.mask is None:
        return plan.backend.backward(dout, q, k, v, out, lse, blk.causal, plan.scale, **plan.kernel_kwargs)
    return plan.backend.masked_backward(dout, q, k, v, out, lse, plan.mask(blk, q.device), plan.scale,
                                        **plan.kernel_kwargs)


def forward_blocks(
    plan: AttentionPlan, blocks, q: torch.Tensor, cur_k: torch.Tensor, cur_v: torch.Tensor,
    acc: Optional[tuple[torch.Tensor, torch.Tensor]], extra: Sequence[SpanBlock] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ring step of the forward: every block against the K/V shard held now, folded
    into the accumulators ``acc = (out (b, s, hq, d), lse (b, hq, s))`` (float32, float64
    for float64 inputs), which are returned; then the step's ``extra`` blocks (the
    bidirectional spans' later keys, ``plan.span_blocks``), merged into their rows.

    ``acc`` is None on the first step. Its blocks (the diagonal) usually cover every query
    row once: their results then become the accumulators, with no merge and, when the
    kernel returns the accumulator dtype, no copy. That holds for a masked diagonal too
    (a row with no visible key comes back as out 0, lse -inf, a valid accumulator); a
    step whose blocks a window dropped, wholly or partly, starts from zeros and -inf.
    """
    acc = _causal_forward(plan, blocks, q, cur_k, cur_v, acc)
    out, lse = acc
    for sb in extra:
        blk, rows = sb.block, sb.rows
        qs, ks = slice(blk.q_start, blk.q_end), slice(blk.k_start, blk.k_end)
        block_out, block_lse = _block_forward(plan, blk, q[rows, qs], cur_k[rows, ks], cur_v[rows, ks])
        merge_block_(out[rows, qs], lse[rows, :, qs], block_out, block_lse)
    return acc


def _causal_forward(plan: AttentionPlan, blocks, q, cur_k, cur_v, acc) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward_blocks` for the step's schedule blocks."""
    s = q.shape[1]
    dtype = accum_dtype(q.dtype)
    if acc is None and _whole(blocks, s) and not plan.varlen:
        blk = blocks[0]
        block_out, block_lse = _block_forward(plan, blk, q, cur_k[:, blk.k_start:blk.k_end],
                                              cur_v[:, blk.k_start:blk.k_end])
        return block_out.to(dtype), block_lse.to(dtype)
    first = acc is None and _covers([(b.q_start, b.q_end) for b in blocks], s)
    if acc is None:
        b, _, hq, _ = q.shape
        d = cur_v.shape[-1]  # the output has the value heads' size
        acc = (torch.empty(b, s, hq, d, dtype=dtype, device=q.device),
               torch.empty(b, hq, s, dtype=dtype, device=q.device))
        if not first:
            acc[0].zero_()
            acc[1].fill_(float("-inf"))
    out, lse = acc
    for call in _kernel_calls(plan, blocks, q, cur_k, cur_v, out, lse, first):
        block_out, block_lse = _block_forward(plan, call, query_rows(call, q), key_rows(call, cur_k),
                                              key_rows(call, cur_v))
        out_rows, lse_rows = query_rows(call, out), query_rows(call, lse, seq_dim=2)
        if first:
            out_rows.copy_(block_out)
            lse_rows.copy_(block_lse)
        else:
            merge_block_(out_rows, lse_rows, block_out, block_lse)
    return out, lse


def _kernel_calls(plan: AttentionPlan, blocks, q, cur_k, cur_v, out, lse, first: bool, dout=None, dq=None,
                  block_dkv=None) -> list:
    """The step's blocks as the kernel calls that are left for the caller's loop: on a
    varlen kernel its batched calls run here first (the forward's when ``dout`` is None,
    else the backward's, whose dK/dV go to ``block_dkv``) and only the masked blocks are
    left; else runs of equal blocks become one call each (block_runs.py)."""
    if not plan.varlen:
        return plan.kernel_calls(blocks)
    batched, rest = varlen_groups(blocks)
    for group in batched:
        if dout is None:
            forward_varlen(plan, group, q, cur_k, cur_v, out, lse, first)
        else:
            block_dkv += backward_varlen(plan, group, dout, q, cur_k, cur_v, out, lse, dq, first)
    return rest


def backward_blocks(
    plan: AttentionPlan, blocks, dout: torch.Tensor, q: torch.Tensor, cur_k: torch.Tensor, cur_v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, dq: Optional[torch.Tensor], extra: Sequence[SpanBlock] = (),
) -> tuple[torch.Tensor, list]:
    """One ring step of the backward: every block's gradients given the final ``out`` and
    ``lse``. dq is accumulated into ``dq`` (float32; None on the first step, when a block
    covering every row becomes it) and returned, with the blocks' dK/dV as
    ``[(k_index, dk, dv)]`` for :func:`add_block_dkv` (a key slice, a run of blocks, or for
    the ``extra`` span blocks a ``(row slice, key slice)`` pair), so they can be computed while the
    accumulator they belong to is still in flight."""
    dq, block_dkv = _causal_backward(plan, blocks, dout, q, cur_k, cur_v, out, lse, dq)
    for sb in extra:
        blk, rows = sb.block, sb.rows
        qs, ks = slice(blk.q_start, blk.q_end), slice(blk.k_start, blk.k_end)
        bdq, bdk, bdv = _block_backward(plan, blk, dout[rows, qs], q[rows, qs], cur_k[rows, ks], cur_v[rows, ks],
                                        out[rows, qs], lse[rows, :, qs])
        dq[rows, qs] += bdq
        block_dkv.append(((rows, ks), bdk, bdv))
    return dq, block_dkv


def _causal_backward(plan: AttentionPlan, blocks, dout, q, cur_k, cur_v, out, lse, dq) -> tuple[torch.Tensor, list]:
    """:func:`backward_blocks` for the step's schedule blocks."""
    s = q.shape[1]
    dtype = accum_dtype(q.dtype)
    if dq is None and _whole(blocks, s) and not plan.varlen:
        blk = blocks[0]
        ks = slice(blk.k_start, blk.k_end)
        bdq, bdk, bdv = _block_backward(plan, blk, dout, q, cur_k[:, ks], cur_v[:, ks], out, lse)
        return bdq.to(dtype), [(ks, bdk, bdv)]
    first = dq is None and _covers([(b.q_start, b.q_end) for b in blocks], s)
    if dq is None:
        dq = torch.empty(q.shape, dtype=dtype, device=q.device)
        if not first:
            dq.zero_()
    block_dkv: list = []
    for call in _kernel_calls(plan, blocks, q, cur_k, cur_v, out, lse, first, dout, dq, block_dkv):
        rows = functools.partial(query_rows, call)
        bdq, bdk, bdv = _block_backward(plan, call, rows(dout), rows(q), key_rows(call, cur_k),
                                        key_rows(call, cur_v), rows(out), rows(lse, seq_dim=2))
        dq_rows = rows(dq)
        if first:
            dq_rows.copy_(bdq)
        else:
            dq_rows += bdq
        block_dkv.append((call if isinstance(call, BlockRun) else slice(call.k_start, call.k_end), bdk, bdv))
    return dq, block_dkv


def add_block_dkv(dkv: torch.Tensor, block_dkv: list, length: int, first_step: bool, k_dim: int) -> None:
    """Add a step's dK/dV blocks into the accumulator ``dkv`` (shaped like the step's
    :func:`pack_kv` buffer, K heads of ``k_dim``); on the first step, when the blocks cover
    every key of every row once, they initialise it instead. A block's index is a key slice
    (every row), a :class:`BlockRun` (its blocks' gradients batched, ``(count, len, hk, d)``)
    or a ``(row slice, key slice)`` pair (a span's block)."""
    whole_rows = not any(isinstance(ks, tuple) for ks, _, _ in block_dkv)
    first = first_step and whole_rows and _covers([r for ks, _, _ in block_dkv for r in key_ranges(ks)], length)
    if first_step and not first:
        dkv.zero_()
    dk, dv = unpack_kv(dkv, k_dim)
    for ks, bdk, bdv in block_dkv:
        if isinstance(ks, BlockRun):
            dk_rows, dv_rows = key_rows(ks, dk), key_rows(ks, dv)
        else:
            ks = ks if isinstance(ks, tuple) else (slice(None), ks)
            dk_rows, dv_rows = dk[ks], dv[ks]
        if first:
            dk_rows.copy_(bdk)
            dv_rows.copy_(bdv)
        else:
            dk_rows += bdk
            dv_rows += bdv


def ring_forward(
    plan: AttentionPlan, q: torch.Tensor, kv: torch.Tensor, sinks: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(b, s, hq, d)`` and this rank's K/V stacked, ``kv`` ``(2, b, s, hk, d)`` (the one
    message a step sends; left unchanged), optionally ``sinks`` ``(hq,)`` -> out ``(b, s,
    hq, d)`` in q's dtype and lse ``(b, hq, s)`` float32 (float64 for float64 inputs)."""
    s = q.shape[1]
    blocks = BlockStream(kv, plan.world)
    exchange = plan.transport(KV_CHANNEL) if plan.world > 1 else None
    acc = None
    for step in range(plan.world):
        if step + 1 < plan.world:
            blocks.start(exchange)
        acc = forward_blocks(plan, plan.blocks(step, s), q, *unpack_kv(blocks.current, q.shape[-1]), acc,
                             plan.span_blocks(step, s))
        if step + 1 < plan.world:
            blocks.advance(exchange)
    out, lse = acc
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks.detach())
    return out.to(q.dtype), lse


def ring_backward(
    plan: AttentionPlan,
    dout: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for the local q, k, v given ``dout`` ``(b, s, hq, d)``, this rank's stacked
    ``kv`` ``(2, b, s, hk, d)`` (left unchanged) and the forward's final ``out`` and ``lse``."""
    s = q.shape[1]
    acc = accum_dtype(q.dtype)
    dq = None
    blocks = BlockStream(kv, plan.world)
    # dkv.current accumulates dK/dV for the K/V block held now; it travels with that block.
    dkv = DoubleBuffer(torch.empty(kv.shape, dtype=acc, device=kv.device))
    kv_exchange = plan.transport(KV_CHANNEL) if plan.world > 1 else None
    dkv_exchange = plan.transport(DKV_CHANNEL) if plan.world > 1 else None
    for step in range(plan.world):
        if step + 1 < plan.world:
            blocks.start(kv_exchange)
        dq, block_dkv = backward_blocks(
            plan, plan.blocks(step, s), dout, q, *unpack_kv(blocks.current, q.shape[-1]), out, lse, dq,
            plan.span_blocks(step, s),
        )
        if step > 0:
            # The accumulator for the block we now hold arrives from the previous rank; the
            # transfer overlapped with the block gradients computed above.
            dkv_exchange.wait()
            dkv.swap()
        add_block_dkv(dkv.current, block_dkv, s, step == 0, q.shape[-1])
        if step + 1 < plan.world:
            blocks.advance(kv_exchange)
        if plan.world > 1:
            dkv_exchange.start(dkv.current, dkv.incoming)
    if plan.world > 1:
        # One more hop brings every accumulator back to the rank that owns the shard.
        dkv_exchange.wait()
        dkv.swap()
    dk, dv = unpack_kv(dkv.current, q.shape[-1])
    return dq.to(q.dtype), dk.to(kv.dtype), dv.to(kv.dtype)


class KVPasses(NamedTuple):
    """A pattern that moves this rank's stacked K/V ``kv`` ``(2, b, s, hk, d)`` (ring,
    all-gather): ``forward(q, kv, sinks) -> (out, lse)`` and ``backward(dout, q, kv, out,
    lse) -> (dq, dk, dv)``, with the final out and lse (sink included)."""

    forward: Callable
    backward: Callable


def ring_passes(plan: AttentionPlan) -> KVPasses:
    return KVPasses(functools.partial(ring_forward, plan), functools.partial(ring_backward, plan))


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, sinks: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring over ``plan`` (no checks: the plan and the caller's validation did them).

    Args:
        q: ``(batch, local_seq, n_heads, head_dim)``; k, v ``(batch, local_seq, n_kv_heads,
            head_dim)``; one float dtype and device, sharded as the plan says.
        sinks: optional float ``(n_heads,)``, differentiable.

    Returns:
        ``out`` like q (differentiable in q, k, v, sinks) and ``lse`` ``(batch, n_heads,
        local_seq)`` float32 (float64 for float64 inputs).
    """
    return KVAttentionFunction.apply(q, k, v, sinks, ring_passes(plan))


class KVAttentionFunction(torch.autograd.Function):
    """Autograd wrapper of :class:`KVPasses`; ``lse`` is returned as a non-differentiable output.

    K and V are stacked once, in the forward, into the buffer the pattern sends; that
    buffer (not k and v) is saved for the backward, which sends it again without
    restacking. With ``sinks`` the final out and lse include the sink logit (see
    :func:`apply_sinks`) and the sinks get their gradient from this rank's rows.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, passes: KVPasses):
        kv = pack_kv(k, v)
        out, lse = passes.forward(q, kv, sinks)
        ctx.save_for_backward(q, kv, out, lse, sinks)
        ctx.passes = passes
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kv, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ctx.passes.backward(dout, q, kv, out, lse)
        dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None
