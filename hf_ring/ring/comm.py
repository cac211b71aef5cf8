"""Point-to-point ring exchange with double buffering.

Every rank sends a buffer to ``rank + 1`` and receives one from ``rank - 1`` of its group,
asynchronously, so the caller computes on the current buffer while the next one is in
flight. Two buffers alternate: the one being computed on (and sent) and the one being
received into, so no step allocates.

On CUDA, NCCL runs point-to-point transfers on its own internal stream; ``wait()`` makes
the compute stream wait for them, so the transfer overlaps with the kernels queued before.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


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
        for req in self._reqs:
            req.wait()
        self._reqs = []


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
