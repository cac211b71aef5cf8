"""A pipeline step's gradients made one process's: summed over the stage's dp x cp ranks, and
their norm taken over every stage.

Why its own module: after :meth:`PipelineRunner.step` each rank holds, for its stages'
parameters only, the gradient of its CP shard's loss shares. One process's gradient of a
parameter is the sum of those over the stage's dp x cp ranks (the ``loss`` group of the
mesh; TP ranks hold the same tokens). Its norm, what gradient clipping and the Trainer's
``grad_norm`` read, is over the *whole* model: the squares of every stage's parameters
summed over the ``pp`` group, each stage counted once (a stage's ranks hold the same reduced
gradients). ``torch.nn.utils.clip_grad_norm_`` on one rank's parameters would clip each
stage by its own norm: another model than one process trains.

Must not import accelerate, TRL, or hf_ring's training layer.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from hf_ring.patterns.state import ContextParallelState


def _sharded(grads: list[torch.Tensor]) -> bool:
    """Whether the stages are sharded by FSDP2 (``hf_ring.pipeline.fsdp``): every gradient a
    DTensor shard, already summed over the stage's dp x cp ranks by its reduce-scatter."""
    kinds = {isinstance(g, DTensor) for g in grads}
    if len(kinds) > 1:
        raise ValueError("some of the stage's gradients are DTensors and some are not: shard every weight of the "
                         "stages (hf_ring.pipeline.fsdp.shard_stages) or none")
    return kinds == {True}


def reduce_stage_gradients(parameters: Iterable[torch.nn.Parameter], state: ContextParallelState) -> None:
    """Sum every gradient over the stage's dp x cp ranks, in place (collective over them).
    Under FSDP2 inside the stages nothing is left to do: their reduce-scatter summed them."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if state.loss_size > 1 and not _sharded(grads):
        # One collective per dtype and device, not one per parameter: a sum is elementwise, so the
        # flat bucket gives each gradient what its own all-reduce would.
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            buckets.setdefault((g.dtype, g.device), []).append(g)
        for bucket in buckets.values():
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=state.loss_group)
            for g, summed in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                g.copy_(summed)


def pipeline_grad_norm(parameters: Iterable[torch.nn.Parameter], state: ContextParallelState) -> torch.Tensor:
    """The 2-norm of the whole model's gradient (float32 or wider), the same on every rank:
    this rank's stages' squares (under FSDP2 its shards', summed over the stage's dp x cp
    ranks first) summed over the ``pp`` group (collective over them)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = _sharded(grads)
    grads = [g.to_local() for g in grads] if sharded else grads
    device = grads[0].device if grads else torch.device("cpu")
    dtype = torch.promote_types(grads[0].dtype, torch.float32) if grads else torch.float32
    square = sum((g.to(dtype).pow(2).sum() for g in grads), torch.zeros((), dtype=dtype, device=device))
    if sharded:
        dist.all_reduce(square, group=state.loss_group)
    if state.mesh.size("pp") > 1:
        dist.all_reduce(square, group=state.mesh.group("pp"))
    return square.sqrt()


def clip_pipeline_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float,
                             state: ContextParallelState) -> torch.Tensor:
    """Scale every gradient so the whole model's norm is at most ``max_norm`` (as
    ``torch.nn.utils.clip_grad_norm_`` does on one process); returns the norm before."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = pipeline_grad_norm(parameters, state)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in parameters:
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        grad.mul_(scale.to(grad.dtype))
    return norm


__all__ = ["clip_pipeline_grad_norm_", "pipeline_grad_norm", "reduce_stage_gradients"]
