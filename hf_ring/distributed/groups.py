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


# The axes a ProcessMesh builds groups for: pp, cp and tp of the mesh, and two flattened ones
# (mesh.py): batch (the data-parallel ranks fed different batches) and loss (dp x cp). With
# pp > 1 every other group lies inside one pipeline stage (pp is the outermost axis).
BUILT_AXES = ("pp", "cp", "tp", "batch", "loss")


@dataclass(frozen=True)
class ProcessMesh:
    """This process's place on the N-D mesh (``mesh.ParallelDims``) and its group along each
    of :data:`BUILT_AXES`, by name: ``mesh.group("cp")``, ``mesh.rank("batch")``,
    ``mesh.size("loss")``, ``mesh.ranks("tp")``. A group of None is the default group (the
    axis spans the whole world) or, for a one-process mesh, no group at all."""

    dims: ParallelDims
    axes: dict[str, AxisGroup]

    def __post_init__(self) -> None:
        if set(self.axes) != set(BUILT_AXES):
            raise ValueError(f"a ProcessMesh holds the axes {BUILT_AXES}, got {tuple(self.axes)}")
        for name, axis in self.axes.items():
            if axis.size != self.dims.size(name) or not 0 <= axis.rank < axis.size or len(axis.ranks) != axis.size:
                raise ValueError(f"axis {name!r}: rank {axis.rank} of {axis.size} ranks {axis.ranks} does not fit the "
                                 f"mesh {self.dims.describe()}")

    def __hash__(self) -> int:
        return hash((self.dims, tuple(sorted(self.axes.items()))))

    @classmethod
    def single(cls) -> "ProcessMesh":
        """The mesh of one process (no torch.distributed)."""
        return cls(ParallelDims(1), {name: AxisGroup(None, 0, 1, (0,)) for name in BUILT_AXES})

    def _axis(self, name: str) -> AxisGroup:
        if name not in self.axes:
            raise ValueError(f"no group is built for axis {name!r}; the built axes are {', '.join(BUILT_AXES)}")
        return self.axes[name]

    def group(self, name: str) -> Optional[dist.ProcessGroup]:
        return self._axis(name).group

    def rank(self, name: str) -> int:
        return self._axis(name).rank

    def size(self, name: str) -> int:
        return self._axis(name).size

    def ranks(self, name: str) -> tuple[int, ...]:
        """The axis group's global ranks, in the axis's order."""
        return self._axis(name).ranks


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


def build_process_mesh(dims: ParallelDims, dist_backend: Optional[str], timeout: timedelta) -> ProcessMesh:
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
    # collectives); pp (the pipeline's point-to-point sends), tp and loss are built only when
    # they are not the whole world or a single rank.
    cp, dp = build("cp", True), build("batch", True)
    tp = build("tp", False) if dims.tp > 1 else AxisGroup(None, 0, 1, (rank,))
    pp = build("pp", False) if dims.pp > 1 else AxisGroup(None, 0, 1, (rank,))
    return ProcessMesh(dims, {"pp": pp, "cp": cp, "tp": tp, "batch": dp, "loss": build("loss", False)})


__all__ = ["BUILT_AXES", "DEFAULT_CP_TIMEOUT", "AxisGroup", "ProcessMesh", "build_process_mesh", "group_coords",
           "local_world_size"]
