"""``hf_ring.distributed.rows``: whole rows from every CP rank's shard, and their gradient.

On a gloo world of 4: the CP groups {0, 1} and {2, 3} (cp 2, group ranks that differ from
global ones) and the whole world (cp 4), for every layout and for a packed row. The forward
must give every rank the full row, and the backward must give each rank the group's summed
gradient of its own shard, by one reduce-scatter and no all-reduce (an all-reduce of the
whole row would move twice the bytes).

The loss on group rank r is ``(rows * weight_r).sum()``, so the gradient of the rows there is
``weight_r`` and rank r's shard must receive the shard of ``sum_r weight_r``. The weights are
small integers, so that sum is exact in float32 in any order the collective adds it: every
check is ``torch.equal`` (the forward only moves values; nothing is rounded).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from collective_counter import COLLECTIVES, count_calls
from distributed import run_world

# (cp size, the global ranks of each group of that size)
GROUPS = {2: [[0, 1], [2, 3]], 4: [[0, 1, 2, 3]]}
LAYOUTS = ("zigzag", "contiguous", "stripe")
BATCH, FEATURES = 2, 3


def _row(cp: int) -> torch.Tensor:
    """The full rows every rank of a cp group starts from: float32 ``(BATCH, 8 * cp, FEATURES)``."""
    return torch.randn(BATCH, 8 * cp, FEATURES, generator=torch.Generator().manual_seed(cp))


def _cu_seqlens(cp: int) -> torch.Tensor:
    """A packed row's documents, each a multiple of 2 * cp long: int32 ``(4,)``."""
    return torch.tensor([0, 2 * cp, 6 * cp, 8 * cp], dtype=torch.int32)


def _weight(shape: torch.Size, group_rank: int) -> torch.Tensor:
    return ((torch.arange(shape.numel()) % 5 + 1) * (group_rank + 1)).reshape(shape).float()


def _case(local: torch.Tensor, group, cp: int, layout: str, cu: torch.Tensor | None, g_rank: int) -> dict:
    from hf_ring.distributed import collectives
    from hf_ring.distributed.rows import gather_rows

    local = local.clone().requires_grad_()
    rows = gather_rows(local, group, cp, layout, cu)
    loss = (rows * _weight(rows.shape, g_rank)).sum()
    seen = []
    saved = collectives.GroupCollectives.reduce_scatter, collectives.GroupCollectives.all_gather

    def reduce_scatter(self, x):
        seen.append(("reduce_scatter", tuple(x.shape)))
        return saved[0](self, x)

    def all_gather(self, x):
        seen.append(("all_gather", tuple(x.shape)))
        return saved[1](self, x)

    collectives.GroupCollectives.reduce_scatter, collectives.GroupCollectives.all_gather = reduce_scatter, all_gather
    try:
        with count_calls() as counts:
            loss.backward()
    finally:
        collectives.GroupCollectives.reduce_scatter, collectives.GroupCollectives.all_gather = saved
    dist_level = {name: counts[name] for name in COLLECTIVES if counts[name]}
    return {"rows": rows.detach(), "grad": local.grad, "collectives": seen, "dist": dist_level,
            "mask": gather_rows(local.detach() > 0, group, cp, layout, cu)}


def _world(rank: int, world: int) -> dict:
    from hf_ring.distributed.rows import concat_over_group
    from hf_ring.sharding import shard_packed, shard_sequence

    out = {}
    for cp, members_of in GROUPS.items():
        groups = [dist.new_group(m) for m in members_of]  # every rank creates every group
        index = next(i for i, m in enumerate(members_of) if rank in m)
        group, g_rank = groups[index], members_of[index].index(rank)
        full = _row(cp)
        for layout in LAYOUTS:
            local = shard_sequence(full, cp, g_rank, dim=1, layout=layout)
            out[(cp, index, layout)] = _case(local, group, cp, layout, None, g_rank)
        cu = _cu_seqlens(cp)
        packed = full[:1, :, 0]  # a packed row: (1, seq), as the fused head's fields are
        out[(cp, index, "packed")] = _case(shard_packed(packed, cu, cp, g_rank, dim=1), group, cp, "zigzag", cu,
                                           g_rank)
        mine = torch.full((2, 3), float(g_rank))
        out[(cp, index, "concat")] = (concat_over_group(mine, group, cp), concat_over_group(mine > 0, group, cp))
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_world(4, _world)


@pytest.mark.parametrize("cp, index", [(cp, i) for cp, m in GROUPS.items() for i in range(len(m))])
@pytest.mark.parametrize("layout", [*LAYOUTS, "packed"])
def test_rows_are_whole_and_each_shard_gets_the_groups_summed_gradient(ranks, cp, index, layout):
    from hf_ring.sharding import shard_packed, shard_sequence

    full = _row(cp)
    cu = None
    if layout == "packed":
        full, cu = full[:1, :, 0], _cu_seqlens(cp)
    summed = sum(_weight(full.shape, g) for g in range(cp))
    for g_rank, rank in enumerate(GROUPS[cp][index]):
        got = ranks[rank][(cp, index, layout)]
        assert torch.equal(got["rows"], full), (rank, layout)
        assert torch.equal(got["mask"], full > 0), (rank, layout)
        mine = (shard_packed(summed, cu, cp, g_rank, dim=1) if cu is not None
                else shard_sequence(summed, cp, g_rank, dim=1, layout=layout))
        assert torch.equal(got["grad"], mine), (rank, layout)
        # One reduce-scatter of every rank's shard, (cp, *local.shape): (cp - 1) / cp of a row's bytes.
        assert got["collectives"] == [("reduce_scatter", (cp, *mine.shape))], got["collectives"]
        assert got["dist"] == {}, f"the backward issued {got['dist']} besides the reduce-scatter"


@pytest.mark.parametrize("cp, index", [(cp, i) for cp, m in GROUPS.items() for i in range(len(m))])
def test_concat_over_group_is_every_ranks_tensor_in_rank_order(ranks, cp, index):
    expected = torch.arange(cp, dtype=torch.float32).repeat_interleave(2)[:, None].expand(2 * cp, 3)
    for rank in GROUPS[cp][index]:
        values, flags = ranks[rank][(cp, index, "concat")]
        assert torch.equal(values, expected) and torch.equal(flags, expected > 0), rank


def _gather_alone(rank: int, world: int) -> str:
    """Rank 0 gathers over a group of both ranks whose other rank never comes (2 s timeout)."""
    from datetime import timedelta

    from hf_ring.distributed.rows import concat_over_group
    from hf_ring.training.eval_loss import _DP_GROUP

    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    message = "not called"
    if rank == 0:
        try:
            concat_over_group(torch.ones(1), group, 2, _DP_GROUP)
        except RuntimeError as e:
            message = str(e)
    dist.barrier()
    return message


def test_a_gather_whose_peer_never_comes_names_its_group():
    """The evaluation's gather over the data-parallel ranks names that group and what its
    ranks must all run, not the CP group's attention."""
    message = run_world(2, _gather_alone)[0]
    assert message.startswith("a collective of the data-parallel group did not complete"), message
    assert "the same evaluation step" in message and "attention" not in message.split("(")[0], message
