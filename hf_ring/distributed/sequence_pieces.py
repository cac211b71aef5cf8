"""A rank's piece of a sequence that a tensor-parallel group holds whole, and the way back.

Why: sequence parallelism inside TP (``hf_ring.memory.sequence_parallel``) keeps, between
the TP blocks, only ``1 / T`` of the tokens on each of the ``T`` ranks of a TP group, where
plain TP keeps all of them on every rank. Three differentiable steps do it, each with the
backward that keeps the gradients what one process computes:

- :func:`piece_of`: a tensor every rank holds whole and alike (TP's all-reduced block
  output) -> this rank's piece. Each piece feeds a different part of the loss, so the whole
  tensor's gradient is the pieces' gradients gathered from every rank.
- :func:`whole_from_pieces`: the pieces -> the whole tensor, on every rank. Its consumers
  are TP's blocks, whose backward hands the gradient back whole and alike on every rank
  (transformers' column-parallel inputs all-reduce it, replicated modules compute it
  alike), so this rank's piece of it is its piece's gradient.
- :func:`grad_summed_over`: a weight used on this rank's piece only (a norm's): the
  identity, whose backward sums the gradient over the group, as one rank holding every
  token would have it.

Pieces are equal: the length along ``dim`` must divide by the group's size (the caller
refuses other lengths), so the whole length is always ``T`` times a piece's.

Must not import transformers or accelerate.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from hf_ring.distributed.collectives import GroupCollectives

TP_GROUP = ("the tensor-parallel group", "the same decoder layer (every TP rank must run every layer's forward and "
            "backward on the same batch)")


def _gather(x: torch.Tensor, coll: GroupCollectives, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order."""
    parts = coll.all_gather(x.movedim(dim, 0))  # (world, piece, ...): one contiguous collective
    return parts.flatten(0, 1).movedim(0, dim)


class _PieceOf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, coll: GroupCollectives, dim: int) -> torch.Tensor:
        ctx.coll, ctx.dim = coll, dim
        return x.chunk(coll.world, dim)[coll.rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad.contiguous(), ctx.coll, ctx.dim), None, None


class _WholeFromPieces(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, coll: GroupCollectives, dim: int) -> torch.Tensor:
        ctx.coll, ctx.dim = coll, dim
        return _gather(x.contiguous(), coll, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.coll.world, ctx.dim)[ctx.coll.rank].contiguous(), None, None


class _GradSummedOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def piece_of(x: torch.Tensor, coll: GroupCollectives, dim: int) -> torch.Tensor:
    """This rank's piece of ``x`` along ``dim``: ``x`` (any shape, floating, whole and the
    same on every rank of ``coll``'s group, its ``dim`` a multiple of the group size) ->
    ``x.shape`` with ``dim`` divided by the group size. Backward: the pieces' gradients
    gathered (every rank must run it)."""
    return _PieceOf.apply(x, coll, dim)


def whole_from_pieces(x: torch.Tensor, coll: GroupCollectives, dim: int) -> torch.Tensor:
    """Every rank's piece ``x`` (floating, the same shape on every rank) concatenated along
    ``dim`` in rank order. Backward: this rank's piece of a gradient that must be the same on
    every rank (see the module docstring)."""
    return _WholeFromPieces.apply(x, coll, dim)


def grad_summed_over(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``x`` itself (any shape, floating); its gradient summed over ``group`` in backward
    (every rank must run it)."""
    return _GradSummedOver.apply(x, group)


__all__ = ["TP_GROUP", "grad_summed_over", "piece_of", "whole_from_pieces"]
