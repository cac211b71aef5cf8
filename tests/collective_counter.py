"""Counts, inside a ``with`` block, the calls that cost a GPU step its overlap: collectives
other than the ring's point-to-point transfers, the ring's transfers themselves, and host
syncs (a tensor's value read on the host: ``tolist``, ``item``, ``bool``, ``int``, ``float``).

On CPU a host sync costs nothing, which is why it is counted rather than timed: on a GPU
each one stalls the host until the device has caught up. The counters wrap the functions
of ``torch.distributed`` and the methods of ``torch.Tensor`` for the duration of the block
(one process; the spawned test ranks each count their own).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch
import torch.distributed as dist

COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "monitored_barrier",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
)
P2P = ("batch_isend_irecv",)
HOST_SYNCS = ("tolist", "item", "__bool__", "__int__", "__float__")


@contextlib.contextmanager
def count_calls() -> Iterator[Counter]:
    """Yields a Counter with keys ``collective``, ``p2p``, ``host_sync`` and one per name."""
    counts: Counter = Counter()
    saved = []

    def wrap(owner, name: str, kind: str):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            counts[kind] += 1
            counts[name] += 1
            return original(*args, **kwargs)

        saved.append((owner, name, original))
        setattr(owner, name, counted)

    for name in COLLECTIVES:
        wrap(dist, name, "collective")
    for name in P2P:
        wrap(dist, name, "p2p")
    for name in HOST_SYNCS:
        wrap(torch.Tensor, name, "host_sync")
    try:
        yield counts
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
