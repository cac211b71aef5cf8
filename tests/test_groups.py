"""The dp x cp groups: ``setup_context_parallel`` reuses its state only over the same
default process group, and validates its arguments.

After ``destroy_process_group`` and a new ``init_process_group`` the old groups are dead;
a state built over them must not be handed out again (it did before: the stale groups
then failed or hung at the first collective). Checked on a gloo world of 2: the second
state holds new groups, and a collective over its CP group works.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import hf_ring
from distributed import run_world

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)


def _reinit(rank: int, world: int, init_file: str) -> dict:
    first = hf_ring.setup_context_parallel(world)
    same = hf_ring.setup_context_parallel(world)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    second = hf_ring.setup_context_parallel(world)
    total = torch.tensor([rank + 1])
    dist.all_reduce(total, group=second.cp_group)
    return {"reused": same is first, "rebuilt": second.cp_group is not first.cp_group, "sum": int(total)}


def test_setup_after_reinitialised_default_group_builds_new_groups():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_world(2, _reinit, os.path.join(tmp, "second_rendezvous"))
    for r in results:
        assert r == {"reused": True, "rebuilt": True, "sum": 3}, r


@pytest.mark.parametrize("kwargs, match", [
    ({"cp_size": 0}, "cp_size must be a positive int"),
    ({"cp_size": 1, "timeout": timedelta(0)}, "timeout must be a positive datetime.timedelta"),
    ({"cp_size": 1, "layout": "ring"}, "unknown context-parallel layout"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hf_ring.setup_context_parallel(**kwargs)
