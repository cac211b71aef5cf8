"""Pieces: the contiguous runs of tokens a rank holds, and where each sits in sequence order.

A token mixer that runs along the sequence (a causal convolution, a linear recurrence)
needs, for each run of consecutive tokens a rank holds, what comes just before it in the
full sequence: the convolution's last ``k - 1`` inputs, the recurrence's state. Under the
contiguous layout a rank holds one run (chunk ``r`` of ``N``); under zigzag two (chunks
``r`` and ``2N - 1 - r`` of ``2N``), far apart in sequence order; a packed row repeats that
per document, and nothing crosses a document boundary. Under the stripe layout every
token is its own run: no cheap summary exists, so mixers refuse it.

Pure index math, no tensors. Must not import torch.distributed or any other layer of
hf_ring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from hf_ring.sharding.layouts import check_layout

# Layouts whose shards are runs of consecutive tokens.
RUN_LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Piece:
    """One run of consecutive tokens of one document (the whole row when not packed).

    Attributes:
        doc: the document's index in the row (0 for a dense row).
        chunk: the run's place in its document's chunk order, ``0 .. chunks - 1``; chunk
            ``c`` directly follows chunk ``c - 1`` in the document.
        chunks: how many chunks the document is cut into (``2N`` zigzag, ``N`` contiguous).
        owner: the rank holding it.
        slot: its index among the owner's pieces, in the owner's local order.
        local_start: where it starts in the owner's local row.
        length: its tokens.
    """

    doc: int
    chunk: int
    chunks: int
    owner: int
    slot: int
    local_start: int
    length: int

    @property
    def first(self) -> bool:
        """Whether it starts its document (nothing comes before it: zero state, zero halo)."""
        return self.chunk == 0


def chunks_per_doc(layout: str, world: int) -> int:
    """How many chunks each document (or dense row) is cut into."""
    return 2 * world if layout == "zigzag" else world


def chunk_owner(layout: str, world: int, chunk: int) -> int:
    """The rank that holds chunk ``chunk`` of a document."""
    if layout == "zigzag":
        return chunk if chunk < world else 2 * world - 1 - chunk
    return chunk


def row_pieces(layout: str, world: int, local_len: int,
               local_doc_lens: Optional[Sequence[int]] = None) -> list[list[Piece]]:
    """Every rank's pieces of one row, in each rank's local order: ``pieces[rank][slot]``.

    Args:
        layout: ``"zigzag"`` or ``"contiguous"`` (stripe is refused: one-token runs).
        world: the context-parallel group's size.
        local_len: tokens per rank (the row's length over ``world``).
        local_doc_lens: a packed row's documents, each one's local length (its global
            length over ``world``; zigzag only, every document sharded on its own), summing
            to ``local_len``; None for a dense row (one document).

    Raises:
        ValueError: a layout that is not a run layout, or lengths that do not split.
    """
    check_layout(layout)
    if layout not in RUN_LAYOUTS:
        raise ValueError(
            f"layout {layout!r} gives every rank one-token runs, and a convolution or recurrence over "
            "the sequence would need a halo or a state per token; use layout 'zigzag' or 'contiguous' "
            "for models with such token mixers"
        )
    docs = list(local_doc_lens) if local_doc_lens is not None else [local_len]
    if local_doc_lens is not None and layout != "zigzag":
        raise ValueError(f"packed rows are zigzag-sharded per document, got layout {layout!r}")
    if sum(docs) != local_len or any(n <= 0 for n in docs):
        raise ValueError(f"document local lengths {docs} do not make up {local_len} local tokens")
    per_rank = chunks_per_doc(layout, world) // world
    pieces: list[list[Piece]] = [[] for _ in range(world)]
    for rank in range(world):
        start = 0
        for doc, n in enumerate(docs):
            if n % per_rank:
                raise ValueError(f"document {doc} holds {n} local tokens, not a multiple of {per_rank} "
                                 f"(its {per_rank} zigzag chunks per rank)")
            mine = [c for c in range(chunks_per_doc(layout, world)) if chunk_owner(layout, world, c) == rank]
            for chunk in mine:
                length = n // per_rank
                pieces[rank].append(Piece(doc, chunk, chunks_per_doc(layout, world), rank, len(pieces[rank]),
                                          start, length))
                start += length
    return pieces


def in_sequence_order(pieces: list[list[Piece]]) -> list[Piece]:
    """Every piece of a row in sequence order: by document, then chunk."""
    return sorted((p for rank in pieces for p in rank), key=lambda p: (p.doc, p.chunk))


__all__ = ["Piece", "RUN_LAYOUTS", "chunk_owner", "chunks_per_doc", "in_sequence_order", "row_pieces"]
