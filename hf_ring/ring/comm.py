"""Point-to-point ring exchange with double buffering.

Every rank sends a buffer to ``rank + 1`` and receives one from ``rank - 1`` of its group,
asynchronously, so the caller computes on the current buffer while the next one is in
flight. Two buffers alternate: the one being computed on (and sent) and the one being
received into, so no step allocates.

On CUDA, NCCL runs point-to-point transfers on its own internal stream; ``wait()`` makes
the compute stream wait for them, so the transfer overlaps with the kernels queued before.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist


@dataclass
class CommWaitStats:
    """Seconds spent blocked in ``RingExchange.wait`` (the part of the transfers that
    compute did not hide), and how many waits there were."""

    seconds: float = 0.0
    waits: int = 0


_STATS: Optional[CommWaitStats] = None


@contextlib.contextmanager
def record_comm_wait() -> Iterator[CommWaitStats]:
    """Measure the time ring transfers keep compute waiting, inside the ``with`` block.

    On CUDA the wait returns once the wait is queued, so this measures host-side blocking
    only; synchronise around it (the benchmarks do) for device time.
    """
    global _STATS
    previous, _STATS = _STATS, CommWaitStats()
    try:
        yield _STATS
    finally:
        _STATS = previous


class RingExchange:
    """Sends to the next rank of ``group`` and receives from the previous one."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next_global = dist.get_global_rank(group, (self.rank + 1) % self.size) if group is not None else (self.rank + 1) % self.size
        self.prev_global = dist.get_global_rank(group, (self.rank - 1) % self.size) if group is not None else (self.rank - 1) % self.size
        self._reqs: list = []

    def start(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Begin sending ``send`` onward and receiving the previous rank's into ``recv``."""
        if self._reqs:
            raise RuntimeError("RingExchange.start called while a transfer is still in flight")
        ops = [
            dist.P2POp(dist.isend, send, self.next_global, self.group),
            dist.P2POp(dist.irecv, recv, self.prev_global, self.group),
        ]
        self._reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        start = time.perf_counter() if _STATS is not None else 0.0
        for req in self._reqs:
            req.wait()
        self._reqs = []
        if _STATS is not None:
            _STATS.seconds += time.perf_counter() - start
            _STATS.waits += 1


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
