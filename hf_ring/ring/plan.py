"""``RingPlan``: everything one ring call needs besides the tensors, validated once.

A plan fixes who we are in the ring (rank, world, group, transport), what we compute
(layout, causal, scale, documents of a packed row) and with which block kernel. It also
caches what is the same in the forward and the backward and across layers of one model
forward: each step's block schedule and, for packed rows on a varlen kernel, each step's
index tensors on the device. Building a plan does no communication and no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from hf_ring.kernels import AttentionBackend
from hf_ring.ring.comm import Transport, process_group_transport
from hf_ring.ring.packed_step import StepBatch, step_batch
from hf_ring.ring.schedule import Block, step_blocks
from hf_ring.sharding.layouts import check_layout


@dataclass(frozen=True, eq=False)
class RingPlan:
    """A ring call's settings.

    Attributes:
        group: the context-parallel process group (None: the default group, or a single
            process / a virtual ring when ``transport`` is given).
        rank, world: this rank's index in the ring and the ring's size.
        layout: ``"zigzag"``, ``"stripe"`` or ``"contiguous"`` (packed rows: zigzag).
        causal: causal mask over global positions.
        scale: softmax scale.
        backend: the block kernel.
        local_doc_lens: packed rows only, each document's local length (its global length
            over ``world``), summing to the local sequence length.
        transport: how blocks travel (default: P2P over ``group``).
    """

    group: Optional[dist.ProcessGroup]
    rank: int
    world: int
    layout: str
    causal: bool
    scale: float
    backend: AttentionBackend
    local_doc_lens: Optional[tuple[int, ...]] = None
    transport: Optional[Transport] = None
    _blocks: dict = field(default_factory=dict, repr=False)
    _varlen_batches: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        check_layout(self.layout)
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not in a ring of {self.world}")
        if self.local_doc_lens is not None:
            if self.layout != "zigzag":
                raise ValueError(f"packed rows are zigzag-sharded per document, got layout {self.layout!r}")
            if any(n <= 0 for n in self.local_doc_lens):
                raise ValueError(f"every packed document needs local tokens, got {self.local_doc_lens}")
            object.__setattr__(self, "local_doc_lens", tuple(self.local_doc_lens))
        if self.world > 1 and self.transport is None:
            object.__setattr__(self, "transport", process_group_transport(self.group))

    @property
    def varlen(self) -> bool:
        """Packed rows on a backend with a varlen kernel: one kernel call per ring step
        for all documents (packed_step.py) instead of one per document."""
        b = self.backend
        return self.local_doc_lens is not None and b.varlen_forward is not None and b.varlen_backward is not None

    def blocks(self, step: int, local_len: int) -> list[Block]:
        """The blocks of ring step ``step`` (K/V of rank ``rank - step``)."""
        key = (step, local_len)
        if key not in self._blocks:
            src = (self.rank - step) % self.world
            self._blocks[key] = step_blocks(self.layout, self.causal, local_len, self.rank, src, self.local_doc_lens)
        return self._blocks[key]

    def varlen_batch(self, blocks: list[Block], device: torch.device) -> Optional[StepBatch]:
        """``packed_step.step_batch`` for a step's blocks, built once per plan."""
        key = (tuple(blocks), device)  # Blocks are frozen dataclasses: hashable
        if key not in self._varlen_batches:
            self._varlen_batches[key] = step_batch(blocks, device)
        return self._varlen_batches[key]

    def with_backend(self, backend: AttentionBackend, **changes: Any) -> "RingPlan":
        """A copy with another kernel (and other fields), with fresh caches."""
        fields = {
            "group": self.group, "rank": self.rank, "world": self.world, "layout": self.layout,
            "causal": self.causal, "scale": self.scale, "local_doc_lens": self.local_doc_lens,
            "transport": self.transport,
        }
        return RingPlan(backend=backend, **{**fields, **changes})
