"""Gloo worlds that live across test cases: a world's ranks are started once and run many
cases, instead of paying 3-5 s per process to import torch and transformers for every call.
A rank is a fork of multiprocessing's fork server, which imported torch, transformers and
hf_ring once (:data:`PRELOAD`), so a new world (the first of its size, or one after a
case broke the last) starts in well under a second, not in a fresh interpreter's 5 s. A rank
takes the environment of its world's creation and draws its own seeds, as a new process
would; the string hash seed alone is the fork server's on every rank.

``tests/distributed.py``'s :func:`run_world` hands each case to the live world of its size
(:func:`world_of`); tests/test_worlds.py checks this module itself. Isolation is kept
where it matters:

- every case starts from the state a fresh process has: the random generators (torch,
  Python, NumPy) as they were when the rank started, no context-parallel state active, one
  thread, float32 default dtype, grad mode on, the environment as it was, Accelerate's
  shared states reset;
- a case that breaks its world is followed by a new one: an exception on any rank (its
  peers may be waiting in a collective), a rank that died, a default process group that
  was destroyed or replaced;
- a case that takes longer than ``HF_RING_CASE_TIMEOUT`` seconds (900 by default) fails
  with the ranks that did not answer, and the world is killed;
- ``HF_RING_FRESH_WORLDS=1`` gives every case a world of its own (closed after it), of new
  interpreters (spawned, not forked), to rule reuse and the fork server out while chasing a
  failure.

A case that leaves attention backends registered fails (the next case would find them).

Results and tasks travel as ``torch.save`` bytes, so a case's function must be a
module-level function and its arguments and result picklable, as with ``mp.spawn``.
This module must not import hf_ring at the top: the parent pytest process would then load
it before a case's module wants to patch anything (the fork server, a process of its own,
does).
"""

from __future__ import annotations

import atexit
import io
import os
import queue
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CASE_TIMEOUT_S = float(os.environ.get("HF_RING_CASE_TIMEOUT", "900"))
FRESH_WORLDS = os.environ.get("HF_RING_FRESH_WORLDS", "0") == "1"
# Live worlds per pytest process, the least recently used closed first: each rank holds a
# few hundred MB once transformers is in.
MAX_LIVE_WORLDS = int(os.environ.get("HF_RING_MAX_LIVE_WORLDS", "2"))
# What the fork server imports before it forks a rank. None of these reads a run's
# variables at import; a case that sets the environment does so on its ranks.
PRELOAD = ["torch", "torch.distributed", "numpy", "transformers", "transformers.modeling_utils", "hf_ring"]
# After one rank fails, how long its peers get to report their own failure (they are often
# stuck in the collective the failed rank never joined).
PEER_GRACE_S = 3.0


class WorldCaseError(RuntimeError):
    """A case failed on one or more ranks; the message holds every failed rank's traceback."""


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


class _FreshState:
    """What a fresh rank process looks like, to put back before every case."""

    def __init__(self) -> None:
        self.torch_rng = torch.get_rng_state()
        self.python_rng = random.getstate()
        try:
            import numpy as np
            self.numpy_rng = np.random.get_state()
        except ImportError:
            self.numpy_rng = None
        self.environ = dict(os.environ)
        self.default_group = dist.distributed_c10d._get_default_group()

    def restore(self) -> None:
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        if self.numpy_rng is not None:
            import numpy as np
            np.random.set_state(self.numpy_rng)
        os.environ.clear()
        os.environ.update(self.environ)
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        state_module = sys.modules.get("hf_ring.patterns.state")
        if state_module is not None:
            state_module.set_context_parallel_state(None)
        # Accelerate's shared states outlive a case: one whose TrainingArguments asked for
        # torch_compile left a dynamo plugin that compiled the next case's prepared model.
        accelerate_state = sys.modules.get("accelerate.state")
        if accelerate_state is not None:
            accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
            accelerate_state.GradientState._reset_state()

    @staticmethod
    def registered_backends() -> Optional[tuple[str, ...]]:
        registry = sys.modules.get("hf_ring.kernels.registry")
        return None if registry is None else tuple(registry.registered_backends())

    def broken(self) -> Optional[str]:
        """Why this process must not run another case, or None."""
        if not dist.is_initialized():
            return "the default process group was destroyed"
        if dist.distributed_c10d._get_default_group() is not self.default_group:
            return "the default process group was replaced"
        return None


def _serve(rank: int, size: int, init_file: str, tasks: "mp.Queue", results: "mp.Queue",
           environ: dict[str, str]) -> None:
    """A rank's loop: run each case handed to it until told to stop or until a case breaks it."""
    os.environ.clear()
    os.environ.update(environ)
    # Every rank draws its own seeds, as a new interpreter does (a fork would keep the server's
    # torch and NumPy generators on every rank; Python's random reseeds itself after a fork).
    torch.seed()
    try:
        import numpy as np
        np.random.seed()
    except ImportError:
        pass
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    fresh = _FreshState()
    while True:
        task = tasks.get()
        if task is None:
            break
        case, payload = task
        fresh.restore()
        backends = fresh.registered_backends()
        try:
            fn, args = _loads(payload)
            status, body = "ok", _dumps(fn(rank, size, *args))
            if backends is not None and fresh.registered_backends() != backends:
                raise RuntimeError(f"the case left the attention backends {fresh.registered_backends()} "
                                   f"registered (were {backends}); the next case would find them")
        except BaseException:  # a case's failure is reported, whatever it is
            status, body = "error", traceback.format_exc().encode()
        broken = "the case raised" if status == "error" else fresh.broken()
        fresh.restore()
        results.put((case, rank, status, body, broken))
        if broken is not None:
            break
    if dist.is_initialized():
        dist.destroy_process_group()


class World:
    """``size`` gloo ranks (forks of the fork server) that run cases handed to them, one at a time."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cases = 0
        self.broken: Optional[str] = None
        self._dir = tempfile.mkdtemp(prefix=f"hf_ring_world{size}_")
        if FRESH_WORLDS:  # new interpreters: nothing shared with a server, the hash seed included
            ctx = mp.get_context("spawn")
        else:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
        self._tasks = [ctx.Queue() for _ in range(size)]
        self._results = ctx.Queue()
        init_file = os.path.join(self._dir, "rendezvous")
        # The environment of the world's creation, as a spawned rank would inherit it (the fork
        # server holds its own start's).
        environ = dict(os.environ)
        self._procs = [ctx.Process(target=_serve, args=(r, size, init_file, self._tasks[r], self._results, environ),
                                   daemon=True, name=f"world{size}-rank{r}")
                       for r in range(size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, args: tuple, timeout_s: float = CASE_TIMEOUT_S) -> list[Any]:
        """Run ``fn(rank, size, *args)`` on every rank; each rank's result, in rank order.

        Raises WorldCaseError with every failed rank's traceback, naming ranks that died or
        did not answer within ``timeout_s``.
        """
        if self.broken is not None:
            raise RuntimeError(f"world of {self.size} is broken ({self.broken}); make a new one")
        self.cases += 1
        payload = _dumps((fn, args))
        for q in self._tasks:
            q.put((self.cases, payload))
        answers: dict[int, tuple[str, bytes, Optional[str]]] = {}
        deadline = time.monotonic() + timeout_s
        failed_at: Optional[float] = None
        while len(answers) < self.size:
            now = time.monotonic()
            if now > deadline or (failed_at is not None and now > failed_at + PEER_GRACE_S):
                break
            try:
                case, rank, status, body, broken = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in answers]
                if dead and failed_at is None:
                    failed_at = time.monotonic()
                continue
            if case != self.cases:
                continue  # a late answer to a case that already failed
            answers[rank] = (status, body, broken)
            if status != "ok" and failed_at is None:
                failed_at = time.monotonic()
            if broken is not None:
                self.broken = broken
        if len(answers) == self.size and all(a[0] == "ok" for a in answers.values()):
            if self.broken is not None:
                self.close()
            return [_loads(answers[r][1]) for r in range(self.size)]
        self.broken = self.broken or "a case failed"
        message = self._failure(fn, answers, timed_out=time.monotonic() > deadline, timeout_s=timeout_s)
        self.close()
        raise WorldCaseError(message)

    def _failure(self, fn: Callable, answers: dict, timed_out: bool, timeout_s: float) -> str:
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        lines = [f"{name} failed on a gloo world of {self.size}:"]
        for r, p in enumerate(self._procs):
            if r in answers:
                status, body, _ = answers[r]
                if status != "ok":
                    lines.append(f"--- rank {r} raised:\n{body.decode()}")
            elif not p.is_alive():
                lines.append(f"--- rank {r} died (exit code {p.exitcode}) without answering")
            elif timed_out:
                lines.append(f"--- rank {r} did not answer within {timeout_s:.0f} s (HF_RING_CASE_TIMEOUT): hung")
            else:
                lines.append(f"--- rank {r} had not answered when a peer failed (likely waiting on it)")
        return "\n".join(lines)

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.broken == "closed":
            return
        for q in self._tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
        for q in (*self._tasks, self._results):
            q.cancel_join_thread()
            q.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        self.broken = self.broken or "closed"


_LIVE: "OrderedDict[int, World]" = OrderedDict()


def world_of(size: int) -> World:
    """The live world of ``size`` ranks (made now if there is none or it broke)."""
    world = _LIVE.pop(size, None)
    if world is None or world.broken is not None:
        world = World(size)
    _LIVE[size] = world
    while len(_LIVE) > MAX_LIVE_WORLDS:
        _LIVE.popitem(last=False)[1].close()
    return world


def close_all() -> None:
    while _LIVE:
        _LIVE.popitem()[1].close()


def run_in_world(size: int, fn: Callable, args: tuple) -> list[Any]:
    if FRESH_WORLDS:
        world = World(size)
        try:
            return world.run(fn, args)
        finally:
            world.close()
    return world_of(size).run(fn, args)


atexit.register(close_all)
