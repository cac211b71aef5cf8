"""Run a function on every rank of a real gloo world, in spawned processes, from pytest.

By default every call spawns a fresh world (``mp.spawn``; the rendezvous is a file in a
temporary folder, no ports to collide). With ``HF_RING_LIVE_WORLDS=1`` the call goes to a
world that lives across cases instead (tests/worlds.py), which saves the 3-5 s per process
of importing torch and transformers again; it is not the default yet: over the whole suite
a world of 4 hung in two cases and a kernel registered by one case leaked into the next
(docs/testing.md). An exception on any rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LIVE_WORLDS = os.environ.get("HF_RING_LIVE_WORLDS", "0") == "1"


def _entry(rank: int, world: int, init_file: str, fn: Callable, args: tuple, result_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_world(world: int, fn: Callable, *args: Any) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result.

    ``fn`` must be a module-level function (it is pickled into the spawned processes).
    """
    if LIVE_WORLDS:
        from worlds import run_in_world

        return run_in_world(world, fn, args)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(_entry, args=(world, init_file, fn, args, tmp), nprocs=world, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
