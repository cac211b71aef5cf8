"""Mamba-2's SSD chunk scan under context parallelism (Mamba-2, Bamba, Falcon-H1, Zamba2,
Nemotron-H and the other hybrids built on it).

Computes exactly what one process computes over the full sequence (transformers'
``mamba2_chunk_scan``), each rank holding its pieces of the sequence
(``hf_ring.sharding.pieces``: zigzag, contiguous, packed rows). The recurrence's transition
is one scalar per head, ``exp(dt_t A)``, so a piece's summary is small and its entering
state's effect on its outputs is one cheap term; plain autograd differentiates it all, no
hand-written backward:

1. every piece's chunked scan from a zero entering state, up to but not including the
   entering state's part of the outputs (``ssd_chunk.chunk_terms``; pieces of one length
   batched along the batch dimension): the state it leaves ``S_ext`` ``(b, h, p, n)`` and
   its transition ``a = exp(sum dt A)`` ``(b, h)``;
2. one differentiable all-gather of every piece's ``[S_ext | a]`` (``(pieces, b, h, p n + 1)``
   per rank, whatever the sequence length; its backward reduce-scatters the gradients back
   to the ranks that sent them); every rank composes, in sequence order, the state entering
   each of its pieces, ``S_in(j + 1) = a_j S_in(j) + S_ext(j)``, zero at each document's
   start (``state_exchange.compose_in_order``), with autograd;
3. each piece's outputs, the entering state folded into its chunks' states
   (``ssd_chunk.chunk_outputs``: ``y_t += exp(sum_{u <= t} dt_u A) S_in C_t``), plus ``D x``.

Every rank must run every forward and backward together (the backward's reduce-scatter is
collective): a rank whose outputs need no entering state (contiguous rank 0) still ties them
to the gathered summaries (``state_exchange.join_exchange``), so that it joins the
backward's exchange.

The final state (``return_final_states``) is returned on every rank, composed from the
gathered summaries; its gradient on each rank is that rank's part (the ranks' parts are
summed, like their losses). ``initial_states`` (dense rows) is applied by the rank holding
the row's first piece only, folded into that piece's summary: its gradient is the whole of
it on that rank (rank 0) and zeros on the others. The gradients of the shared ``A``, ``D``
and ``dt_bias`` are, on each rank, that rank's part, as for any parameter under CP.

Must not import transformers, accelerate, or hf_ring's patterns, hf, memory, training or
wrap layers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hf_ring.distributed.collectives import Collectives, GroupCollectives, all_gather
from hf_ring.distributed.active import resolve_cp_group
from hf_ring.distributed.groups import group_coords
from hf_ring.mixers.delta_rule_chunk import accum_dtype
from hf_ring.mixers.ssd_chunk import SSDTerms, chunk_outputs, chunk_terms, discretize_dt
from hf_ring.mixers.state_exchange import compose_in_order, join_exchange, rank_pieces

NO_LIMIT = (0.0, float("inf"))


def _check_inputs(x, dt, A, B, C, D, dt_bias, initial_states, local_doc_lens, chunk_size, dt_limit) -> None:
    tensors = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "dt_bias": dt_bias}
    given = {k: t for k, t in tensors.items() if t is not None}
    if not all(isinstance(t, torch.Tensor) and t.dtype.is_floating_point for t in given.values()):
        raise ValueError(f"{', '.join(given)} must be floating-point tensors")
    if x.dim() != 4:
        raise ValueError(f"x must be (batch, local_seq, n_heads, head_dim), got {tuple(x.shape)}")
    b, s, h, p = x.shape
    if dt.shape != (b, s, h):
        raise ValueError(f"dt must be (batch, local_seq, n_heads) = {(b, s, h)}, got {tuple(dt.shape)}")
    for name in ("A", "D", "dt_bias"):
        if name in given and given[name].shape != (h,):
            raise ValueError(f"{name} must be (n_heads,) = ({h},), got {tuple(given[name].shape)}")
    if B.dim() != 4 or B.shape[:2] != (b, s) or h % B.shape[2]:
        raise ValueError(f"B must be (batch, local_seq, n_groups, state_size) = ({b}, {s}, a divisor of {h}, ...), "
                         f"got {tuple(B.shape)}")
    if C.shape != B.shape:
        raise ValueError(f"C must be shaped like B, {tuple(B.shape)}, got {tuple(C.shape)}")
    if len({t.device for t in given.values()}) > 1:
        raise ValueError(f"{', '.join(given)} must be on one device")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if len(dt_limit) != 2 or not dt_limit[0] <= dt_limit[1]:
        raise ValueError(f"dt_limit must be (low, high) with low <= high, got {dt_limit!r}")
    if initial_states is not None:
        if local_doc_lens is not None:
            raise ValueError("initial_states with packed rows is not supported: every document of a packed "
                             "row starts from a zero state; pass initial_states only for dense rows")
        want = (b, h, p, B.shape[3])
        if tuple(initial_states.shape) != want:
            raise ValueError(f"initial_states must be (batch, n_heads, head_dim, state_size) = {want}, got "
                             f"{tuple(initial_states.shape)}")


def _pack(terms: SSDTerms) -> torch.Tensor:
    """``[S_ext | a]`` of a batch of pieces: ``(b, h, p n + 1)``."""
    return torch.cat([terms.leaving.flatten(-2), terms.transition[..., None]], -1)


def _unpack(summary: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a (b, h), S_ext (b, h, p, n))`` from :func:`_pack`'s ``(b, h, p n + 1)``."""
    return summary[..., -1], summary[..., :-1].unflatten(-1, (p, -1))


def ssd_op(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    coll: Optional[Collectives], layout: str = "zigzag", local_doc_lens: Optional[Sequence[int]] = None,
    chunk_size: int = 256, D: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False, dt_limit: tuple[float, float] = NO_LIMIT,
    initial_states: Optional[torch.Tensor] = None, return_final_states: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`context_parallel_ssd` over given collectives (None: one process); the
    benchmark passes virtual ones. No check across ranks."""
    _check_inputs(x, dt, A, B, C, D, dt_bias, initial_states, local_doc_lens, chunk_size, dt_limit)
    rank, world = (coll.rank, coll.world) if coll is not None else (0, 1)
    mine, order = rank_pieces(layout, rank, world, x.shape[1], local_doc_lens)
    cd = accum_dtype(x.dtype)
    b, p = x.shape[0], x.shape[3]
    xs = (x.to(cd), discretize_dt(dt, dt_bias, dt_softplus, dt_limit, cd), B.to(cd), C.to(cd))
    init = None if initial_states is None else initial_states.to(cd)

    # 1. Phase 1 of every piece from a zero state, pieces of one length together.
    groups: dict[int, list] = {}
    for piece in mine:
        groups.setdefault(piece.length, []).append(piece)
    terms, summaries = {}, {}
    for length, group in groups.items():
        xq, dtq, bq, cq = (torch.cat([t[:, q.local_start:q.local_start + length] for q in group]) for t in xs)
        terms[length] = chunk_terms(xq, dtq, A.to(cd), bq, cq, chunk_size)
        summaries.update(zip((q.slot for q in group), _pack(terms[length]).split(b)))
    owns_init = init is not None and any(q.first for q in mine)
    if owns_init:  # the row's first piece leaves a S_in + S_ext: the state it really leaves
        first = next(q for q in mine if q.first)
        a, s_ext = _unpack(summaries[first.slot], p)
        summaries[first.slot] = torch.cat([(s_ext + a[..., None, None] * init).flatten(-2), a[..., None]], -1)
    packed = torch.stack([summaries[q.slot] for q in mine])  # (slots, b, h, p n + 1)
    if initial_states is not None and initial_states.requires_grad and not owns_init:
        packed = packed + initial_states.reshape(-1)[:0].sum()  # exact zero: a zero gradient here

    # 2. The exchange (every rank takes part) and the composition in sequence order.
    every = all_gather(packed, coll) if world > 1 else packed[None]  # (world, slots, b, h, p n + 1)
    needed = {(q.doc, q.chunk) for q in mine if not q.first}
    if return_final_states:
        needed |= {(q.doc, q.chunk) for q in order if q.chunk == q.chunks - 1}
    entering, leaving = compose_in_order(order, lambda q: _unpack(every[q.owner, q.slot], p),
                                         lambda a, s: a[..., None, None] * s, needed)

    # 3. Outputs from the true entering states: zeros or the initial state at a document's start.
    def s_in(q) -> Optional[torch.Tensor]:
        return entering[(q.doc, q.chunk)] if not q.first else init

    ys = {}
    zero = xs[0].new_zeros(b, x.shape[2], p, B.shape[3])  # (b, h, p, n)
    for length, group in groups.items():
        states = [s_in(q) for q in group]
        batched = None if all(st is None for st in states) else torch.cat([zero if st is None else st
                                                                             for st in states])
        ys.update(zip((q.slot for q in group), chunk_outputs(terms[length], batched).split(b)))
    out = torch.cat([ys[q.slot] for q in mine], 1)  # (b, s, h, p)
    if world > 1 and all(q.first for q in mine):  # join the backward's exchange (module docstring)
        out = join_exchange(out, every)
    if D is not None:
        out = out + D.to(cd)[:, None] * xs[0]
    if not return_final_states:
        return out, None
    final = torch.stack([leaving[(q.doc, q.chunk)] for q in order if q.chunk == q.chunks - 1])  # (docs, b, h, p, n)
    return out, (final[0] if local_doc_lens is None else final.transpose(0, 1))


def context_parallel_ssd(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
    chunk_size: int = 256, D: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False, dt_limit: tuple[float, float] = NO_LIMIT,
    initial_states: Optional[torch.Tensor] = None, return_final_states: bool = False,
    group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag",
    local_doc_lens: Optional[Sequence[int]] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Mamba-2's SSD chunk scan over a sequence sharded across ``group``; exact, differentiable.

    Args:
        x: ``(batch, local_seq, n_heads, head_dim)``; dt: ``(batch, local_seq, n_heads)``;
            A: ``(n_heads,)``, negative (the log decay per unit of dt); B, C: ``(batch,
            local_seq, n_groups, state_size)``, ``n_heads % n_groups == 0``. This rank's
            shard in ``layout`` (A replicated), any float dtype.
        chunk_size: tokens per chunk of the scan (the result does not depend on it).
        D: ``(n_heads,)`` or None: the skip connection, ``y += D x``.
        dt_bias: ``(n_heads,)`` or None, added to dt first; dt_softplus: softplus it next;
            dt_limit: ``(low, high)``, dt clamped to it last (transformers' defaults).
        initial_states: dense rows only, ``(batch, n_heads, head_dim, state_size)``, the same
            on every rank: the state entering each row. Its gradient is the whole of it on
            rank 0 (which holds the row's first piece), zeros on the others.
        return_final_states: also return the state leaving each row (document).
        group: the context-parallel group (None: the active state's CP group, else the
            default group, or one process when torch.distributed is not initialised).
        layout: ``"zigzag"`` or ``"contiguous"``; ``"stripe"`` is refused (one-token pieces
            would each need a state).
        local_doc_lens: a packed row's documents, each one's local length (every document
            zigzag-sharded on its own); no state crosses a document boundary. None: dense.

    Returns:
        ``(y, final_states)``, float32 (float64 for float64 x), states accumulated in it: y
        ``(batch, local_seq, n_heads, head_dim)``; final_states None, or the same on every
        rank: ``(batch, n_heads, head_dim, state_size)``, packed ``(batch, n_docs, n_heads,
        head_dim, state_size)``; its gradient on each rank is that rank's part.
    """
    group = resolve_cp_group(group, "hf_ring.mixers.context_parallel_ssd")
    _, world = group_coords(group)
    coll = GroupCollectives(group) if world > 1 else None
    return ssd_op(x, dt, A, B, C, coll, layout, local_doc_lens, chunk_size, D, dt_bias, dt_softplus, dt_limit,
                  initial_states, return_final_states)


__all__ = ["context_parallel_ssd", "ssd_op"]
