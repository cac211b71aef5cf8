"""Run a function on every rank of a real gloo world, in spawned processes, from pytest.

The ranks live across cases (tests/worlds.py): the first call for a world size spawns
them, later calls reuse them, and a case that breaks its world is followed by a new one.
An exception on any rank fails the test with that rank's traceback; ranks that die or
hang past ``HF_RING_CASE_TIMEOUT`` seconds fail it too, named.
"""

from __future__ import annotations

from typing import Any, Callable

from worlds import run_in_world


def run_world(world: int, fn: Callable, *args: Any) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result.

    ``fn`` must be a module-level function (it is pickled into the spawned processes). It
    starts from a fresh process's state (generators, environment, no context-parallel state
    active, one thread); the default process group is the world's.
    """
    return run_in_world(world, fn, args)
