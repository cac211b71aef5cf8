"""Layouts for packed rows: several documents concatenated in one sequence.

Each document is zigzag-sharded on its own, so every rank holds an equal share of every
document's causal work, and a rank's local row is the concatenation, document by
document, of its two zigzag chunks of each. Every document length must therefore be a
multiple of ``2 * cp_size`` (the collator pads each document to one).

Document boundaries are given as ``cu_seqlens``: an int tensor ``(n_docs + 1,)`` of
cumulative lengths over the full (unsharded) sequence, starting at 0, the same on every
rank of a context-parallel group.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hf_ring.sharding.layouts import shard_indices


def check_cu_seqlens(cu_seqlens: torch.Tensor, cp_size: int) -> list[int]:
    """Validate global document boundaries; returns the document lengths as ints."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            "cu_seqlens must be a 1-d tensor [0, end_of_doc_0, end_of_doc_1, ...] with at "
            f"least one document, got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {bounds[0]}")
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    multiple = 2 * cp_size
    for i, n in enumerate(lengths):
        if n <= 0:
            raise ValueError(f"cu_seqlens must be strictly increasing; document {i} has length {n}")
        if n % multiple != 0:
            raise ValueError(
                f"document {i} has length {n}, not a multiple of 2 * cp_size = {multiple}; "
                "under context parallelism each packed document is zigzag-sharded on its own, "
                f"so pad every document to a multiple of {multiple} (RingDataCollator with "
                "packing does this)"
            )
    return lengths


def packed_shard_indices(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token positions held by ``cp_rank`` for a packed row, in local order.

    Returns int64 ``(cu_seqlens[-1] // cp_size,)``.
    """
    lengths = check_cu_seqlens(cu_seqlens, cp_size)
    pieces = []
    start = 0
    for n in lengths:
        pieces.append(start + shard_indices(n, cp_size, cp_rank, "zigzag"))
        start += n
    return torch.cat(pieces)


def local_cu_seqlens(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Document boundaries within one rank's local row (the same on every rank).

    Returns int64 ``(n_docs + 1,)``: global boundaries divided by ``cp_size``.
    """
    check_cu_seqlens(cu_seqlens, cp_size)
    return cu_seqlens.to(torch.int64) // cp_size


def shard_packed(
    x: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1
) -> torch.Tensor:
    """``cp_rank``'s piece of a packed sequence ``x`` (sequence along ``dim``)."""
    dim = dim % x.dim()
    if x.shape[dim] != int(cu_seqlens[-1]):
        raise ValueError(
            f"x has {x.shape[dim]} tokens along dim {dim} but cu_seqlens ends at "
            f"{int(cu_seqlens[-1])}; they must describe the same packed sequence"
        )
    idx = packed_shard_indices(cu_seqlens, cp_size, cp_rank).to(x.device)
    return x.index_select(dim, idx)


def unshard_packed(shards: Sequence[torch.Tensor], cu_seqlens: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_packed`: every rank's piece, in rank order, back to the row."""
    cp_size = len(shards)
    dim = dim % shards[0].dim()
    order = torch.cat([packed_shard_indices(cu_seqlens, cp_size, r) for r in range(cp_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return torch.cat(list(shards), dim=dim).index_select(dim, inverse.to(shards[0].device))
