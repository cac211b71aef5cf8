"""The data-parallel x context-parallel process groups.

Ranks are laid out with context parallelism innermost: global ranks ``[k * cp_size,
(k + 1) * cp_size)`` form CP group ``k`` (so a CP ring stays within a node, where the
links are fastest, whenever ``cp_size`` divides the processes per node), and the ranks
with the same CP rank across CP groups form a data-parallel group.

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

from hf_ring.distributed.nccl_failures import check_error_handling

# A forward that only some ranks of a CP group run (a main-process-only sanity check, say)
# leaves the others waiting in a collective: fail in minutes, not after torch's 30.
DEFAULT_CP_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class DpCpGroups:
    """This process's two groups of the dp x cp grid and its coordinates in them."""

    cp_group: dist.ProcessGroup
    cp_rank: int
    cp_size: int
    dp_group: dist.ProcessGroup
    dp_rank: int
    dp_size: int


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


def build_dp_cp_groups(cp_size: int, dist_backend: Optional[str], timeout: timedelta) -> DpCpGroups:
    """Build the dp x cp groups over the initialised default process group.

    Collective over the whole world: every rank creates every group (``new_group``'s
    contract), so every process must call this with the same arguments.

    Args:
        cp_size: ranks per context-parallel group; must divide the world size.
        dist_backend: the process-group backend of the new groups (None: the default
            group's; e.g. ``"nccl"``, ``"gloo"``).
        timeout: how long a collective of the new groups waits for a peer before it fails
            (on NCCL: after which the watchdog stops the process, hf_ring's message naming
            the cause; see ``nccl_failures.py``).
    """
    world = dist.get_world_size()
    rank = dist.get_rank()
    if world % cp_size != 0:
        raise ValueError(
            f"cp_size={cp_size} does not divide the world size {world}; launch a multiple of "
            f"{cp_size} processes or pick a cp_size that divides {world}"
        )
    dp_size = world // cp_size
    if "nccl" in str(dist_backend or dist.get_backend()).lower():
        check_error_handling()
    cp_group = dp_group = None
    for k in range(dp_size):
        ranks = list(range(k * cp_size, (k + 1) * cp_size))
        group = dist.new_group(ranks, backend=dist_backend, timeout=timeout)
        if rank in ranks:
            cp_group = group
    for j in range(cp_size):
        ranks = list(range(j, world, cp_size))
        group = dist.new_group(ranks, backend=dist_backend, timeout=timeout)
        if rank in ranks:
            dp_group = group
    return DpCpGroups(cp_group, rank % cp_size, cp_size, dp_group, rank // cp_size, dp_size)


__all__ = ["DEFAULT_CP_TIMEOUT", "DpCpGroups", "build_dp_cp_groups", "group_coords", "local_world_size"]
