"""Halos: the ``halo`` input tokens just before each of a rank's pieces, from whoever holds them.

Every rank cuts the last ``halo`` tokens of each of its pieces (its *tails*, fewer when a
piece is shorter, left-padded with zeros) and one all-gather hands every rank every tail.
A piece's halo is then read off the tails of the pieces before it in its document, walking
back as many pieces as it takes when pieces are shorter than the halo, and padded with
zeros where the document starts first. Nothing is read across a document boundary.

Backward, the other way: the gradient of every rank's reading of the tails goes back in
one reduce-scatter, so each rank gets its own tails' gradient summed over every rank that
read them (:func:`add_tail_grads` puts it on its tokens). The caller runs both collectives
on every rank of the group (a rank whose halos are all zeros still takes part).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_ring.sharding.pieces import Piece


def piece_tails(x: torch.Tensor, mine: list[Piece], halo: int) -> torch.Tensor:
    """The last ``halo`` tokens of each of this rank's pieces.

    Args:
        x: ``(batch, channels, local_seq)``, any floating dtype.
        mine: this rank's pieces, in slot order.
        halo: tokens wanted, ``>= 1``.

    Returns:
        ``(n_pieces, batch, channels, halo)``, ``x``'s dtype; a piece shorter than ``halo``
        fills the right end and zeros the left (they are never read: see :func:`piece_halos`).
    """
    tails = []
    for p in mine:
        take = min(halo, p.length)
        end = p.local_start + p.length
        tails.append(F.pad(x[..., end - take:end], (halo - take, 0)))  # (batch, channels, halo)
    return torch.stack(tails)


def piece_halos(gathered: torch.Tensor, pieces: list[list[Piece]], rank: int, halo: int) -> list[torch.Tensor]:
    """Each of ``rank``'s pieces' halo: the ``halo`` tokens before it in its document.

    Args:
        gathered: every rank's tails, ``(world, n_pieces, batch, channels, halo)``.
        pieces: every rank's pieces (``row_pieces``), ``pieces[rank][slot]``.
        rank: this rank.
        halo: tokens per halo, ``>= 1``.

    Returns:
        One ``(batch, channels, halo)`` tensor per piece of ``rank``, in slot order, the
        dtype of ``gathered``; zeros for the positions before the document's start.
    """
    by_place = {(p.doc, p.chunk): p for held in pieces for p in held}
    zeros = gathered.new_zeros(gathered.shape[2:-1] + (halo,))  # (batch, channels, halo)
    halos = []
    for p in pieces[rank]:
        parts, need, chunk = [], halo, p.chunk - 1
        # Walk back through the document: a piece shorter than the halo gives all it has
        # and the rest comes from the pieces before it, maybe on other ranks.
        while need > 0 and chunk >= 0:
            q = by_place[(p.doc, chunk)]
            take = min(need, q.length)
            parts.append(gathered[q.owner, q.slot, ..., halo - take:])  # (batch, channels, take)
            need, chunk = need - take, chunk - 1
        if need > 0:  # reached the document's start: nothing before it
            parts.append(zeros[..., :need])
        halos.append(torch.cat(parts[::-1], dim=-1))
    return halos


def add_tail_grads(dx: torch.Tensor, d_tails: torch.Tensor, mine: list[Piece], halo: int) -> None:
    """The backward of :func:`piece_tails`, in place: add each tail's gradient to its tokens.

    Args:
        dx: ``(batch, channels, local_seq)``, the gradient of ``x`` so far.
        d_tails: ``(n_pieces, batch, channels, halo)``, the gradient of this rank's tails
            (its padding zeros' gradient is dropped: they are no tokens).
    """
    for p, d in zip(mine, d_tails):
        take = min(halo, p.length)
        end = p.local_start + p.length
        dx[..., end - take:end] += d[..., halo - take:]


__all__ = ["add_tail_grads", "piece_halos", "piece_tails"]
