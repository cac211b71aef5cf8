"""Kimi delta attention (KDA, Kimi Linear) under context parallelism.

KDA is a linear recurrence along the sequence (``kimi_delta_chunk``): a rank holding
pieces of the sequence (``hf_ring.sharding.pieces``: zigzag, contiguous, packed rows)
cannot compute its outputs without the state entering each piece, which depends on every
token before it. This computes exactly what one process computes over the full sequence
(transformers' ``chunk_kimi_delta_attention``), outputs, final state and every input's
gradient:

1. every piece of this rank runs the chunked scan once, under autograd, on the widened
   state ``[S | P]`` entering ``[0 | I]`` (``kimi_delta_chunk.widened_scan``): its outputs
   from a zero state ``O0``, its queries seen through its transition ``Qhat``, and its
   summary ``[S_ext | M]`` (the state it leaves from zero, its transition, ``dk x dk``
   per head); pieces of one length in one scan, stacked along the batch;
2. one differentiable all-gather of every piece's summary (``(pieces, batch, heads, dk,
   dv + dk)`` per rank, whatever the sequence length); every rank composes, in sequence
   order, the state entering each of its pieces, ``S_in(j + 1) = M_j S_in(j) +
   S_ext(j)``, starting from zeros or the caller's ``initial_state`` at each document's
   start (``state_exchange.compose_in_order``), under autograd;
3. each piece's outputs are ``O0 + Qhat S_in``.

Plain autograd gives the exact gradients: the all-gather's backward reduce-scatters each
summary's gradient back to the rank that computed it. A rank whose outputs read no
gathered summary (contiguous rank 0 without a final state) still joins that backward
(``state_exchange.join_exchange``). Each rank's gradient of ``initial_state`` is its own
part (through its own outputs and final state); the ranks' parts sum to the full
gradient, as their losses sum.

At one process (no collectives) each document runs the plain scan from its entering state
(no widening).

This layer must not import transformers, accelerate, or hf_ring's patterns, hf, memory,
training or wrap layers: a user with their own model calls the op directly.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hf_ring.distributed.collectives import Collectives, GroupCollectives, all_gather
from hf_ring.distributed.active import resolve_cp_group
from hf_ring.distributed.groups import group_coords
# The gated delta rule's pieces (one per document at one process) and its input checks.
from hf_ring.mixers.delta_rule import check_gated_delta_inputs
from hf_ring.mixers.delta_rule_chunk import heads_first, scan
from hf_ring.mixers.kimi_delta_chunk import chunk_terms, widened_scan
from hf_ring.mixers.state_exchange import compose_in_order, join_exchange, rank_pieces
from hf_ring.sharding.pieces import Piece


def _check_inputs(q, k, v, g, beta, initial_state, local_doc_lens, chunk_size) -> None:
    """KDA's own shape rules (a log decay per key channel, as many value heads as query
    heads), then the gated delta rule's checks of the rest, g's first channel standing in
    for its per-head gate."""
    if isinstance(q, torch.Tensor) and isinstance(g, torch.Tensor) and g.shape != q.shape:
        raise ValueError(f"g must have q's shape (batch, local_seq, n_heads, k_head_dim): one log decay per key "
                         f"channel; got g {tuple(g.shape)} and q {tuple(q.shape)}")
    if isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"v must be (batch, local_seq, n_heads, v_head_dim) with q's batch, length and heads; got "
                         f"v {tuple(v.shape)} and q {tuple(q.shape)}")
    gate = g[..., 0] if isinstance(g, torch.Tensor) and g.dim() == 4 else g
    check_gated_delta_inputs(q, k, v, gate, beta, initial_state, local_doc_lens, chunk_size)


def _compose(mine: list[Piece], order: list[Piece], runs: dict, init: Optional[torch.Tensor],
             coll: Collectives, with_final: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Steps 2 and 3 (module docstring). ``runs[slot]``: ``(o0 (b, h, L, dv), qhat (b, h, L,
    dk), [S_ext | M] (b, h, dk, dv + dk))``. Returns this rank's outputs ``(b, h, s, dv)``
    and, with ``with_final``, the state leaving each document ``(docs, b, h, dk, dv)``."""
    dv = runs[mine[0].slot][0].shape[-1]
    every = all_gather(torch.stack([runs[p.slot][2] for p in mine]), coll)  # (world, slots, b, h, dk, dv + dk)

    def summary(p: Piece) -> tuple[torch.Tensor, torch.Tensor]:
        m, ext = every[p.owner, p.slot, ..., dv:], every[p.owner, p.slot, ..., :dv]
        # A document's first piece leaves M init + S_ext: every rank applies init itself.
        return m, (ext + m @ init if p.first and init is not None else ext)

    last = [p for p in order if p.chunk == p.chunks - 1]  # each document's last piece
    needed = {(p.doc, p.chunk) for p in mine if not p.first}
    needed |= {(p.doc, p.chunk) for p in last} if with_final else set()
    entering, leaving = compose_in_order(order, summary, torch.matmul, needed)
    outs = []
    for p in mine:
        o0, qhat, _ = runs[p.slot]
        s_in = init if p.first else entering[(p.doc, p.chunk)]
        outs.append(o0 if s_in is None else o0 + qhat @ s_in)
    out = join_exchange(torch.cat(outs, 2), every)
    return out, (torch.stack([leaving[(p.doc, p.chunk)] for p in last]) if with_final else None)


def kimi_delta_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    coll: Optional[Collectives], *, layout: str = "zigzag", local_doc_lens: Optional[Sequence[int]] = None,
    chunk_size: int = 64, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`context_parallel_kimi_delta_attention` over given collectives (None: one
    process, the reference the benchmarks compare with); arguments and returns as there.
    No check across ranks."""
    _check_inputs(q, k, v, g, beta, initial_state, local_doc_lens, chunk_size)
    rank, world = (coll.rank, coll.world) if coll is not None else (0, 1)
    mine, order = rank_pieces(layout, rank, world, q.shape[1], local_doc_lens)
    # q, k, g (b, h, s, dk), v (b, h, s, dv), beta (b, h, s): float32 (float64 for float64); q scaled.
    xs = heads_first(q, k, v, g, beta, use_qk_l2norm_in_kernel)
    b = q.shape[0]
    init = None if initial_state is None else initial_state.to(xs[0].dtype)

    groups: dict[int, list[Piece]] = {}
    for p in mine:  # pieces of one length: one scan, stacked along the batch
        groups.setdefault(p.length, []).append(p)
    runs = {}
    for group in groups.values():
        terms = chunk_terms(*(torch.cat([x[:, :, p.local_start:p.local_start + p.length] for p in group])
                              for x in xs), chunk_size)
        if world == 1:  # every piece is a whole document, entering with zeros or init: (out, final)
            res = scan(terms, None if init is None else init.repeat(len(group), 1, 1, 1))
        else:
            res = widened_scan(terms)
        runs.update(zip((p.slot for p in group), zip(*(t.split(b) for t in res))))

    if world == 1:
        out = torch.cat([runs[p.slot][0] for p in mine], 2)  # (b, h, s, dv)
        final = torch.stack([runs[p.slot][1] for p in mine])  # (docs, b, h, dk, dv)
    else:
        out, final = _compose(mine, order, runs, init, coll, output_final_state)
    if output_final_state:  # dense (b, h, dk, dv), packed (b, docs, h, dk, dv)
        final = final[0] if local_doc_lens is None else final.transpose(0, 1)
    return out.transpose(1, 2).to(q.dtype), (final if output_final_state else None)  # out (b, s, h, dv)


def context_parallel_kimi_delta_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    chunk_size: int = 64, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag",
    local_doc_lens: Optional[Sequence[int]] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Kimi delta attention over a sequence sharded across ``group``; exact, differentiable.

    Per head, with the state ``S`` ``(k_head_dim, v_head_dim)``: ``S <- diag(exp g_t) S``,
    ``S <- S + k_t (beta_t (v_t - S^T k_t))^T``, ``o_t = S^T q_t / sqrt(k_head_dim)``
    (transformers' ``chunk_kimi_delta_attention``).

    Args:
        q, k: ``(batch, local_seq, n_heads, k_head_dim)``; v ``(batch, local_seq, n_heads,
            v_head_dim)``; g ``(batch, local_seq, n_heads, k_head_dim)``, the log decay of
            each key channel (<= 0); beta ``(batch, local_seq, n_heads)``; this rank's shard
            in ``layout``, any float dtype.
        chunk_size: tokens per chunk of the scan (the result does not depend on it).
        initial_state: dense rows only, ``(batch, n_heads, k_head_dim, v_head_dim)``, the
            same on every rank: the state entering each row. Its gradient on each rank is
            that rank's part (the parts sum to the full gradient).
        output_final_state: also return the state leaving each row (document).
        use_qk_l2norm_in_kernel: L2-normalise q and k over the head dimension first
            (``x / sqrt(sum x^2 + 1e-6)``).
        group: the context-parallel group (None: the active state's CP group, else the
            default group, or one process when torch.distributed is not initialised).
        layout: ``"zigzag"`` or ``"contiguous"``; ``"stripe"`` is refused (one-token pieces
            would each need a state).
        local_doc_lens: a packed row's documents, each one's local length (every document
            zigzag-sharded on its own); no state crosses a document boundary. None: dense.

    Returns:
        ``(out, final_state)``: out ``(batch, local_seq, n_heads, v_head_dim)`` in q's dtype;
        final_state None, or float32 (float64 for float64 inputs), the same on every rank:
        ``(batch, n_heads, k_head_dim, v_head_dim)``, packed ``(batch, n_docs, n_heads,
        k_head_dim, v_head_dim)``. Everything is computed in float32 (float64).
    """
    group = resolve_cp_group(group, "hf_ring.mixers.context_parallel_kimi_delta_attention")
    _, world = group_coords(group)
    coll = GroupCollectives(group) if world > 1 else None
    return kimi_delta_op(q, k, v, g, beta, coll, layout=layout, local_doc_lens=local_doc_lens, chunk_size=chunk_size,
                         initial_state=initial_state, output_final_state=output_final_state,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


__all__ = ["context_parallel_kimi_delta_attention", "kimi_delta_op"]
