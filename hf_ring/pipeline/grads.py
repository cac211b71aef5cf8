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

from hf_ring.patterns.state import ContextParallelState


def reduce_stage_gradients(parameters: Iterable[torch.nn.Parameter], state: ContextParallelState) -> None:
    """Sum every gradient over the stage's dp x cp ranks, in place (collective over them)."""
    for p in parameters:
        if p.grad is not None and state.loss_size > 1:
            dist.all_reduce(p.grad, group=state.loss_group)


def pipeline_grad_norm(parameters: Iterable[torch.nn.Parameter], state: ContextParallelState) -> torch.Tensor:
    """The 2-norm of the whole model's gradient (float32 or wider), the same on every rank:
    this rank's stages' squares summed over the ``pp`` group (collective over it)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    dtype = torch.promote_types(grads[0].dtype, torch.float32) if grads else torch.float32
    square = sum((g.to(dtype).pow(2).sum() for g in grads), torch.zeros((), dtype=dtype, device=device))
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
        p.grad.mul_(scale.to(p.grad.dtype))
    return norm


__all__ = ["clip_pipeline_grad_norm_", "pipeline_grad_norm", "reduce_stage_gradients"]
