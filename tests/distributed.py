"""Run a function on every rank of a real gloo world, each rank a process of its own, from pytest.

A call goes to a world of its size that lives across cases (tests/worlds.py): its ranks
were started once (forks of a server that imported torch, transformers and hf_ring), so a
case does not pay 3-5 s per process to import them again. Every case starts from the state a fresh rank has; a case that breaks
its world gets a new one; ``HF_RING_FRESH_WORLDS=1`` gives every call a world of its own,
to rule reuse out while chasing a failure. An exception on any rank fails the test with
that rank's traceback; a rank that hangs is named after ``HF_RING_CASE_TIMEOUT`` seconds.
"""

from __future__ import annotations

import socket
from typing import Any, Callable

from worlds import run_in_world


def free_port() -> int:
    """A TCP port free on this machine now, for a launcher's or Accelerate's rendezvous
    (a fixed port collides with another run on the same machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, fn: Callable, *args: Any) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result.

    ``fn`` must be a module-level function and ``args`` picklable (they travel to the
    spawned ranks).
    """
    return run_in_world(world, fn, args)
