"""Bidirectional spans on top of causal attention: the extra keys of a span's queries.

Gemma 3 lets the tokens of one image attend to each other both ways inside its causal
mask (transformers' ``blockwise_overlay``: full layers see ``causal OR same span``, sliding
layers ``window AND (causal OR same span)``); PaliGemma's prefix is one such span. For a
query ``i`` in a span ``[a, b)`` that adds exactly the keys ``j`` with ``i < j < b``: keys
the causal mask hides. A one-sided window (``0 <= i - j < window``) never hides a later key,
so those extra keys are the same with or without a sliding window, and they are disjoint
from the causal (and windowed) ones. The extra keys are therefore one more term in each
row's softmax, computed as extra blocks of the ring's steps and merged by the online softmax
(merge.py) with the causal blocks: exact, forward and backward (the backward of every
block uses the final out and lse, as for the causal blocks).

At each step (the K/V of rank ``src``) a span gives one block: the local query rows in
the span against the received key rows in the span, trimmed to the rows and columns with
a visible pair, masked to ``k_pos > q_pos`` within the span (plain when every pair is
visible). Blocks are computed once per plan and step from Python-side positions: no device
work, no communication (the span's keys on other ranks arrive with the ring's K/V blocks,
or the all-gather's, or the Ulysses exchange's full sequence).

Spans are given per batch row; rows that share their spans (consecutive ones) share the
blocks' kernel calls.

Must not import torch.distributed, transformers, accelerate, or hf_ring's integration or
training layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from hf_ring.patterns.ring.schedule import Block
from hf_ring.patterns.validation import int_hash

Span = tuple[int, int]


@dataclass(frozen=True)
class BidirectionalSpans:
    """Each batch row's bidirectional spans over the full sequence, validated.

    Attributes:
        rows: per batch row, its spans ``(start, end)`` (global token positions, ``end``
            exclusive), sorted and disjoint (adjacent spans are two spans: neither sees the
            other's later keys). A row may have none.
        seq: the full sequence's length in tokens; every span lies inside it.
    """

    rows: tuple[tuple[Span, ...], ...]
    seq: int

    def __post_init__(self) -> None:
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 1:
            raise ValueError(f"spans need the sequence length, a positive int, got {self.seq!r}")
        if not self.rows:
            raise ValueError("spans need one entry per batch row (an empty tuple for a row without spans)")
        rows = []
        for r, spans in enumerate(self.rows):
            row, end = [], 0
            for span in spans:
                a, b = (int(x) for x in span)
                if not 0 <= a < b <= self.seq:
                    raise ValueError(f"span {tuple(span)} of row {r} is not a non-empty range inside the "
                                     f"{self.seq} tokens (start < end, 0 <= start, end <= {self.seq})")
                if a < end:
                    raise ValueError(f"spans of row {r} must be sorted and disjoint; {tuple(span)} starts "
                                     f"before the previous one ends ({end})")
                row.append((a, b))
                end = b
            rows.append(tuple(row))
        object.__setattr__(self, "rows", tuple(rows))

    @classmethod
    def from_runs(cls, inside: torch.Tensor, single: bool = False) -> "BidirectionalSpans":
        """Each maximal run of True in ``inside`` (bool ``(batch, seq)``) as one span (Gemma 3:
        each run of image tokens); with ``single``, a row's True positions must form one run
        (PaliGemma's prefix: one block, which two runs would not describe). One host sync."""
        if inside.dim() != 2:
            raise ValueError(f"span positions must be (batch, seq), got shape {tuple(inside.shape)}")
        rows = []
        for r, flags in enumerate(inside.to(torch.bool).tolist()):
            spans, start = [], None
            for t, on in enumerate([*flags, False]):
                if on and start is None:
                    start = t
                elif not on and start is not None:
                    spans.append((start, t))
                    start = None
            if single and len(spans) > 1:
                raise ValueError(f"row {r}'s bidirectional block is {len(spans)} separate runs {spans}; it must be "
                                 "one run of tokens (one span)")
            rows.append(tuple(spans))
        return cls(tuple(rows), inside.shape[1])

    def cut_at(self, bounds: Sequence[int]) -> "BidirectionalSpans":
        """Each span cut at the packed documents' boundaries ``bounds`` (global, from 0 to
        ``seq``): a run of image tokens that ends one document and starts the next is two
        blocks, as transformers' mask (the documents' AND each block's) makes it."""
        inner = sorted({int(e) for e in bounds} - {0, self.seq})
        rows = []
        for spans in self.rows:
            row = []
            for a, b in spans:
                cuts = [a, *(e for e in inner if a < e < b), b]
                row += list(zip(cuts[:-1], cuts[1:]))
            rows.append(tuple(row))
        return BidirectionalSpans(tuple(rows), self.seq)

    def check_batch(self, batch: int) -> None:
        if batch != len(self.rows):
            raise ValueError(f"bidirectional spans are given for {len(self.rows)} batch rows, the call has {batch}")

    def check_inside(self, bounds: Sequence[int]) -> None:
        """Every span inside one packed document (``bounds``: the documents' global
        boundaries, from 0 to ``seq``): a span across documents would let one see another."""
        for spans in self.rows:
            for a, b in spans:
                doc_end = next(e for e in bounds[1:] if e > a)
                if b > doc_end:
                    raise ValueError(f"span ({a}, {b}) crosses the packed document boundary at {doc_end}; "
                                     "a bidirectional span must lie inside one document")


@dataclass(frozen=True)
class SpanBlock:
    """One span's extra block at a ring step, for the batch rows ``rows`` (a slice)."""

    rows: slice
    block: Block


def _row_groups(spans: BidirectionalSpans) -> list[tuple[slice, tuple[Span, ...]]]:
    """Runs of consecutive batch rows with the same spans (rows without spans left out)."""
    groups, start = [], 0
    rows = spans.rows
    for r in range(1, len(rows) + 1):
        if r == len(rows) or rows[r] != rows[start]:
            if rows[start]:
                groups.append((slice(start, r), rows[start]))
            start = r
    return groups


def _span_block(span: Span, q_pos: torch.Tensor, k_pos: torch.Tensor) -> Optional[Block]:
    """The span's extra pairs between the local rows at ``q_pos`` and the received rows at
    ``k_pos`` (int64 ``(local_len,)``, global positions): ``a <= q < k < b``. Only the
    rectangle between the span's first and last rows is scored (the span's size, not the
    shard's)."""
    a, b = span
    q_in = (q_pos >= a) & (q_pos < b)
    k_in = (k_pos >= a) & (k_pos < b)
    q_rows, k_rows = q_in.nonzero().flatten(), k_in.nonzero().flatten()
    if q_rows.numel() == 0 or k_rows.numel() == 0:
        return None
    r0, r1, c0, c1 = int(q_rows[0]), int(q_rows[-1]) + 1, int(k_rows[0]), int(k_rows[-1]) + 1
    visible = (q_in[r0:r1, None] & k_in[None, c0:c1]
               & (k_pos[None, c0:c1] > q_pos[r0:r1, None]))  # (r1 - r0, c1 - c0)
    rows, cols = visible.any(dim=1).nonzero().flatten(), visible.any(dim=0).nonzero().flatten()
    if rows.numel() == 0:
        return None
    sub = visible[int(rows[0]):int(rows[-1]) + 1, int(cols[0]):int(cols[-1]) + 1]
    r0, c0 = r0 + int(rows[0]), c0 + int(cols[0])
    r1, c1 = r0 + sub.shape[0], c0 + sub.shape[1]
    if bool(sub.all()):
        return Block(r0, r1, c0, c1, False)
    return Block(r0, r1, c0, c1, False, sub.contiguous())


def span_blocks(spans: BidirectionalSpans, q_pos: torch.Tensor, k_pos: torch.Tensor) -> list[SpanBlock]:
    """Every span's extra block between the local rows and the received rows of one step.

    Args:
        spans: the call's spans (``spans.seq`` the full sequence's length).
        q_pos: int64 ``(local_len,)``, the global position of each local query row.
        k_pos: int64 ``(local_len,)``, the global position of each received key row.

    Returns:
        One :class:`SpanBlock` per span and run of rows sharing it whose pairs meet here;
        their pairs are disjoint from the causal schedule's (every key is after its query).
    """
    out = []
    for rows, row_spans in _row_groups(spans):
        for span in row_spans:
            blk = _span_block(span, q_pos, k_pos)
            if blk is not None:
                out.append(SpanBlock(rows, blk))
    return out


def spans_fields(spans) -> list[tuple[str, int]]:
    """What ranks must agree on about a call's ``spans`` argument before it is validated
    (a rank whose spans are invalid must not raise alone): the rows, the bounds' count and an
    order-sensitive hash of every row index and bound; fixed-length, the same with or
    without spans (-1 where the argument cannot be read)."""
    if spans is None:
        return [("spans.rows", 0), ("spans.bounds", 0), ("spans.hash", 0)]
    rows = spans.rows if isinstance(spans, BidirectionalSpans) else spans
    try:
        bounds = [int(x) for r, row in enumerate(rows) for span in row for x in (r, *span)]
        return [("spans.rows", len(rows)), ("spans.bounds", len(bounds)), ("spans.hash", int_hash(bounds))]
    except (TypeError, ValueError):
        return [("spans.rows", -1), ("spans.bounds", -1), ("spans.hash", -1)]


def as_spans(spans, seq: int) -> Optional[BidirectionalSpans]:
    """``spans`` (None, a :class:`BidirectionalSpans`, or per batch row a sequence of
    ``(start, end)`` pairs) validated for a ``seq``-token sequence."""
    if spans is None or isinstance(spans, BidirectionalSpans):
        if spans is not None and spans.seq != seq:
            raise ValueError(f"the spans describe {spans.seq} tokens, the call's sequence has {seq}")
        return spans
    return BidirectionalSpans(tuple(tuple(tuple(s) for s in row) for row in spans), seq)


__all__ = ["BidirectionalSpans", "SpanBlock", "as_spans", "span_blocks", "spans_fields"]
