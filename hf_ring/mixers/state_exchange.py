"""The exchange of a linear recurrence's piece summaries, and their composition in order.

A recurrence whose state update is affine in the entering state (the gated delta rule,
Mamba-1 and -2, KDA) lets each piece of consecutive tokens summarise itself, from a zero
entering state, as a transition ``M`` and the state it leaves ``S_ext``:

    S_leave = M . S_enter + S_ext     (``.`` the recurrence's own application of M)

Every rank all-gathers the summaries of every piece once (their size does not depend on
the sequence length), then walks the pieces of each document in sequence order, so that
each piece's entering state is the composition of every summary before it. A document's
first piece enters with nothing (a zero state, or an initial state its owner applied
itself: its summary then carries the state it really leaves and its transition is
never applied).

The all-gather is differentiable: its backward reduce-scatters every rank's gradient of
the gathered summaries onto their owners (each rank used every summary; the owner's
gradient is the sum of those uses).

Must not import transformers or hf_ring's integration or training layers.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from hf_ring.distributed.collectives import Collectives
from hf_ring.sharding.pieces import Piece


class _GatherSummaries(torch.autograd.Function):
    """All-gather forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, coll: Collectives) -> torch.Tensor:
        ctx.coll = coll
        return coll.all_gather(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.coll.reduce_scatter(grad.contiguous()), None


def gather_summaries(x: torch.Tensor, coll: Collectives) -> torch.Tensor:
    """This rank's summaries ``x`` (any shape, the same on every rank) -> ``(world,
    *x.shape)`` in rank order; differentiable (backward: reduce-scatter onto the owners)."""
    return _GatherSummaries.apply(x, coll)


class _DependOn(torch.autograd.Function):
    """``x`` itself; the backward also hands each anchor a zero gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *anchors: torch.Tensor) -> torch.Tensor:
        ctx.anchors = [(a.shape, a.dtype, a.device) for a in anchors]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.anchors)


def depend_on(x: torch.Tensor, *anchors: Optional[torch.Tensor]) -> torch.Tensor:
    """``x``, with a backward that always reaches every anchor (None: skipped) that
    requires grad, with a zero gradient where ``x`` does not use it.

    A rank whose outputs use none of the gathered summaries (contiguous rank 0: its only
    piece starts the row) would otherwise skip the gather's backward, and the other ranks
    would wait in its reduce-scatter forever; an input only one rank uses (the initial
    state) gets a zero gradient, not None, on the others.
    """
    anchors = tuple(a for a in anchors if a is not None and a.requires_grad)
    return _DependOn.apply(x, *anchors) if torch.is_grad_enabled() and anchors else x


Key = tuple[int, int]  # (doc, chunk)


def compose_in_order(
    order: Iterable[Piece],
    summary: Callable[[Piece], tuple[torch.Tensor, torch.Tensor]],
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    needed: set[Key],
) -> tuple[dict[Key, Optional[torch.Tensor]], dict[Key, torch.Tensor]]:
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
    last = {}
    for doc, chunk in needed:
        last[doc] = max(chunk, last.get(doc, -1))
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


__all__ = ["compose_in_order", "depend_on", "gather_summaries"]
