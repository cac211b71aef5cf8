"""The N-D mesh (hf_ring/distributed/mesh.py): which global ranks share each axis, its
validation, and the refusal of a CP group that crosses TP coordinates. Pure index math:
no world needed. The groups built from it over a real world: tests/test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from hf_ring.distributed.mesh import MESH_AXES, ParallelDims, check_cp_within_tp_coordinate
from hf_ring.patterns.auto import pattern_candidates

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)


def test_axes_in_torchtitan_order_tp_innermost():
    assert MESH_AXES == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    dims = ParallelDims(8, cp=2, tp=2)  # dp_shard fills the world: 2
    assert dims.shape == (1, 1, 2, 2, 2)
    assert dims.coords(5) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 1}
    assert all(dims.rank_at(dims.coords(r)) == r for r in range(8))
    # A CP group holds one TP coordinate, tp ranks apart; a TP group is consecutive.
    assert dims.group_ranks("cp", 0) == (0, 2) and dims.group_ranks("cp", 5) == (5, 7)
    assert dims.group_ranks("tp", 6) == (6, 7)
    # batch: the ranks fed different batches; loss: dp x cp; fsdp: dp_shard x cp.
    assert dims.group_ranks("batch", 3) == (3, 7)
    assert dims.group_ranks("loss", 1) == (1, 3, 5, 7)
    assert dims.group_ranks("fsdp", 0) == (0, 2, 4, 6)
    assert dims.coord("loss", 7) == 3 and dims.coord("cp", 7) == 1 and dims.coord("batch", 7) == 1
    assert dims.all_groups("cp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert dims.size("loss") == 4 and dims.size(("cp", "tp")) == 4


def test_without_tp_the_groups_are_the_consecutive_cp_blocks_of_before():
    dims = ParallelDims(6, cp=3)
    assert dims.all_groups("cp") == [(0, 1, 2), (3, 4, 5)]
    assert dims.all_groups("batch") == [(0, 3), (1, 4), (2, 5)]
    assert dims.group_ranks("loss", 4) == tuple(range(6))


def test_hsdp_axes_and_every_rank_in_exactly_one_group_per_axis():
    dims = ParallelDims(16, cp=2, tp=2, dp_replicate=2, dp_shard=2)
    for axes in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "batch", "loss", "fsdp"):
        groups = dims.all_groups(axes)
        members = sorted(r for g in groups for r in g)
        assert members == list(range(16)), axes
        assert all(len(g) == dims.size(axes) for g in groups), axes
    assert dims.group_ranks("dp_replicate", 0) == (0, 8)


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=6, cp=4), "does not divide the world of 6"),
    (dict(world_size=8, cp=2, tp=2, dp_shard=3), "must fill the world exactly"),
    (dict(world_size=4, cp=0), "cp must be a positive int"),
    (dict(world_size=4, tp=True), "tp must be a positive int"),
    (dict(world_size=4, dp_shard=0), "dp_shard must be a positive int or -1"),
])
def test_refused_meshes_say_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs)


def test_unknown_axis_and_rank_are_refused():
    dims = ParallelDims(4, cp=2)
    with pytest.raises(ValueError, match="unknown mesh axes"):
        dims.group_ranks("sp", 0)
    with pytest.raises(ValueError, match="outside the world of 4"):
        dims.coords(4)


def test_cp_group_across_tp_coordinates_is_refused():
    tp_mesh = ParallelDims(4, cp=2, tp=2)
    tp_group_of = {r: tp_mesh.group_ranks("tp", r) for r in range(4)}
    check_cp_within_tp_coordinate(tp_mesh.group_ranks("cp", 1), tp_group_of)  # (1, 3): both tp 1
    # Consecutive CP groups (the layout without TP) under a TP model: ranks 0 and 1 hold different heads.
    consecutive = ParallelDims(4, cp=2).group_ranks("cp", 0)
    with pytest.raises(ValueError, match=r"different tensor-parallel coordinates \(rank 0: tp 0, rank 1: tp 1\)"):
        check_cp_within_tp_coordinate(consecutive, tp_group_of)


def _order(**kwargs) -> list[str]:
    return [c.pattern + (f"/{c.ulysses_size}" if c.ulysses_size else "") for c in pattern_candidates(**kwargs)]


def test_auto_reads_node_placement_from_the_strided_cp_group():
    common = dict(n_heads=32, n_kv_heads=8, seq_len=65536, local_world_size=8)
    # cp 4 x tp 2 on an 8-process node: CP ranks 0, 2, 4, 6 are all inside it.
    assert _order(cp_size=4, rank_stride=2, **common)[0] == "ulysses"
    # cp 4 x tp 4: ranks 0, 4 | 8, 12 span two nodes, so not Ulysses; Ulysses pairs stay inside one: hybrid/2.
    assert _order(cp_size=4, rank_stride=4, **common) == ["hybrid/2", "ring", "allgather"]
    # cp 2 x tp 8: ranks 0 | 8, one per node: no node-local Ulysses group.
    assert _order(cp_size=2, rank_stride=8, **common) == ["ring", "allgather"]


def test_process_mesh_holds_every_axis_by_name_and_refuses_what_does_not_fit():
    """The state's one mesh object (no communication: groups of None): every built axis by
    name, and a group whose size or ranks do not fit the dimensions refused on creation."""
    from hf_ring.distributed.groups import BUILT_AXES, AxisGroup, ProcessMesh
    from hf_ring.patterns.state import AttentionSettings, ContextParallelState

    dims = ParallelDims(8, cp=2, tp=2)
    rank = 5  # dp 1, cp 0, tp 1
    axes = {name: AxisGroup(None, dims.coord(name, rank), dims.size(name), dims.group_ranks(name, rank))
            for name in BUILT_AXES}
    mesh = ProcessMesh(dims, axes)
    assert (mesh.rank("cp"), mesh.ranks("cp"), mesh.ranks("tp"), mesh.size("loss")) == (0, (5, 7), (4, 5), 4)
    state = ContextParallelState(mesh, AttentionSettings(kernel="reference"))
    assert (state.dp_rank, state.dp_size, state.cp_ranks, state.first_rank, state.kernel) == (1, 2, (5, 7), 5,
                                                                                             "reference")
    assert (state.world_size, state.loss_size, state.cp_rank_stride) == (8, 4, 2)
    with pytest.raises(ValueError, match="no group is built for axis 'fsdp'"):
        mesh.group("fsdp")
    with pytest.raises(ValueError, match="axis 'cp'"):
        ProcessMesh(dims, {**axes, "cp": AxisGroup(None, 0, 4, (0, 2, 4, 6))})
    with pytest.raises(ValueError, match="holds the axes"):
        ProcessMesh(dims, {k: v for k, v in axes.items() if k != "loss"})
    with pytest.raises(ValueError, match="dividing cp_size=2"):
        ContextParallelState(mesh, AttentionSettings(pattern="hybrid", ulysses_size=4))
    assert ProcessMesh.single().size("cp") == 1
