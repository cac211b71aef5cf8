"""The ring's transport: each rank sends a buffer onward and receives the previous rank's.

The ring algorithm (ring_attention.py) talks to a *transport*: a factory that opens one
:class:`Exchange` per channel (``"kv"`` for the K/V blocks, ``"dkv"`` for their gradient
accumulators in the backward). An exchange moves one buffer per step, asynchronously,
so the caller computes on the current buffer while the next one is in flight.

- :func:`process_group_transport`: the real one, point-to-point over a process group. On
  CUDA, NCCL runs point-to-point transfers on its own internal stream; ``wait()`` makes
  the compute stream wait for them, so the transfer overlaps with the kernels queued
  before.
- :class:`VirtualRing`: every rank of a ring simulated one after another in one process
  (benchmarks): the K/V channel delivers the shard the real ring would deliver at that
  step, so the forward and dq are exact; the gradient channel, whose contents depend on
  ranks not yet run, loops the sent buffer back (same bytes moved, other values).

Time spent blocked in ``wait`` (the part of the transfers that compute did not hide)
goes to an optional :class:`CommWaitStats` sink that the caller passes; nothing is
recorded in module state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from hf_ring.distributed.nccl_failures import is_nccl, watch_all

KV_CHANNEL = "kv"
DKV_CHANNEL = "dkv"


@dataclass
class CommWaitStats:
    """Seconds spent blocked in ``Exchange.wait`` (the ring) or in a collective's wait (the
    other patterns: only the wait, so a gather that travelled while other work ran counts
    what was left of it), and how many waits there were.

    On CUDA ``wait`` returns once the wait is queued on the stream, so this measures
    host-side blocking only; synchronise around it for device time.
    """

    seconds: float = 0.0
    waits: int = 0


class Exchange(Protocol):
    """One channel of the ring: ``start`` sends ``send`` onward and receives into ``recv``;
    ``wait`` returns when both are done. One transfer in flight at a time."""

    def start(self, send: torch.Tensor, recv: torch.Tensor) -> None: ...

    def wait(self) -> None: ...


# channel name -> a fresh Exchange for one ring pass
Transport = Callable[[str], Exchange]


class _Timed:
    """Adds the seconds of each ``wait`` to a stats sink."""

    def __init__(self, stats: Optional[CommWaitStats]) -> None:
        self._stats = stats

    def _record(self, start: float) -> None:
        if self._stats is not None:
            self._stats.seconds += time.perf_counter() - start
            self._stats.waits += 1


def peer_failed(error: BaseException) -> bool:
    """Whether a collective or transfer failed because a peer never took part: gloo says
    "Timed out ..." when it never came, "Connection closed / reset by peer" when it left
    (its process ended or destroyed the group) first."""
    text = str(error).lower()
    return any(s in text for s in ("timed out", "timeout", "connection closed", "connection reset"))


class RingExchange(_Timed):
    """Sends to the next rank of ``group`` and receives from the previous one."""

    def __init__(self, group: Optional[dist.ProcessGroup], stats: Optional[CommWaitStats] = None) -> None:
        super().__init__(stats)
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        self.next_global = to_global((rank + 1) % size)
        self.prev_global = to_global((rank - 1) % size)
        self._reqs: list = []
        # On NCCL a stalled transfer never fails in wait(): its failure is reported by name
        # from the watchdog (nccl_failures.py).
        self._nccl = is_nccl(group)

    def start(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        if self._reqs:
            raise RuntimeError("RingExchange.start called while a transfer is still in flight")
        ops = [
            dist.P2POp(dist.isend, send, self.next_global, self.group),
            dist.P2POp(dist.irecv, recv, self.prev_global, self.group),
        ]
        self._reqs = dist.batch_isend_irecv(ops)
        if self._nccl:
            watch_all(self._reqs, self.group, "a ring transfer")

    def wait(self) -> None:
        start = time.perf_counter()
        try:
            for req in self._reqs:
                req.wait()
        except RuntimeError as e:
            if not peer_failed(e):
                raise
            raise RuntimeError(
                "a ring transfer between the ranks of a context-parallel group did not complete: the "
                "neighbouring rank did not run the same ring call (a rank that skipped a backward, ran "
                "an extra forward alone, or stopped). Every rank of a CP group must run every forward "
                f"and backward of the model together, in the same order. ({e})"
            ) from e
        finally:
            self._reqs = []
        self._record(start)


def process_group_transport(
    group: Optional[dist.ProcessGroup], stats: Optional[CommWaitStats] = None
) -> Transport:
    """The real ring over ``group`` (None: the default group); every channel is P2P."""
    return lambda channel: RingExchange(group, stats)


class _VirtualExchange(_Timed):
    def __init__(self, deliver: Callable[[torch.Tensor, torch.Tensor, int], None], stats) -> None:
        super().__init__(stats)
        self._deliver = deliver
        self._step = 0

    def start(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        self._deliver(send, recv, self._step)
        self._step += 1

    def wait(self) -> None:
        self._record(time.perf_counter())


class VirtualRing:
    """The transport of rank ``rank`` in a ring of ``len(kv_by_rank)`` ranks run in one
    process, rank after rank.

    Args:
        rank: the simulated rank.
        kv_by_rank: every rank's K/V buffer as the ring stacks it, ``(2, batch, local_seq,
            n_kv_heads, head_dim)``, in rank order.
        stats: optional wait-time sink.
    """

    def __init__(self, rank: int, kv_by_rank: Sequence[torch.Tensor], stats: Optional[CommWaitStats] = None):
        self.rank, self.kv_by_rank, self.stats = rank, kv_by_rank, stats

    def __call__(self, channel: str) -> Exchange:
        world = len(self.kv_by_rank)
        if channel == KV_CHANNEL:
            # The ring's i-th transfer brings the K/V of rank (rank - i - 1).
            def deliver(send, recv, i):
                recv.copy_(self.kv_by_rank[(self.rank - i - 1) % world])
        else:
            def deliver(send, recv, i):
                recv.copy_(send)
        return _VirtualExchange(deliver, self.stats)


class BlockStream:
    """The K/V blocks a rank holds, step after step: its own first, then each one received.

    Its own block is never written to (so the forward can save it for the backward, and
    the backward can run twice); received blocks alternate between two buffers (one when
    the ring has two ranks): the one computed on and sent, and the one received into.
    """

    def __init__(self, own: torch.Tensor, world: int) -> None:
        self.current = own
        self._recv = [torch.empty_like(own) for _ in range(min(2, world - 1))]
        self._step = 0
        self._next: Optional[torch.Tensor] = None

    def start(self, exchange: Exchange) -> None:
        """Send the block held now onward; receive the next one."""
        self._next = self._recv[self._step % len(self._recv)]
        exchange.start(self.current, self._next)

    def advance(self, exchange: Exchange) -> None:
        """Wait for the next block and hold it."""
        exchange.wait()
        self.current, self._next = self._next, None
        self._step += 1


class DoubleBuffer:
    """Two equally shaped buffers: ``current`` (computed on, sent) and ``incoming``."""

    def __init__(self, first: torch.Tensor) -> None:
        self._bufs = [first, torch.empty_like(first)]
        self._i = 0

    @property
    def current(self) -> torch.Tensor:
        return self._bufs[self._i]

    @property
    def incoming(self) -> torch.Tensor:
        return self._bufs[1 - self._i]

    def swap(self) -> None:
        self._i = 1 - self._i
