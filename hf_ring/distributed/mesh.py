"""The N-D parallel mesh: which global ranks share each axis, as pure index math.

Context parallelism is one axis of N-D parallelism. The mesh's axes, outermost first, are
torchtitan's order::

    pp, dp_replicate, dp_shard, cp, tp

TP is innermost because it communicates in every layer's matmuls and wants the fastest
links (inside a node); CP sits next to it because the ring (or all-gather) runs once per
attention layer, also on fast links when ``cp * tp`` fits a node; the data axes are outer,
since they communicate once per step (gradients) or per layer-group (FSDP's gathers). A
global rank is the row-major index of its coordinates in that order, so a CP group holds
ranks of one TP coordinate, ``tp`` apart: each rank of a CP ring holds the same heads of
the same layers, which is what makes a ring over local heads exact.

Flattened axes (what the training layer reduces over):

- ``batch`` = ``dp_replicate x dp_shard``: ranks that get different batches. Every rank of
  one ``cp x tp`` block gets the same batch.
- ``loss`` = ``dp_replicate x dp_shard x cp``: ranks whose token counts and gradient
  shares add up to the step's (TP ranks hold the same tokens and are never counted twice).
- ``fsdp`` = ``dp_shard x cp``: what FSDP shards weights over (CP ranks hold the same
  weights, so they shard them as data ranks do).

Ulysses' all-to-all (and the hybrid pattern's Ulysses groups) runs over consecutive ranks
of the CP group: with ``tp > 1`` those are ``tp`` global ranks apart, inside one node when
``cp * tp`` fits one (``patterns/auto.py`` reads the stride).

Nothing here communicates (``groups.py`` builds the process groups from it), so the
mesh's validation is tested without a world. Must not import torch.distributed,
transformers, accelerate, or hf_ring's other layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

# Outermost first; a rank is the row-major index of its coordinates in this order.
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED_AXES = {
    "batch": ("dp_replicate", "dp_shard"),
    "loss": ("dp_replicate", "dp_shard", "cp"),
    "fsdp": ("dp_shard", "cp"),
}
Axes = Union[str, tuple[str, ...]]


def _axes(axes: Axes) -> tuple[str, ...]:
    """``axes`` as mesh axes in mesh order (a flattened name expanded); refuses unknown names."""
    names = FLATTENED_AXES.get(axes, (axes,)) if isinstance(axes, str) else tuple(axes)
    unknown = [a for a in names if a not in MESH_AXES]
    if unknown or not names:
        raise ValueError(f"unknown mesh axes {list(unknown) or names!r}; the axes are {', '.join(MESH_AXES)} and the "
                         f"flattened {', '.join(FLATTENED_AXES)}")
    return tuple(a for a in MESH_AXES if a in names)


@dataclass(frozen=True)
class ParallelDims:
    """The size of every mesh axis over a world of ``world_size`` processes.

    Attributes:
        world_size: processes in the world; must equal the product of the axes.
        cp: context-parallel ranks (the sequence split ``cp`` ways).
        tp: tensor-parallel ranks (heads and MLP columns split ``tp`` ways).
        dp_replicate: data-parallel replicas (DDP, or HSDP's replicate dimension).
        dp_shard: data-parallel ranks that shard weights (FSDP); -1: whatever fills the world.
        pp: pipeline stages, the outermost axis (``hf_ring.pipeline`` runs PyTorch's schedules over it).
    """

    world_size: int
    cp: int = 1
    tp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "cp", "tp", "dp_replicate", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.dp_shard, bool) or not isinstance(self.dp_shard, int) or (
                self.dp_shard < 1 and self.dp_shard != -1):
            raise ValueError(f"dp_shard must be a positive int or -1 (whatever fills the world), got {self.dp_shard!r}")
        others = self.pp * self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"pp x dp_replicate x cp x tp = {self.pp} x {self.dp_replicate} x {self.cp} x {self.tp} = {others} "
                    f"does not divide the world of {self.world_size} processes; launch a multiple of {others} "
                    "processes or change the sizes")
            object.__setattr__(self, "dp_shard", self.world_size // others)
        if others * self.dp_shard != self.world_size:
            raise ValueError(
                f"the mesh pp x dp_replicate x dp_shard x cp x tp = {self.pp} x {self.dp_replicate} x {self.dp_shard} x "
                f"{self.cp} x {self.tp} = {others * self.dp_shard} processes, but the world has {self.world_size}; "
                "the axes must fill the world exactly (dp_shard=-1 fills it)")

    @property
    def shape(self) -> tuple[int, ...]:
        """The sizes in :data:`MESH_AXES` order."""
        return tuple(getattr(self, a) for a in MESH_AXES)

    def size(self, axes: Axes) -> int:
        """The size of an axis, a flattened axis (``batch``, ``loss``, ``fsdp``) or a tuple of axes."""
        return math.prod(getattr(self, a) for a in _axes(axes))

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate on every mesh axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        out = {}
        for axis, n in zip(reversed(MESH_AXES), reversed(self.shape)):
            rank, out[axis] = divmod(rank, n)
        return {a: out[a] for a in MESH_AXES}

    def rank_at(self, coords: dict[str, int]) -> int:
        """The global rank at ``coords`` (every mesh axis)."""
        rank = 0
        for axis, n in zip(MESH_AXES, self.shape):
            c = coords[axis]
            if not 0 <= c < n:
                raise ValueError(f"coordinate {axis}={c} is outside the axis of size {n}")
            rank = rank * n + c
        return rank

    def coord(self, axes: Axes, rank: int) -> int:
        """``rank``'s index along ``axes`` (flattened row-major in mesh order)."""
        c = self.coords(rank)
        index = 0
        for a in _axes(axes):
            index = index * getattr(self, a) + c[a]
        return index

    def group_ranks(self, axes: Axes, rank: int) -> tuple[int, ...]:
        """The ranks that share every coordinate of ``rank`` but ``axes``, in order along
        ``axes`` (so ``rank`` is at index :meth:`coord`)."""
        names = _axes(axes)
        base = self.coords(rank)
        ranks = []
        for i in range(self.size(names)):
            c = dict(base)
            for a in reversed(names):
                i, c[a] = divmod(i, getattr(self, a))
            ranks.append(self.rank_at(c))
        return tuple(ranks)

    def all_groups(self, axes: Axes) -> list[tuple[int, ...]]:
        """Every group along ``axes``, each once, ordered by its first rank: the order in
        which every process must create them (``new_group`` is collective)."""
        return sorted({self.group_ranks(axes, r) for r in range(self.world_size)})

    def describe(self) -> str:
        return " x ".join(f"{a} {n}" for a, n in zip(MESH_AXES, self.shape) if n > 1) or "one process"


def check_cp_within_tp_coordinate(cp_ranks: tuple[int, ...], tp_group_of: dict[int, tuple[int, ...]]) -> None:
    """Refuse a CP group that holds ranks of different TP coordinates.

    Args:
        cp_ranks: the CP group's global ranks, in CP order.
        tp_group_of: for each of those ranks, the global ranks of its TP group in TP order
            (as the model's tensor-parallel mesh has them).

    A CP ring passes K/V blocks between its ranks; under TP each rank holds only its TP
    coordinate's heads, so a ring across TP coordinates would attend one rank's heads with
    another's keys: a wrong model, not an error, unless refused here.
    """
    positions = {r: tp_group_of[r].index(r) for r in cp_ranks}
    if len(set(positions.values())) > 1:
        raise ValueError(
            f"the context-parallel group {list(cp_ranks)} holds ranks of different tensor-parallel coordinates "
            f"({', '.join(f'rank {r}: tp {p}' for r, p in positions.items())}): its ring would mix different heads. "
            "Build the CP groups on the same mesh as TP (hf_ring.setup_context_parallel(cp_size, tp_size=...) or "
            "RingAttentionPlugin(cp_size=..., tp_size=...)): CP between the data axes and TP, TP innermost")


__all__ = ["FLATTENED_AXES", "MESH_AXES", "ParallelDims", "check_cp_within_tp_coordinate"]
