"""The process groups of the N-D mesh (``mesh.py``: ``pp, dp_replicate, dp_shard, cp, tp``).

Without tensor parallelism CP is the innermost axis: global ranks ``[k * cp_size, (k + 1)
* cp_size)`` form CP group ``k`` (so a CP ring stays within a node, where the links are
fastest, whenever ``cp_size`` divides the processes per node), and the ranks with the same
CP rank across CP groups form a data-parallel group. With ``tp > 1`` TP is innermost and a
CP group's ranks are ``tp`` apart, all of one TP coordinate.

What runs over the groups (layout, pattern, kernel) is the patterns layer's
(``hf_ring.patterns.state``); this module only builds groups. Must not import
transformers, accelerate, or hf_ring's patterns, integration or training layers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from hf_ring.distributed.mesh import ParallelDims
from hf_ring.distributed.nccl_failures import check_error_handling

# A forward that only some ranks of a CP group run (a main-process-only sanity check, say)
# leaves the others waiting in a collective: fail in minutes, not after torch's 30.
DEFAULT_CP_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class AxisGroup:
    """This process's group along one mesh axis (or flattened axes)."""

    group: Optional[dist.ProcessGroup]
    rank: int
    size: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class MeshGroups:
    """This process's groups on the N-D mesh (``mesh.ParallelDims``): context-parallel,
    data-parallel (``batch``: ranks with different batches), tensor-parallel, and ``loss``
    (dp x cp: the ranks whose token counts add up; None as group where that is the whole
    world, so collectives over it run on the default group)."""

    dims: ParallelDims
    cp: AxisGroup
    dp: AxisGroup
    tp: AxisGroup
    loss: AxisGroup


def local_world_size(world: int) -> int:
    """Processes per node as the launcher says (torchrun and accelerate set LOCAL_WORLD_SIZE);
    without it, one node."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else world


def group_coords(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """``(rank, world)`` of this process in ``group``; ``(0, 1)`` without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was passed but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def build_mesh_groups(dims: ParallelDims, dist_backend: Optional[str], timeout: timedelta) -> MeshGroups:
    """Build this mesh's process groups over the initialised default process group.

    Collective over the whole world: every rank creates every group (``new_group``'s
    contract), in the same order, so every process must call this with the same arguments.

    Args:
        dims: the mesh; its ``world_size`` must be the default group's.
        dist_backend: the process-group backend of the new groups (None: the default
            group's; e.g. ``"nccl"``, ``"gloo"``).
        timeout: how long a collective of the new groups waits for a peer before it fails
            (on NCCL: after which the watchdog stops the process, hf_ring's message naming
            the cause; see ``nccl_failures.py``).
    """
    world = dist.get_world_size()
    rank = dist.get_rank()
    if dims.world_size != world:
        raise ValueError(f"the mesh ({dims.describe()}) is for {dims.world_size} processes but the world has {world}")
    if "nccl" in str(dist_backend or dist.get_backend()).lower():
        check_error_handling()

    def build(axes: str, always: bool) -> AxisGroup:
        mine = dims.group_ranks(axes, rank)
        if len(mine) == world and not always:
            return AxisGroup(None, rank, world, mine)
        group = None
        for ranks in dims.all_groups(axes):
            made = dist.new_group(list(ranks), backend=dist_backend, timeout=timeout)
            if ranks == mine:
                group = made
        return AxisGroup(group, mine.index(rank), len(mine), mine)

    # cp and dp are always real groups (the patterns and the data path pass them to
    # collectives); tp and loss are built only when they are not the whole world or a
    # single rank.
    cp, dp = build("cp", True), build("batch", True)
    tp = build("tp", False) if dims.tp > 1 else AxisGroup(None, 0, 1, (rank,))
    return MeshGroups(dims, cp, dp, tp, build("loss", False))


__all__ = ["DEFAULT_CP_TIMEOUT", "AxisGroup", "MeshGroups", "build_mesh_groups", "group_coords", "local_world_size"]
