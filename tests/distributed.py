"""Run a function on every rank of a real gloo world, in spawned processes, from pytest.

The rendezvous is a file in a temporary folder (no ports to collide). An exception on any
rank fails the test with that rank's traceback; ranks that time out fail it too.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(_entry, args=(world, init_file, fn, args, tmp), nprocs=world, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
