"""The gated delta rule under context parallelism (Qwen3-Next, Qwen3.5, OLMo hybrid).

Computes exactly what one process computes over the full sequence (transformers'
``torch_chunk_gated_delta_rule``), each rank holding its pieces of the sequence
(``hf_ring.sharding.pieces``: zigzag, contiguous, packed rows):

1. every piece that does not start its document runs the chunked scan once from a zero
   state on the widened state ``[S | P]`` (``delta_rule_chunk``), which gives its outputs
   from a zero state ``O_ext``, its queries seen through its transition ``Qhat``, the
   state it leaves ``S_ext`` and its transition ``M`` (``dk x dk`` per head). A piece that
   starts its document runs the plain scan from its true entering state (zeros, or the
   caller's ``initial_state``) and its summary is the state it really leaves;
2. one all-gather of every piece's ``[S_ext | M]`` (``(pieces, batch, hv, dk, dv + dk)``
   per rank, whatever the sequence length);
3. every rank composes, in sequence order, the state entering each of its pieces:
   ``S_in(j + 1) = M_j @ S_in(j) + S_ext(j)``, zero at each document's start;
4. its outputs are corrected: ``O = O_ext + Qhat @ S_in`` (linear in ``S_in``).

Backward: every step is differentiable torch; the all-gather's backward reduce-scatters
the summaries' gradients onto their owners (``state_exchange``). Under context
parallelism the final state (``output_final_state``) is returned on every rank: the last
piece's leaving state of each row or document, composed from the gathered summaries. Its
gradient on each rank is that rank's part (the parts are summed, like the ranks' losses).

Must not import transformers, accelerate, or hf_ring's integration or training layers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hf_ring.distributed.collectives import Collectives, GroupCollectives
from hf_ring.mixers.delta_rule_chunk import chunk_scan, heads_first
from hf_ring.mixers.state_exchange import compose_in_order, depend_on, gather_summaries
from hf_ring.patterns.api import group_coords
from hf_ring.sharding.pieces import Piece, in_sequence_order, row_pieces


def _check_inputs(q, k, v, g, beta, initial_state, local_doc_lens, chunk_size) -> None:
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


def _pieces(layout: str, rank: int, world: int, local_len: int,
            local_doc_lens: Optional[Sequence[int]]) -> tuple[list[Piece], list[Piece]]:
    """``(this rank's pieces in local order, every piece in sequence order)``. One process:
    one piece per document (the layout is still checked: stripe is refused everywhere)."""
    every = row_pieces(layout, world, local_len, local_doc_lens) if world > 1 else None
    if every is None:
        row_pieces(layout, 1, 2)  # the same refusal of the stripe layout at world 1
        lens = list(local_doc_lens) if local_doc_lens is not None else [local_len]
        if sum(lens) != local_len or any(n <= 0 for n in lens):
            raise ValueError(f"document local lengths {lens} do not make up {local_len} local tokens")
        starts = [sum(lens[:i]) for i in range(len(lens))]
        every = [[Piece(d, 0, 1, 0, d, starts[d], n) for d, n in enumerate(lens)]]
    return every[rank], in_sequence_order(every)


def _scan_pieces(xs: tuple[torch.Tensor, ...], pieces: list[Piece], chunk_size: int,
                 state: Optional[torch.Tensor], summary: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One chunked scan over ``pieces`` of one length, stacked along the batch (one loop
    over their chunks instead of one per piece). ``xs``: heads-first q, k, v, g, beta of
    the local row. Returns each piece's ``(out, final)`` as :func:`chunk_scan` does."""
    b = xs[0].shape[0]
    stacked = [torch.cat([x[:, :, p.local_start:p.local_start + p.length] for p in pieces]) for x in xs]
    if state is not None:
        state = state.repeat(len(pieces), 1, 1, 1)
    out, final = chunk_scan(*stacked, chunk_size, state, summary)
    return list(zip(out.split(b), final.split(b)))


def gated_delta_rule_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    coll: Optional[Collectives], layout: str = "zigzag", local_doc_lens: Optional[Sequence[int]] = None,
    chunk_size: int = 64, initial_state: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False, output_final_state: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`context_parallel_gated_delta_rule` over given collectives (None: one
    process); the benchmark passes virtual ones. No check across ranks."""
    _check_inputs(q, k, v, g, beta, initial_state, local_doc_lens, chunk_size)
    rank, world = (coll.rank, coll.world) if coll is not None else (0, 1)
    mine, order = _pieces(layout, rank, world, q.shape[1], local_doc_lens)
    xs = heads_first(q, k, v, g, beta, use_qk_l2norm_in_kernel)  # (b, hv, s, d) in float32 / float64
    b, hv, _, dk = xs[1].shape
    dv = xs[2].shape[-1]
    init = None if initial_state is None else initial_state.to(xs[0].dtype)

    # 1. Each piece's scan, pieces of one kind and length together.
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for first in (True, False):
        for length in sorted({p.length for p in mine if p.first == first}):
            group = [p for p in mine if p.first == first and p.length == length]
            for p, res in zip(group, _scan_pieces(xs, group, chunk_size, init if first else None, not first)):
                done[p.slot] = res
    # A first piece's summary is the state it really leaves; its transition is never applied.
    summaries = [done[p.slot][1] if not p.first else
                 torch.cat([done[p.slot][1], done[p.slot][1].new_zeros(b, hv, dk, dk)], -1) for p in mine]

    # 2. The exchange, 3. the composition in sequence order.
    docs_last = {p.doc: p for p in order if p.chunk == p.chunks - 1}
    needed = {(p.doc, p.chunk) for p in mine if not p.first}
    if output_final_state:
        needed |= {(p.doc, p.chunk) for p in docs_last.values()}
    every = torch.stack(summaries)[None]  # (1, slots, b, hv, dk, dv + dk)
    if world > 1:  # every rank takes part, even one that needs no state (it owes the backward's reduce-scatter)
        every = gather_summaries(every[0], coll)  # (world, slots, b, hv, dk, dv + dk)
    entering, leaving = compose_in_order(
        order, lambda p: (every[p.owner, p.slot, ..., dv:], every[p.owner, p.slot, ..., :dv]), torch.matmul, needed)

    # 4. Each piece's outputs with its true entering state.
    outs = []
    for p in mine:
        out = done[p.slot][0]
        if not p.first:  # O = O_ext + Qhat @ S_in
            out = out[..., :dv] + out[..., dv:] @ entering[(p.doc, p.chunk)]
        outs.append(out)
    out = torch.cat(outs, 2).transpose(1, 2).to(q.dtype)  # (b, s, hv, dv)
    if world > 1:
        out = depend_on(out, every, initial_state)
    if not output_final_state:
        return out, None
    finals = [leaving[(p.doc, p.chunk)] for p in docs_last.values()]
    return out, (finals[0] if local_doc_lens is None else torch.stack(finals, 1))


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
        group: the context-parallel group (None: the default group, or one process when
            torch.distributed is not initialised).
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
    _, world = group_coords(group)
    coll = GroupCollectives(group) if world > 1 else None
    return gated_delta_rule_op(q, k, v, g, beta, coll, layout, local_doc_lens, chunk_size, initial_state,
                               use_qk_l2norm_in_kernel, output_final_state)


__all__ = ["context_parallel_gated_delta_rule", "gated_delta_rule_op"]
