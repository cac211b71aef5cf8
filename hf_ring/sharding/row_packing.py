"""Right-padded rows packed into one row of documents, and per-token fields unpacked back.

Used where whole right-padded rows are already built but should not be run padded: with
``padding_free=True`` the rollout trainers (``RingGRPOTrainer``, ``RingRLOOTrainer``, through
``hf_ring.training.trl.fused_forward``) run a CP group's prompt + completion rows as **one**
packed row: each row's real tokens are a document, padded only to the multiple the packed
zigzag layout needs (``2 * cp_size``, :mod:`hf_ring.sharding.packed`), instead of every row
to the group's longest. Position ids
restart at 0 in every document and the labels are shifted inside each document, so a
document's last token never scores the next one's first; ``ring_flash`` reads the document
boundaries (``cu_seq_lens_q`` / ``cu_seq_lens_k``) and never lets documents attend to each
other. What the model computes for a document is then what it computes for the row alone.

:func:`pack_rows` builds the packed row and the map back; :func:`unpack_field` puts a
per-token field of the packed row back into the rows' layout ``(rows, seq - 1)``, as the
padded forward returns it (zeros where a row has no next token), differentiably.

Must not import torch.distributed or hf_ring's other layers (pure index math on whole rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_ring.sharding.labels import IGNORE_INDEX


@dataclass(frozen=True)
class PackedRows:
    """One packed row of ``total`` tokens made of ``rows`` documents (unsharded, global).

    Attributes:
        input_ids: int64 ``(1, total)``, each document's tokens then its padding.
        shift_labels: int64 ``(1, total)``: position ``t`` holds the label of token ``t + 1`` of
            the same document, ``-100`` at each document's last real token and on padding.
        position_ids: int64 ``(1, total)``, restarting at 0 in every document.
        cu_seqlens: int32 ``(rows + 1,)``, the documents' (padded) boundaries.
        max_length: the longest (padded) document.
        index: int64 ``(rows, seq - 1)``: the packed position of row ``i``'s position ``t``.
        valid: bool ``(rows, seq - 1)``: whether that position is a real token with a next one.
    """

    input_ids: torch.Tensor
    shift_labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_length: int
    index: torch.Tensor
    valid: torch.Tensor


def pack_rows(input_ids: torch.Tensor, labels: torch.Tensor, lengths: torch.Tensor, multiple: int,
              pad_token_id: int) -> PackedRows:
    """Pack right-padded rows into one row of documents.

    Args:
        input_ids: int64 ``(rows, seq)``, right-padded (``seq >= 2``).
        labels: int64 ``(rows, seq)``, ``-100`` where a token is not scored (unshifted).
        lengths: int64 ``(rows,)``, each row's real tokens (>= 1).
        multiple: each document is padded to a multiple of this (``2 * cp_size``).
        pad_token_id: id written into the documents' padding.

    One host sync (the lengths).
    """
    rows, seq = input_ids.shape
    device = input_ids.device
    sizes = [int(n) for n in lengths.tolist()]
    if any(n < 1 or n > seq for n in sizes):
        raise ValueError(f"every row needs between 1 and {seq} real tokens to be packed, got {sizes}")
    padded = [-(-n // multiple) * multiple for n in sizes]
    total = sum(padded)
    ids = input_ids.new_full((1, total), pad_token_id)
    shift = labels.new_full((1, total), IGNORE_INDEX)
    positions = torch.empty((1, total), dtype=torch.long, device=device)
    bounds = [0]
    for row, (n, p) in enumerate(zip(sizes, padded)):
        start = bounds[-1]
        ids[0, start : start + n] = input_ids[row, :n]
        shift[0, start : start + n - 1] = labels[row, 1:n]
        positions[0, start : start + p] = torch.arange(p, device=device)
        bounds.append(start + p)
    starts = torch.tensor(bounds[:-1], dtype=torch.long, device=device)
    cols = torch.arange(seq - 1, device=device)
    index = (starts[:, None] + cols[None, :]).clamp(max=total - 1)  # (rows, seq - 1)
    valid = cols[None, :] < (lengths.to(device)[:, None] - 1)
    return PackedRows(ids, shift, positions, torch.tensor(bounds, dtype=torch.int32, device=device), max(padded),
                      index, valid)


def unpack_field(field: torch.Tensor, packed: PackedRows) -> torch.Tensor:
    """A per-token field of the packed row ``(1, total)`` (any dtype) in the rows' layout
    ``(rows, seq - 1)``, 0 where ``packed.valid`` is False; differentiable in ``field``."""
    values = field[0][packed.index]
    return torch.where(packed.valid, values, torch.zeros_like(values))
