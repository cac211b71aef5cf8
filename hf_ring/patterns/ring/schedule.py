"""Which attention blocks a rank computes at each ring step, for each layout.

At step ``s`` rank ``r`` holds the K/V shard of rank ``src = (r - s) mod N``. Whether a
local query may see a received key depends only on their global positions, which the
layout fixes; every case reduces to a few rectangular blocks that are either fully
visible or causal on the diagonal:

zigzag (rank r holds chunks r and 2N-1-r, each ``c`` tokens, local length ``2c``):
    src == r: all local queries vs all local keys, causal.
    src <  r: all queries vs the first chunk of the keys (chunk src < r), no mask; the
              second chunk (2N-1-src > 2N-1-r) is in every query's future.
    src >  r: the second chunk of the queries (2N-1-r) vs all keys, no mask; the first
              query chunk (r < src) sees none of them.
    Every step is ``2c x c`` or ``c x 2c`` of work: balanced.
stripe (token t on rank t mod N; local i is global ``i*N + r``):
    src <= r: query i sees keys j <= i: causal.
    src >  r: query i sees keys j < i: queries 1.. vs keys ..-1, causal.
contiguous (rank r holds chunk r):
    src == r causal, src < r full, src > r nothing (the imbalance zigzag removes).

Without a causal mask every query sees every key at every step.

Packed rows (several documents, each zigzag-sharded on its own) apply the zigzag rule
per document, offset by where the document starts in the local row.

A sliding window cuts these blocks further (window.py): blocks wholly outside it are
dropped, the others trimmed, and those on its edge carry an explicit mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence


@dataclass(frozen=True)
class Block:
    """Local queries ``[q_start, q_end)`` against received keys ``[k_start, k_end)``.

    ``mask``: None, or (a block on a sliding window's edge) a bool tensor ``(q_end -
    q_start, k_end - k_start)``, True where the key is visible, which replaces ``causal``.
    It is left out of equality and hashing: blocks are compared by their rectangle.
    """

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: bool
    mask: Any = field(default=None, compare=False, repr=False)

    @property
    def work(self) -> float:
        """Query-key pairs computed (half the rectangle on a causal diagonal; a masked
        block's kernel still scores its whole rectangle)."""
        nq, nk = self.q_end - self.q_start, self.k_end - self.k_start
        return nq * (nk + 1) / 2 if self.causal and self.mask is None else nq * nk


def _zigzag(offset: int, length: int, rank: int, src: int) -> list[Block]:
    c = length // 2
    if src == rank:
        return [Block(offset, offset + length, offset, offset + length, True)]
    if src < rank:
        return [Block(offset, offset + length, offset, offset + c, False)]
    return [Block(offset + c, offset + length, offset, offset + length, False)]


def step_blocks(
    layout: str,
    causal: bool,
    local_len: int,
    rank: int,
    src: int,
    local_doc_lens: Optional[Sequence[int]] = None,
) -> list[Block]:
    """Blocks rank ``rank`` computes against the K/V shard of rank ``src``.

    ``local_doc_lens`` (packed rows, zigzag only): each document's local length, summing
    to ``local_len``.
    """
    if local_doc_lens is not None:
        blocks: list[Block] = []
        offset = 0
        for n in local_doc_lens:
            if causal:
                blocks += _zigzag(offset, n, rank, src)
            else:
                blocks.append(Block(offset, offset + n, offset, offset + n, False))
            offset += n
        return blocks
    if not causal:
        return [Block(0, local_len, 0, local_len, False)]
    if layout == "zigzag":
        return _zigzag(0, local_len, rank, src)
    if layout == "stripe":
        if src <= rank:
            return [Block(0, local_len, 0, local_len, True)]
        return [Block(1, local_len, 0, local_len - 1, True)] if local_len > 1 else []
    if layout == "contiguous":
        if src == rank:
            return [Block(0, local_len, 0, local_len, True)]
        return [Block(0, local_len, 0, local_len, False)] if src < rank else []
    raise ValueError(f"unknown layout {layout!r}")
