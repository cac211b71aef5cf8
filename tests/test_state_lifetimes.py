"""State that outlives a call: it must follow what the user asked for last, and stay bounded.

- ``setup_context_parallel`` called again with another ``timeout`` builds groups that wait
  that long (it used to hand back the groups built with the first timeout);
- Ulysses keeps its token orders (index tensors on the attention's device) for a bounded
  number of shapes (it kept one pair per sequence length forever), and stays exact for a
  length whose orders were dropped and built again;

All distributed parts run in one spawned gloo world of 2 (module fixture), each part
returning what the tests below check.
"""

from __future__ import annotations

import gc
import time
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import hf_ring
from distributed import run_world
from hf_ring.patterns.ulysses import orders
from hf_ring.sharding.layouts import shard_indices
from test_cp_patterns import _attend, _check

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


# More lengths than the Ulysses cache holds (16 shapes), then the first two again (dropped by then).
ULYSSES_CASES = [{"pattern": "ulysses", "layout": "zigzag", "seq": 4 * n} for n in (*range(1, 21), 1, 2)]


def _lifetimes(rank: int, world: int) -> dict:
    return {"timeout": _setup_again_with_new_timeout(rank),
            "ulysses": [_attend(rank, world, case) for case in ULYSSES_CASES]}


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


def test_ulysses_is_exact_for_lengths_whose_orders_were_dropped(world_results):
    for i, case in enumerate(ULYSSES_CASES):
        _check(case, [r["ulysses"][i] for r in world_results])


def test_ulysses_keeps_orders_for_a_bounded_number_of_shapes():
    """300 sequence lengths through the orders of pure Ulysses over 2 zigzag ranks (the
    group's tokens taken in global order): each exact, at most 16 pairs kept alive by the
    cache, and a repeated shape served from it (no copy to the device per call)."""
    cpu = torch.device("cpu")
    kept = []
    for n in range(1, 301):
        seq = 4 * n
        perm, inverse = orders(seq, 2, (0, 1), "zigzag", (1, 0, "contiguous"), cpu)
        held = torch.cat([shard_indices(seq, 2, r, "zigzag") for r in (0, 1)])
        assert torch.equal(held[perm], torch.arange(seq)) and torch.equal(perm[inverse], torch.arange(seq)), seq
        kept += [weakref.ref(perm), weakref.ref(inverse)]
    del perm, inverse
    gc.collect()
    alive = sum(ref() is not None for ref in kept)
    assert alive <= 2 * 16, f"{alive // 2} of 300 shapes' orders still alive"
    again = orders(4 * 300, 2, (0, 1), "zigzag", (1, 0, "contiguous"), cpu)
    assert all(a is ref() for a, ref in zip(again, kept[-2:]))
