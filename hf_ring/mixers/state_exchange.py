"""The composition of a linear recurrence's piece summaries in sequence order, forward and
backward.

A recurrence whose state update is affine in the entering state (the gated delta rule,
Mamba-1 and -2, KDA) lets each piece of consecutive tokens summarise itself, from a zero
entering state, as a transition ``M`` and the state it leaves ``S_ext``:

    S_leave = M . S_enter + S_ext     (``.`` the recurrence's own application of M)

Every rank all-gathers the summaries of every piece once (their size does not depend on
the sequence length) and walks the pieces of each document in sequence order, so that
each piece's entering state composes every summary before it (:func:`compose_in_order`).
A document's first piece enters with nothing (a zero state, or an initial state its owner
applied itself: its summary then carries the state it really leaves, its transition is
never applied).

The backward is the same walk the other way (:func:`compose_in_reverse`): the gradient
of the loss with respect to the state a piece leaves, ``D``, is what every later piece
sends back through the transitions between them,

    D(j - 1) = G(j) + M(j)^T . D(j),    D(last) = the final state's gradient,

with ``G(j)`` piece ``j``'s own share (the gradient its outputs give its entering state,
linear in them; all-gathered once, like the summaries).

:func:`rank_pieces` gives every recurrence op its rank's pieces and the row's sequence
order (one place for the layout checks, the stripe refusal included); :func:`join_exchange`
ties an op's outputs to the gathered summaries, so that the all-gather's backward (a
collective) runs on every rank.

Must not import transformers or hf_ring's integration or training layers.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import torch

from hf_ring.sharding.pieces import Piece, in_sequence_order, row_pieces

Key = tuple[int, int]  # (doc, chunk)
Summary = Callable[[Piece], tuple[torch.Tensor, torch.Tensor]]
Apply = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _bounds(needed: set[Key], pick) -> dict[int, int]:
    out: dict[int, int] = {}
    for doc, chunk in needed:
        out[doc] = pick(chunk, out.get(doc, chunk))
    return out


def compose_in_order(order: Iterable[Piece], summary: Summary, apply: Apply,
                     needed: set[Key]) -> tuple[dict[Key, Optional[torch.Tensor]], dict[Key, torch.Tensor]]:
    """Entering and leaving states of the pieces in ``needed``, by walking ``order``.

    Args:
        order: every piece of the row in sequence order (``in_sequence_order``).
        summary: a piece's ``(transition, external state)``.
        apply: ``apply(transition, state)``: the transition applied to a state.
        needed: ``(doc, chunk)`` of the pieces whose states are wanted; a document is
            walked only as far as its last needed piece.

    Returns:
        ``(entering, leaving)``, keyed by ``(doc, chunk)``: ``entering`` is None for a
        document's first piece (nothing before it).
    """
    last = _bounds(needed, max)
    entering: dict[Key, Optional[torch.Tensor]] = {}
    leaving: dict[Key, torch.Tensor] = {}
    state: Optional[torch.Tensor] = None
    for p in order:
        if p.doc not in last or p.chunk > last[p.doc]:
            continue
        if p.first:
            state = None  # no state crosses a document boundary
        transition, external = summary(p)
        entering[(p.doc, p.chunk)] = state
        state = external if state is None else apply(transition, state) + external
        leaving[(p.doc, p.chunk)] = state
    return ({k: entering[k] for k in needed}, {k: leaving[k] for k in needed})


def compose_in_reverse(order: Iterable[Piece], summary: Summary, apply_transposed: Apply,
                       terminal: Callable[[int], torch.Tensor], needed: set[Key]) -> dict[Key, torch.Tensor]:
    """The gradient with respect to the state each piece in ``needed`` leaves.

    Args:
        order: every piece of the row in sequence order.
        summary: a piece's ``(transition, share)``: ``share`` is ``G``, the gradient its own
            outputs give the state entering it.
        apply_transposed: ``apply_transposed(transition, grad)``: the adjoint of ``apply``.
        terminal: a document's final-state gradient (zeros when it has none).
        needed: ``(doc, chunk)`` of the pieces wanted; a document is walked back only as
            far as its first needed piece.
    """
    first = _bounds(needed, min)
    leaving: dict[Key, torch.Tensor] = {}
    grad: Optional[torch.Tensor] = None
    for p in reversed(list(order)):
        if p.doc not in first or p.chunk < first[p.doc]:
            continue
        if p.chunk == p.chunks - 1:
            grad = terminal(p.doc)
        leaving[(p.doc, p.chunk)] = grad
        transition, share = summary(p)
        grad = share + apply_transposed(transition, grad)
    return {k: leaving[k] for k in needed}


def rank_pieces(layout: str, rank: int, world: int, local_len: int,
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




class _JoinExchange(torch.autograd.Function):
    """Forward: ``out`` as it is. Backward: ``out``'s gradient, and zeros for the gathered
    summaries."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        ctx.spec = gathered.shape, gathered.dtype, gathered.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.spec
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def join_exchange(out: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """``out`` (any shape), tied to ``gathered`` (the all-gathered summaries) in autograd:
    the all-gather's backward is a collective, so every rank must run it, also one whose
    outputs read none of the summaries (contiguous rank 0 without the last state, say);
    the summaries get a zero gradient through this edge, their real one through the reads."""
    return _JoinExchange.apply(out, gathered)


__all__ = ["compose_in_order", "compose_in_reverse", "join_exchange", "rank_pieces"]
