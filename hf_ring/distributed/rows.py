"""Whole rows back from every CP rank's shard of them, and tensors concatenated over a group.

Under context parallelism each rank holds its shard of every row (``(batch, local_seq,
...)``, in the layout's order); what a user reads per token of a whole row (TRL's
per-token log-probabilities, ``RingTrainer.predict``'s logits and labels) must be put
back together, in token order, on every rank of the CP group: an all-gather over the group
and the layout's inverse permutation. One function does it for every caller, so that they
cannot disagree on the order, and one backward serves the differentiable ones (TRL's
losses): a reduce-scatter, which moves ``(cp_size - 1) / cp_size`` of a row's bytes where
an all-reduce of the whole row moves twice that.

:func:`concat_over_group` is the plain gather the rest need (TRL's rollout rows over the
CP group, the eval losses over the data-parallel ranks): every rank's tensor, concatenated
along dim 0 in rank order.

Must not import transformers, accelerate or hf_ring's patterns (the caller hands in the
group, its size and the layout).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from hf_ring.distributed.collectives import CP_GROUP, GroupCollectives
from hf_ring.sharding import shard_packed, shard_sequence, unshard_packed, unshard_sequence


def _every_rank(tensor: torch.Tensor, group: Optional[dist.ProcessGroup],
                names: tuple[str, str] = CP_GROUP) -> torch.Tensor:
    """``tensor`` (any shape, any dtype, bool included) from every rank of ``group`` ->
    ``(group size, *tensor.shape)`` in rank order, same dtype; collective, not differentiable."""
    dtype = tensor.dtype
    send = tensor.to(torch.int32) if dtype == torch.bool else tensor  # gloo has no bool all-gather
    return GroupCollectives(group, names=names).all_gather(send).to(dtype)


def _whole_rows(local: torch.Tensor, group: Optional[dist.ProcessGroup], layout: str,
                cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    """See :func:`gather_rows`, not differentiable."""
    pieces = list(_every_rank(local, group).unbind(0))
    if cu_seqlens is not None:
        return unshard_packed(pieces, cu_seqlens, dim=1)
    return unshard_sequence(pieces, dim=1, layout=layout)


def _every_shard(rows: torch.Tensor, cp_size: int, layout: str, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    """Whole rows ``(batch, seq, ...)`` cut into every rank's shard: ``(cp_size, batch, local_seq, ...)``."""
    if cu_seqlens is not None:
        return torch.stack([shard_packed(rows, cu_seqlens, cp_size, r, dim=1) for r in range(cp_size)])
    return torch.stack([shard_sequence(rows, cp_size, r, dim=1, layout=layout) for r in range(cp_size)])


class _GatherRows(torch.autograd.Function):
    """Whole rows from every rank's shard; backward: the group's summed gradient of this rank's shard.

    Every rank reads the whole row, so the gradient of rank r's shard is the sum over the
    ranks of their gradient of the row at r's positions: each rank cuts its gradient into
    every rank's shard and a reduce-scatter sums shard r onto rank r.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Optional[dist.ProcessGroup], cp_size: int, layout: str,
                cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.group, ctx.cp_size, ctx.layout, ctx.cu_seqlens = group, cp_size, layout, cu_seqlens
        return _whole_rows(local, group, layout, cu_seqlens)

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        shards = _every_shard(grad_rows, ctx.cp_size, ctx.layout, ctx.cu_seqlens)
        return GroupCollectives(ctx.group).reduce_scatter(shards), None, None, None, None


def gather_rows(local: torch.Tensor, group: Optional[dist.ProcessGroup], cp_size: int, layout: str,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Every rank's shard back into whole rows, in token order, on every rank of the CP group.

    Args:
        local: this rank's shard ``(batch, local_seq, ...)``, any dtype (bool included).
        group: the CP group (None: the default group), of ``cp_size`` ranks; collective over it.
        cp_size: the group's size.
        layout: how the rows were sharded (``"zigzag"``, ``"contiguous"``, ``"stripe"``).
        cu_seqlens: int ``(n_docs + 1,)``, the document boundaries of a packed row
            (``batch`` 1), each document sharded on its own (``hf_ring.sharding.shard_packed``);
            ``layout`` is then not read.

    Returns:
        ``(batch, cp_size * local_seq, ...)``, ``local``'s dtype. Differentiable when ``local``
        requires grad (every rank must then run the backward): ``local``'s gradient is the sum
        over the group's ranks of their gradient of the rows at this rank's positions.
    """
    if cp_size == 1:
        return local
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.cpu()  # one host sync here, none in the shard index math or the backward
    if local.requires_grad:
        return _GatherRows.apply(local, group, cp_size, layout, cu_seqlens)
    return _whole_rows(local, group, layout, cu_seqlens)


def concat_over_group(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], size: int,
                      names: tuple[str, str] = CP_GROUP) -> torch.Tensor:
    """Every rank's ``tensor`` ``(n, ...)`` (the same shape on every rank; any dtype, bool
    included) concatenated along dim 0 in rank order: ``(size * n, ...)``. ``group`` (None:
    the default group) has ``size`` ranks; collective over it; not differentiable.
    ``names``: the group and what its ranks must all run, for the message when one does not
    (``collectives.GroupCollectives``)."""
    if size == 1:
        return tensor
    return _every_rank(tensor, group, names).flatten(0, 1)
