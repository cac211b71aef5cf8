"""The live worlds of tests/worlds.py: reused across cases, each case starting from a fresh
process's state, a broken world replaced, and a failing, dying or hanging rank named."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from worlds import World, WorldCaseError, world_of

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)


def run_world(size: int, fn) -> list:
    """The live world's run, as tests/distributed.py's (which also honours HF_RING_FRESH_WORLDS)."""
    return world_of(size).run(fn, ())


def _pid_and_sum(rank: int, world: int) -> tuple:
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    return os.getpid(), int(total)


def _draws_and_leaks(rank: int, world: int) -> dict:
    import hf_ring
    seen = {"env": os.environ.get("HF_RING_WORLDS_PROBE"), "active": hf_ring.get_context_parallel_state(),
            "threads": torch.get_num_threads(), "dtype": torch.get_default_dtype(),
            "draw": torch.rand(3)}
    os.environ["HF_RING_WORLDS_PROBE"] = "leaked"
    hf_ring.setup_context_parallel(world)
    torch.set_num_threads(2)
    torch.set_default_dtype(torch.float64)
    return seen


def _raise_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    dist.barrier()  # rank 0 waits for a peer that never comes: it must not hang the test


def _die_on_one(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _hang_on_one(rank: int, world: int) -> None:
    if rank == 0:
        time.sleep(60)


def _destroy(rank: int, world: int) -> int:
    dist.destroy_process_group()
    return rank


def test_world_is_reused_and_results_come_in_rank_order():
    first = run_world(2, _pid_and_sum)
    second = run_world(2, _pid_and_sum)
    assert [s for _, s in first] == [3, 3]
    assert [p for p, _ in first] == [p for p, _ in second]  # the same processes
    assert first[0][0] != first[1][0]


def test_every_case_starts_from_a_fresh_process_state():
    first = run_world(2, _draws_and_leaks)
    second = run_world(2, _draws_and_leaks)
    for seen in second:
        assert seen["env"] is None and seen["active"] is None
        assert seen["threads"] == 1 and seen["dtype"] == torch.float32
    # Bit-exact: the generator was put back to where it stood when the rank started (torch
    # seeds a new process at random, so that is the one state to compare with).
    assert all(torch.equal(a["draw"], b["draw"]) for a, b in zip(first, second))


def _seeds_and_variable(rank: int, world: int) -> tuple:
    import numpy as np

    return torch.initial_seed(), int(np.random.randint(2**31)), os.environ.get("HF_RING_TEST_WORLD_VARIABLE")


def test_ranks_draw_their_own_seeds_and_take_the_environment_of_their_world(monkeypatch):
    """Forks of one server: each rank still seeds torch and NumPy as a new process does, and a
    world made after the environment changed sees the change (the server started before it)."""
    seeds = run_world(2, _seeds_and_variable)
    assert seeds[0][0] != seeds[1][0] and seeds[0][1] != seeds[1][1], seeds
    monkeypatch.setenv("HF_RING_TEST_WORLD_VARIABLE", "set")
    with World(3) as world:
        found = world.run(_seeds_and_variable, ())
    assert [v for _, _, v in found] == ["set"] * 3
    assert len({s for s, _, _ in found + seeds}) == 5


def test_a_failing_rank_is_named_and_the_world_replaced():
    before = {p for p, _ in run_world(2, _pid_and_sum)}
    with pytest.raises(WorldCaseError, match=r"(?s)rank 1 raised.*planted failure on rank 1"):
        run_world(2, _raise_on_one)
    after = run_world(2, _pid_and_sum)
    assert [s for _, s in after] == [3, 3]
    assert before.isdisjoint(p for p, _ in after)


def test_a_dying_rank_is_named():
    with pytest.raises(WorldCaseError, match=r"rank 1 died \(exit code 3\)"):
        run_world(2, _die_on_one)
    assert [s for _, s in run_world(2, _pid_and_sum)] == [3, 3]


def test_a_hanging_rank_is_named_at_the_case_timeout():
    with World(2) as world:
        start = time.monotonic()
        with pytest.raises(WorldCaseError, match=r"rank 0 did not answer within 2 s"):
            world.run(_hang_on_one, (), timeout_s=2.0)
        assert time.monotonic() - start < 30  # killed, not waited for
        assert world.broken is not None


def test_a_destroyed_default_group_gets_a_new_world():
    before = {p for p, _ in run_world(2, _pid_and_sum)}
    assert run_world(2, _destroy) == [0, 1]
    after = run_world(2, _pid_and_sum)
    assert [s for _, s in after] == [3, 3]
    assert before.isdisjoint(p for p, _ in after)
