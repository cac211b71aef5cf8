"""``AttentionPlan``: everything one context-parallel attention call needs besides the
tensors, validated once: the one settings record of every pattern.

A plan fixes the pattern (ring, all-gather, Ulysses, hybrid; ``"auto"`` is resolved
before a plan exists), who we are in the group (rank, world, group, transport,
collectives), what we compute (layout, causal, scale, sliding window, softcap, documents
of a packed row) and with which block kernel. Ulysses and hybrid hold the plan of the
attention they run after their all-to-all (``inner``): one process over the whole
sequence, or the ring across the Ulysses groups.

It also caches what is the same in the forward and the backward and across the layers of
one model forward: each ring step's block schedule (cut to the window and chunks, see
ring/window.py), the window masks on the device and, for packed rows on a varlen kernel,
each step's index tensors on the device, and on other kernels each step's runs of equal
blocks (ring/block_runs.py). Building a plan does no communication and no
host sync (the hybrid pattern's subgroups are built by build.py before the plan).
Plans are built by :mod:`hf_ring.patterns.build` and run by :mod:`hf_ring.patterns.run`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from hf_ring.distributed.collectives import Collectives
from hf_ring.distributed.comm import CommWaitStats, Transport, process_group_transport
from hf_ring.kernels import AttentionBackend
from hf_ring.kernels.cuda.window_bands import bands
from hf_ring.kernels.registry import backends_that
from hf_ring.patterns.ring.block_runs import Call, group_runs
from hf_ring.patterns.ring.packed_step import StepBatch, step_batch
from hf_ring.patterns.ring.schedule import Block, step_blocks
from hf_ring.patterns.ring.spans import BidirectionalSpans, SpanBlock, span_blocks
from hf_ring.patterns.ring.window import window_blocks
from hf_ring.sharding.layouts import check_layout, shard_indices
from hf_ring.sharding.packed import packed_shard_indices

if TYPE_CHECKING:  # hybrid.py builds on plans: a type-only import keeps the two apart
    from hf_ring.patterns.hybrid import HybridGroups

# The patterns a plan runs; "auto" picks one of them per kind of call (auto.py).
PATTERNS = ("ring", "allgather", "ulysses", "hybrid")


def _blocks_key(blocks: list[Block]) -> tuple:
    """A cache key for a step's blocks: their rectangles and their masks. Blocks compare by
    rectangle only, and two steps can hold blocks of one rectangle under different window
    masks; the masks live in the plan's block cache, so their ids stay valid as keys."""
    return tuple((b, id(b.mask)) for b in blocks)


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """One context-parallel attention call's settings.

    Attributes:
        group: the context-parallel process group (None: the default group, or a single
            process / a virtual ring when ``transport`` is given).
        rank, world: this rank's index in the group and the group's size.
        layout: ``"zigzag"``, ``"stripe"`` or ``"contiguous"`` (packed rows: zigzag).
        causal: causal mask over global positions.
        scale: softmax scale.
        backend: the block kernel, resolved by the kernel policy for the call's device,
            dtype and needs (``hf_ring.kernels.get_backend``).
        local_doc_lens: packed rows only, each document's local length (its global length
            over ``world``), summing to the local sequence length.
        transport: how the ring's blocks travel (default: P2P over ``group``, its waits
            added to ``comm_stats``); the ring pattern only.
        window: sliding window in tokens (key j visible to query i iff ``0 <= i - j <
            window``, global positions), or None; causal only, and a backend with a masked
            kernel. Blocks outside it are skipped, blocks on its edge masked. On packed rows
            it applies inside each document (a document's blocks never meet another's).
        chunk: attention chunks in tokens (Llama 4's ``attention_chunk_size``: key j visible
            to query i iff ``i // chunk == j // chunk``, on top of causal), or None; like
            ``window``, on a masked kernel, but dense rows only; both may be given.
        softcap: logit softcapping (scores become ``softcap * tanh(scores / softcap)``), or
            None; dense rows, and a backend whose kernels take it (``backend.softcap``).
        positions: instead of the layout's shards, each ring rank's global token positions
            (int64 ``(local_len,)`` CPU tensors, in the order the rank holds its tokens;
            ``layout`` is then ignored), for token sets no layout describes (the hybrid
            pattern's stripe groups). Each step is then one block cut to what the causal
            mask (and window, chunks) keep, so causal plans need a masked kernel.
        comm_stats: a sink for the time transfers were waited on.
        pattern: which of :data:`PATTERNS` runs the call.
        ulysses_size: hybrid only, the ranks per Ulysses group.
        need_lse: whether the caller wants the lse (Ulysses then sends it back too).
        collectives: the group's collectives (all-gather, Ulysses, hybrid; default: over
            ``group``; benchmarks pass virtual ones).
        inner: Ulysses and hybrid: the plan of the attention after the all-to-all.
        hybrid: hybrid only, this rank's subgroups (``hybrid.HybridGroups``).
        spans: bidirectional spans on top of causal (``ring/spans.py``: a query in a span
            also sees the span's later keys), per batch row, or None; causal plans, a
            backend with a masked kernel; with a window (which never hides a later key),
            not with chunks; on packed rows each span inside one document.
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
    window: Optional[int] = None
    comm_stats: Optional[CommWaitStats] = None
    chunk: Optional[int] = None
    softcap: Optional[float] = None
    positions: Optional[tuple[torch.Tensor, ...]] = None
    pattern: str = "ring"
    ulysses_size: Optional[int] = None
    need_lse: bool = True
    collectives: Optional[Collectives] = None
    inner: Optional["AttentionPlan"] = None
    hybrid: Optional["HybridGroups"] = None
    spans: Optional[BidirectionalSpans] = None
    _blocks: dict = field(default_factory=dict, repr=False)
    _masks: dict = field(default_factory=dict, repr=False)
    _varlen_batches: dict = field(default_factory=dict, repr=False)
    _span_blocks: dict = field(default_factory=dict, repr=False)
    _kernel_calls: dict = field(default_factory=dict, repr=False)

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
        for name in ("window", "chunk"):
            if getattr(self, name) is not None:
                self._check_cut(name)
        if self.softcap is not None:
            self._check_softcap()
        if self.positions is not None:
            self._check_positions()
        if self.spans is not None:
            self._check_spans()
        if self.pattern not in PATTERNS:
            raise ValueError(f"unknown context-parallel pattern {self.pattern!r}; choose one of {', '.join(PATTERNS)}")
        if self.pattern in ("ulysses", "hybrid") and self.world > 1 and self.inner is None:
            raise ValueError(f"a {self.pattern} plan needs the plan of its attention after the all-to-all (inner); "
                             "build it with hf_ring.patterns.build.build_plan")
        if self.world > 1 and self.pattern == "ring" and self.transport is None:
            object.__setattr__(self, "transport", process_group_transport(self.group, self.comm_stats))

    def _check_cut(self, name: str) -> None:
        """A window or chunks (``name``): what cuts the causal blocks to fewer pairs."""
        w = getattr(self, name)
        what = "a sliding window" if name == "window" else "chunked attention"
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"{name} must be a positive int (tokens), got {w!r}")
        if not self.causal:
            raise ValueError(f"{what} is defined on top of causal attention; pass causal=True")
        if name == "chunk" and self.local_doc_lens is not None:
            # Llama 4 cuts chunks at row indices, which a packed row's documents do not share.
            raise NotImplementedError(
                "chunked attention on packed rows (several documents per row) is not computed by the ring; "
                "use dense rows, or documents no longer than the chunk"
            )
        if not self.backend.masked:
            raise NotImplementedError(
                f"attention backend {self.backend.name!r} has no masked kernel, which {what} inside the "
                f"ring needs (for the blocks on its edge); use {backends_that('masked')}, or sequences no "
                f"longer than the {name} ({name}=None)"
            )

    def _check_softcap(self) -> None:
        if not (isinstance(self.softcap, (int, float)) and not isinstance(self.softcap, bool) and self.softcap > 0):
            raise ValueError(f"softcap must be a positive float, got {self.softcap!r}")
        if self.local_doc_lens is not None:
            raise NotImplementedError("logit softcapping on packed rows (several documents per row) is not "
                                      "computed yet; use dense rows")
        if not self.backend.softcap:
            raise NotImplementedError(
                f"attention backend {self.backend.name!r} cannot compute logit softcapping; use "
                f"{backends_that('softcap')}"
            )

    def _check_positions(self) -> None:
        if len(self.positions) != self.world or self.local_doc_lens is not None:
            raise ValueError(f"positions must give each of the {self.world} ranks' tokens (dense rows only)")
        if self.causal:
            self._require_masked_kernel("a ring over tokens no layout describes needs")

    def _check_spans(self) -> None:
        if not self.causal:
            raise ValueError("bidirectional spans are defined on top of causal attention (without a causal "
                             "mask every key is visible already); pass causal=True")
        if self.chunk is not None:
            raise NotImplementedError("bidirectional spans with chunked attention (attention_chunk_size) are "
                                      "not computed by the ring; use one or the other")
        self._require_masked_kernel("bidirectional spans inside the ring need (each span's later keys are a "
                                    "masked block)")

    def _require_masked_kernel(self, why: str) -> None:
        if not self.backend.masked:
            raise NotImplementedError(
                f"attention backend {self.backend.name!r} has no masked kernel, which {why}; use "
                f"{backends_that('masked')}"
            )
        if self.local_doc_lens is not None:
            bounds = [0]
            for n in self.local_doc_lens:
                bounds.append(bounds[-1] + n * self.world)
            if bounds[-1] != self.spans.seq:
                raise ValueError(f"the spans describe {self.spans.seq} tokens, the packed row has {bounds[-1]}")
            self.spans.check_inside(bounds)

    @property
    def kernel_kwargs(self) -> dict:
        """Keywords every block kernel call gets: the softcap when there is one."""
        return {} if self.softcap is None else {"softcap": float(self.softcap)}

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
            self._blocks[key] = (self._position_blocks(src, local_len) if self.positions is not None
                                 else self._layout_blocks(src, local_len))
        return self._blocks[key]

    def _layout_blocks(self, src: int, local_len: int) -> list[Block]:
        blocks = step_blocks(self.layout, self.causal, local_len, self.rank, src, self.local_doc_lens)
        seq = local_len * self.world
        # A window or a chunk of at least seq tokens masks nothing.
        window = self.window if self.window is not None and self.window < seq else None
        chunk = self.chunk if self.chunk is not None and self.chunk < seq else None
        if window is not None or chunk is not None:
            blocks = window_blocks(blocks, self.token_positions(self.rank, local_len),
                                   self.token_positions(src, local_len), window, chunk)
        return blocks

    def token_positions(self, rank: int, local_len: int) -> torch.Tensor:
        """Global positions of the rows ring rank ``rank`` holds, int64 ``(local_len,)``
        (CPU): the explicit positions, a packed row's per-document zigzag, or the layout's."""
        if self.positions is not None:
            return self.positions[rank]
        if self.local_doc_lens is not None:
            bounds = torch.tensor([0, *self.local_doc_lens]).cumsum(0) * self.world
            return packed_shard_indices(bounds, self.world, rank)
        return shard_indices(local_len * self.world, self.world, rank, self.layout)

    def span_blocks(self, step: int, local_len: int) -> list[SpanBlock]:
        """The extra blocks of ring step ``step`` that the bidirectional spans add (none
        without spans); the rows of the call are checked against the spans by the caller."""
        if self.spans is None:
            return []
        key = (step, local_len)
        if key not in self._span_blocks:
            src = (self.rank - step) % self.world
            if local_len * self.world != self.spans.seq:
                raise ValueError(f"the spans describe {self.spans.seq} tokens, the call holds {local_len} of "
                                 f"{local_len * self.world}")
            self._span_blocks[key] = span_blocks(self.spans, self.token_positions(self.rank, local_len),
                                                 self.token_positions(src, local_len))
        return self._span_blocks[key]

    def _position_blocks(self, src: int, local_len: int) -> list[Block]:
        """One step's block from explicit positions: everything without a causal mask, else
        the pairs the causal mask, the window and the chunks keep (trimmed, masked where needed)."""
        whole = [Block(0, local_len, 0, local_len, False)]
        if not self.causal:
            return whole
        q_pos, k_pos = self.positions[self.rank], self.positions[src]
        # Without a window or chunks this keeps exactly the causal pairs (i - j >= 0).
        return window_blocks(whole, q_pos, k_pos, self.window, self.chunk)

    def mask(self, block: Block, device: torch.device) -> torch.Tensor:
        """A masked block's mask on ``device``, copied there once per plan (the blocks live
        in the plan's cache, so their masks' ids are stable keys)."""
        key = (id(block.mask), device)
        if key not in self._masks:
            self._masks[key] = block.mask.to(device)
            if device.type != "cpu":  # kernels that run windows as bands find them cut, without a host sync
                bands(self._masks[key], host_mask=block.mask)
        return self._masks[key]

    def kernel_calls(self, blocks: list[Block]) -> list[Call]:
        """A step's blocks as kernel calls, built once per plan: on a packed row, runs of
        equal blocks (consecutive documents of one length) batched into one call each
        where the backend takes such views (``ring/block_runs.py``); else the blocks."""
        if self.local_doc_lens is None or not self.backend.batched_views:
            return blocks
        key = _blocks_key(blocks)
        if key not in self._kernel_calls:
            self._kernel_calls[key] = group_runs(blocks)
        return self._kernel_calls[key]

    def varlen_batch(self, blocks: list[Block], device: torch.device) -> Optional[StepBatch]:
        """``packed_step.step_batch`` for a step's blocks, built once per plan."""
        key = (_blocks_key(blocks), device)
        if key not in self._varlen_batches:
            self._varlen_batches[key] = step_batch(blocks, device)
        return self._varlen_batches[key]
