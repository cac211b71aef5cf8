"""State that outlives a call: it must follow what the user asked for last, and stay bounded.

- ``setup_context_parallel`` called again with another ``timeout`` builds groups that wait
  that long (it used to hand back the groups built with the first timeout);

All distributed parts run in one spawned gloo world of 2 (module fixture), each part
returning what the tests below check.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import hf_ring
from distributed import run_world

FIRST_TIMEOUT = timedelta(seconds=30)
# Short enough that a collective no peer joins fails well within the test, long enough
# that gloo does not fail it on a busy 2-core machine before the peer would have joined.
NEW_TIMEOUT = timedelta(seconds=2)


def _setup_again_with_new_timeout(rank: int) -> dict:
    first = hf_ring.setup_context_parallel(2, timeout=FIRST_TIMEOUT)
    kept = hf_ring.setup_context_parallel(2)
    second = hf_ring.setup_context_parallel(2, timeout=NEW_TIMEOUT)
    rebuilt = second.cp_group is not first.cp_group
    waited = None
    # Only new groups are probed: the old ones would make rank 0 wait the first timeout.
    if rebuilt:
        if rank == 0:  # rank 1 never joins: the all-reduce must fail after NEW_TIMEOUT
            start = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1), group=second.cp_group)
            except RuntimeError:
                waited = time.monotonic() - start
        dist.barrier()
    active = hf_ring.get_context_parallel_state() is second
    hf_ring.set_context_parallel_state(None)
    return {"kept": kept is first, "timeout": second.timeout, "rebuilt": rebuilt, "active": active,
            "waited": waited}


def _lifetimes(rank: int, world: int) -> dict:
    return {"timeout": _setup_again_with_new_timeout(rank)}


@pytest.fixture(scope="module")
def world_results():
    return run_world(2, _lifetimes)


def test_setup_again_with_another_timeout_builds_groups_with_it(world_results):
    for rank, result in enumerate(world_results):
        r = result["timeout"]
        # Called again without a timeout: the groups (and their timeout) are reused.
        assert r["kept"], r
        assert (r["timeout"], r["rebuilt"], r["active"]) == (NEW_TIMEOUT, True, True), r
    waited = world_results[0]["timeout"]["waited"]
    assert waited is not None and waited < 10 * NEW_TIMEOUT.total_seconds(), waited
