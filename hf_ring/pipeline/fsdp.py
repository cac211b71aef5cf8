"""FSDP2 inside a pipeline stage: each stage's weights sharded over its own dp x cp ranks.

Why its own module, and why this way: a stage's ranks are a whole dp x cp block of the mesh
holding the same layers, so they are the ranks that can share those layers' weights; FSDP2
over the world (what Accelerate's FSDP plugin builds) would shard a stage's weights over
ranks of other stages, which hold other layers. So each stage is sharded over the stage's
``loss`` group (its dp x cp ranks) as a one-dimensional ``DeviceMesh``: every decoder layer
of the stage its own ``fully_shard`` unit, then the stage module itself (its root unit: the
embedding on the first stage, the final norm and the head on the last). PyTorch's
``PipelineStage`` sees an ``FSDPModule`` and drives it itself: no gradient reduction during
the micro-batches' backwards, and FSDP's post-backward (the reduce-scatter) at the end of
every schedule step. The reduce-scatter *sums* (divide factor 1, sum reductions): each
rank's loss share is already normalised by the step's tokens over dp x cp, the sum over the
stage's ranks is one process's gradient, as ``reduce_stage_gradients`` sums without FSDP.
Gradients are then sharded DTensors; ``grads`` takes their norm over shards and stages.

Must not import accelerate, TRL, or hf_ring's training layer.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from hf_ring.patterns.state import ContextParallelState


# PyTorch's zero-bubble schedules split each backward into an input-gradient and a weight-gradient
# action; with FSDP2 inside the stages the weight gradients of a rank's later stage came back wrong
# after one step (torch 2.13, pp2 x cp2 InterleavedZeroBubble: every weight of rank 0's stage 2; its
# stage 0 right): refused until understood. GPipe, 1F1B, Interleaved1F1B and LoopedBFS are exact.
UNCOMPOSED_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")


def check_fsdp_schedule(schedule: str) -> None:
    """Refuse FSDP2 inside the stages under a schedule it is not composed with."""
    if schedule in UNCOMPOSED_SCHEDULES:
        raise NotImplementedError(
            f"FSDP2 inside pipeline stages (pp_fsdp=True) under pp_schedule={schedule!r} is not composed: with "
            "PyTorch's split weight-gradient actions the sharded gradients of a rank's later stage came out wrong; "
            "use 1F1B, Interleaved1F1B, GPipe or LoopedBFS, or pp_fsdp=False")


def stage_mesh(state: ContextParallelState, device_type: str) -> DeviceMesh:
    """The stage's dp x cp ranks (its ``loss`` group) as a one-dimensional device mesh."""
    if state.mesh.dims.dp_replicate > 1 or state.tp_size > 1:
        raise NotImplementedError(
            f"FSDP2 inside a pipeline stage shards over the stage's dp_shard x cp ranks; dp_replicate="
            f"{state.mesh.dims.dp_replicate} (HSDP) and tp_size={state.tp_size} are not composed with it yet: "
            "use neither, or pp_fsdp=False")
    group = state.loss_group if state.loss_size > 1 else None
    if group is None:
        raise ValueError("FSDP2 inside a pipeline stage needs dp x cp > 1 ranks a stage to shard over "
                         f"(this stage has {state.loss_size}); use pp_fsdp=False")
    return DeviceMesh.from_group(group, device_type, mesh=dist.get_process_group_ranks(group),
                                 mesh_dim_names=("stage_dp_cp",))


def shard_stages(stages: dict[int, Any], state: ContextParallelState, reshard_after_forward: bool = True) -> DeviceMesh:
    """``fully_shard`` every stage of this rank (``PipelineRunner.stages``) over the stage's dp x cp
    ranks, in place: each decoder layer the stage runs, then the stage module (whatever of the
    embedding, final norm and head it holds). Gradients reduce-scattered as sums. Returns the mesh."""
    device = next(p for stage in stages.values() for p in stage.parameters()).device
    mesh = stage_mesh(state, device.type)
    for stage in stages.values():
        units = [layer for layer in stage.lm.base_model.layers if any(True for _ in layer.parameters())]
        for unit in [*units, stage]:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    return mesh


__all__ = ["UNCOMPOSED_SCHEDULES", "check_fsdp_schedule", "shard_stages", "stage_mesh"]
