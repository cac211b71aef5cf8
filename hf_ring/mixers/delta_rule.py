"""The gated delta rule under context parallelism (Qwen3-Next, Qwen3.5, OLMo hybrid).

Computes exactly what one process computes over the full sequence (transformers'
``torch_chunk_gated_delta_rule``), each rank holding its pieces of the sequence
(``hf_ring.sharding.pieces``: zigzag, contiguous, packed rows):

1. every piece's batched chunk terms (``delta_rule_chunk.chunk_terms``), with autograd;
2. every piece that does not start its document runs the scan once from a zero state on
   the widened state ``[S | P]``, without autograd (``summary_scan``): the state it leaves
   ``S_ext``, its transition ``M`` (``dk x dk`` per head) and its queries seen through
   the transition ``Qhat``. A piece that starts its document runs the plain scan from its
   true entering state (zeros, or the caller's ``initial_state``); its summary is the
   state it really leaves;
3. one all-gather of every piece's ``[S_ext | M]`` (``(pieces, batch, hv, dk, dv + dk)``
   per rank, whatever the sequence length); every rank composes, in sequence order, the
   state entering each of its pieces, ``S_in(j + 1) = M_j @ S_in(j) + S_ext(j)``, zero at
   each document's start (``state_exchange.compose_in_order``);
4. each piece runs the plain scan from its ``S_in`` (a constant to autograd).

Backward (``_StateGradients``): autograd differentiates each piece's plain scan, given the
gradient of the state the piece leaves. That gradient ``D`` comes from the later pieces:
each piece's share ``G = Qhat^T dO`` (the gradient its outputs give its entering state)
is all-gathered once, and ``D(j - 1) = G(j) + M(j)^T D(j)`` is composed in reverse order
(``compose_in_reverse``). The widened scan is never differentiated, so the backward costs
the plain scan's backward plus ``G``.

Under context parallelism the final state (``output_final_state``) is returned on every
rank, composed from the gathered summaries; its gradient on each rank is that rank's part
(the ranks' parts are summed, like their losses). ``initial_state``'s gradient is likewise
each rank's part: the whole of it on the rank holding the row's first piece, zeros on the
others.

Must not import transformers, accelerate, or hf_ring's integration or training layers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hf_ring.distributed.collectives import Collectives, GroupCollectives
from hf_ring.mixers.delta_rule_chunk import ChunkTerms, chunk_terms, heads_first, scan, summary_scan
from hf_ring.mixers.state_exchange import compose_in_order, compose_in_reverse, rank_pieces
from hf_ring.distributed.active import resolve_cp_group
from hf_ring.distributed.groups import group_coords
from hf_ring.sharding.pieces import Piece


def check_gated_delta_inputs(q, k, v, g, beta, initial_state, local_doc_lens, chunk_size) -> None:
    """The gated delta rule's input checks (shapes, dtypes, one device, the chunk size, the
    initial state), raising ValueError saying what is wrong; KDA's checks end with them."""
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    if not all(isinstance(t, torch.Tensor) and t.dtype.is_floating_point for t in tensors.values()):
        raise ValueError("q, k, v, g and beta must be floating-point tensors")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be (batch, local_seq, n_k_heads, k_head_dim), got q "
                         f"{tuple(q.shape)} and k {tuple(k.shape)}")
    b, s, hk, _ = q.shape
    if v.dim() != 4 or v.shape[:2] != (b, s) or v.shape[2] % hk:
        raise ValueError(f"v must be (batch, local_seq, n_v_heads, v_head_dim) = ({b}, {s}, a multiple of "
                         f"{hk}, ...), got {tuple(v.shape)}")
    for name in ("g", "beta"):
        if tensors[name].shape != v.shape[:3]:
            raise ValueError(f"{name} must be (batch, local_seq, n_v_heads) = {tuple(v.shape[:3])}, got "
                             f"{tuple(tensors[name].shape)}")
    if len({t.device for t in tensors.values()}) > 1:
        raise ValueError("q, k, v, g and beta must be on one device")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if initial_state is not None:
        if local_doc_lens is not None:
            raise ValueError("initial_state with packed rows is not supported: every document of a packed "
                             "row starts from a zero state; pass initial_state only for dense rows")
        want = (b, v.shape[2], q.shape[3], v.shape[3])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be (batch, n_v_heads, k_head_dim, v_head_dim) = {want}, got "
                             f"{tuple(initial_state.shape)}")


def _stack(xs: tuple[torch.Tensor, ...], pieces: list[Piece], chunk_size: int) -> ChunkTerms:
    """The chunk terms of ``pieces`` (one length), stacked along the batch: one scan over
    their chunks instead of one per piece. ``xs``: heads-first q, k, v, g, beta of the row."""
    return chunk_terms(*(torch.cat([x[:, :, p.local_start:p.local_start + p.length] for p in pieces])
                         for x in xs), chunk_size)


class _StateGradients(torch.autograd.Function):
    """Forward: this rank's outputs as they are and the final states (composed, the same
    on every rank). Backward: the gradient of the state each of this rank's pieces leaves,
    composed in reverse order from every later piece's share, handed to the plain scans'
    leaving states ``s_end`` so that autograd finishes each piece (module docstring)."""

    @staticmethod
    def forward(ctx, out, s_end, final, initial_state, plan):
        # out (b, hv, s, dv); s_end (slots, b, hv, dk, dv); final (docs, b, hv, dk, dv).
        ctx.plan = plan
        ctx.init = initial_state.detach() if initial_state is not None and initial_state.requires_grad else None
        return out.view_as(out), final.clone()

    @staticmethod
    def backward(ctx, d_out, d_final):
        mine, order, qhat, every, coll, with_final = ctx.plan
        dv = d_out.shape[-1]
        shares = torch.zeros((len(mine), *every.shape[2:-1], dv), dtype=d_out.dtype, device=d_out.device)
        for p in mine:
            if not p.first:  # G = Qhat^T dO: (b, hv, dk, dv)
                shares[p.slot] = qhat[p.slot].transpose(-1, -2) @ d_out[:, :, p.local_start:p.local_start + p.length]
        # (world, slots [+ docs], b, hv, dk, dv); the final states' gradients only where they were returned
        gathered = coll.all_gather(torch.cat([shares, d_final]) if with_final else shares)
        terminal = gathered[:, len(mine):].sum(0) if with_final else torch.zeros_like(d_final)
        grads = compose_in_reverse(
            order, lambda p: (every[p.owner, p.slot, ..., dv:], gathered[p.owner, p.slot]),
            lambda m, d: m.transpose(-1, -2) @ d, lambda doc: terminal[doc], {(p.doc, p.chunk) for p in mine})
        d_s_end = torch.stack([grads[(p.doc, p.chunk)] for p in mine])
        # Zeros here: the rank holding the row's first piece gets the real one through its scan.
        d_init = None if ctx.init is None else torch.zeros_like(ctx.init)
        return d_out, d_s_end, None, d_init, None


def gated_delta_rule_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    coll: Optional[Collectives], *, layout: str = "zigzag", local_doc_lens: Optional[Sequence[int]] = None,
    chunk_size: int = 64, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`context_parallel_gated_delta_rule` over given collectives (None: one
    process); the benchmark passes virtual ones. No check across ranks."""
    check_gated_delta_inputs(q, k, v, g, beta, initial_state, local_doc_lens, chunk_size)
    rank, world = (coll.rank, coll.world) if coll is not None else (0, 1)
    mine, order = rank_pieces(layout, rank, world, q.shape[1], local_doc_lens)
    xs = heads_first(q, k, v, g, beta, use_qk_l2norm_in_kernel)  # (b, hv, s, d) in float32 / float64
    b, hv, _, dk = xs[1].shape
    init = None if initial_state is None else initial_state.to(xs[0].dtype)

    # 1-2. Terms, summaries, and the plain scans of the pieces that start their document;
    # pieces of one kind and length together.
    groups = {}
    for p in mine:
        groups.setdefault((p.first, p.length), []).append(p)
    terms, results, qhat, summaries = {}, {}, {}, {}
    for (first, _), group in groups.items():
        t = terms[group[0].slot] = _stack(xs, group, chunk_size)
        if first:
            res = scan(t, None if init is None else init.repeat(len(group), 1, 1, 1))
            for p, out, end in zip(group, res[0].split(b), res[1].split(b)):
                results[p.slot] = (out, end)
                summaries[p.slot] = torch.cat([end.detach(), end.new_zeros(b, hv, dk, dk)], -1)
        else:
            q_hat, summ = summary_scan(t.detach())
            qhat.update(zip((p.slot for p in group), q_hat.split(b)))
            summaries.update(zip((p.slot for p in group), summ.split(b)))

    # 3. The exchange and the composition in sequence order (no autograd: _StateGradients).
    dv = xs[2].shape[-1]
    every = torch.stack([summaries[p.slot] for p in mine])[None]  # (1, slots, b, hv, dk, dv + dk)
    if world > 1:  # every rank takes part, even one that needs no state
        every = coll.all_gather(every[0])  # (world, slots, b, hv, dk, dv + dk)
    last = [p for p in order if p.chunk == p.chunks - 1]  # each document's last piece
    needed = {(p.doc, p.chunk) for p in mine if not p.first} | {(p.doc, p.chunk) for p in last}
    entering, leaving = compose_in_order(
        order, lambda p: (every[p.owner, p.slot, ..., dv:], every[p.owner, p.slot, ..., :dv]), torch.matmul, needed)

    # 4. The plain scans from the true entering states.
    for (first, _), group in groups.items():
        if not first:
            res = scan(terms[group[0].slot], torch.cat([entering[(p.doc, p.chunk)] for p in group]))
            results.update(zip((p.slot for p in group), zip(res[0].split(b), res[1].split(b))))
    out = torch.cat([results[p.slot][0] for p in mine], 2)  # (b, hv, s, dv)
    if world == 1:  # every piece is a whole document: its leaving state is the final one
        final = torch.stack([results[p.slot][1] for p in mine])
    else:
        final = torch.stack([leaving[(p.doc, p.chunk)] for p in last])  # (docs, b, hv, dk, dv)
        plan = (mine, order, qhat, every, coll, output_final_state)
        out, final = _StateGradients.apply(out, torch.stack([results[p.slot][1] for p in mine]), final,
                                           initial_state, plan)
    out = out.transpose(1, 2).to(q.dtype)  # (b, s, hv, dv)
    if not output_final_state:
        return out, None
    return out, (final[0] if local_doc_lens is None else final.transpose(0, 1))


def context_parallel_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag",
    local_doc_lens: Optional[Sequence[int]] = None, chunk_size: int = 64,
    initial_state: Optional[torch.Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gated delta rule over a sequence sharded across ``group``; exact, differentiable.

    Args:
        q, k: ``(batch, local_seq, n_k_heads, k_head_dim)``; v ``(batch, local_seq,
            n_v_heads, v_head_dim)`` with ``n_v_heads % n_k_heads == 0``; g (log decay, <= 0)
            and beta ``(batch, local_seq, n_v_heads)``; this rank's shard in ``layout``, any
            float dtype.
        group: the context-parallel group (None: the active state's CP group, else the
            default group, or one process when torch.distributed is not initialised).
        layout: ``"zigzag"`` or ``"contiguous"``; ``"stripe"`` is refused (one-token pieces
            would each need a state).
        local_doc_lens: a packed row's documents, each one's local length (every document
            zigzag-sharded on its own); no state crosses a document boundary. None: dense.
        chunk_size: tokens per chunk of the scan (the result does not depend on it).
        initial_state: dense rows only, ``(batch, n_v_heads, k_head_dim, v_head_dim)``, the
            same on every rank: the state entering each row. Its gradient on each rank is
            that rank's part.
        use_qk_l2norm_in_kernel: L2-normalise q and k over the head dimension first.
        output_final_state: also return the state leaving each row (document).

    Returns:
        ``(out, final_state)``: out ``(batch, local_seq, n_v_heads, v_head_dim)`` in q's dtype;
        final_state None, or float32 (float64 for float64 inputs), the same on every rank:
        ``(batch, n_v_heads, k_head_dim, v_head_dim)``, packed ``(batch, n_docs, n_v_heads,
        k_head_dim, v_head_dim)``. States accumulate in float32 (float64).
    """
    group = resolve_cp_group(group, "hf_ring.mixers.context_parallel_gated_delta_rule")
    _, world = group_coords(group)
    coll = GroupCollectives(group) if world > 1 else None
    return gated_delta_rule_op(q, k, v, g, beta, coll, layout=layout, local_doc_lens=local_doc_lens,
                               chunk_size=chunk_size, initial_state=initial_state,
                               output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


__all__ = ["check_gated_delta_inputs", "context_parallel_gated_delta_rule", "gated_delta_rule_op"]
