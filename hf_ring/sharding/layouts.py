"""Which tokens of a sequence each context-parallel rank holds, and how to move between
the full sequence and the per-rank shards.

Pure index math, no process groups: the same functions serve the collator (shard a batch),
the tests (build each rank's piece of a reference) and users with their own models.

Layouts, for a sequence of ``seq_len`` tokens over ``cp_size`` ranks:

- ``"zigzag"``: the sequence is cut into ``2 * cp_size`` equal chunks; rank ``r`` holds
  chunks ``r`` and ``2 * cp_size - 1 - r``. Under a causal mask every rank then does the
  same amount of work (an early chunk is paired with a late one).
- ``"stripe"``: token ``t`` lives on rank ``t % cp_size`` (Striped Attention); also balanced.
- ``"contiguous"``: rank ``r`` holds the ``r``-th of ``cp_size`` equal chunks (plain ring
  attention; under a causal mask the last rank does ``2 * cp_size - 1`` times the work of
  the first).
"""

from __future__ import annotations

from typing import Sequence

import torch

LAYOUTS = ("zigzag", "stripe", "contiguous")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(
            f"unknown context-parallel layout {layout!r}; choose one of {', '.join(LAYOUTS)}"
        )


def required_multiple(cp_size: int, layout: str) -> int:
    """The number the full sequence length must be a multiple of for ``layout``."""
    check_layout(layout)
    return 2 * cp_size if layout == "zigzag" else cp_size


def _check_split(seq_len: int, cp_size: int, cp_rank: int, layout: str) -> None:
    check_layout(layout)
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    multiple = required_multiple(cp_size, layout)
    if seq_len % multiple != 0:
        raise ValueError(
            f"sequence length {seq_len} is not a multiple of {multiple}, which the "
            f"{layout!r} layout needs with cp_size={cp_size}; pad the sequence at the end "
            f"(RingDataCollator does this) to a multiple of {multiple}"
        )


def shard_indices(
    seq_len: int, cp_size: int, cp_rank: int, layout: str = "zigzag"
) -> torch.Tensor:
    """Global token positions held by ``cp_rank``, in the order the rank holds them.

    Returns an int64 tensor of shape ``(seq_len // cp_size,)``.
    """
    _check_split(seq_len, cp_size, cp_rank, layout)
    if layout == "stripe":
        return torch.arange(cp_rank, seq_len, cp_size)
    if layout == "contiguous":
        local = seq_len // cp_size
        return torch.arange(cp_rank * local, (cp_rank + 1) * local)
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    last_chunk = 2 * cp_size - 1 - cp_rank
    second = torch.arange(last_chunk * chunk, (last_chunk + 1) * chunk)
    return torch.cat([first, second])


def shard_sequence(
    x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1, layout: str = "zigzag"
) -> torch.Tensor:
    """The piece of ``x`` that ``cp_rank`` holds.

    Args:
        x: any tensor whose dimension ``dim`` is the full sequence, of length a multiple of
            ``2 * cp_size`` (zigzag) or ``cp_size`` (stripe, contiguous); any dtype.
        dim: the sequence dimension (1 for ``(batch, seq, ...)``).

    Returns:
        A tensor like ``x`` with ``x.shape[dim] // cp_size`` entries along ``dim``.
    """
    dim = dim % x.dim()
    idx = shard_indices(x.shape[dim], cp_size, cp_rank, layout).to(x.device)
    return x.index_select(dim, idx)


def unshard_sequence(
    shards: Sequence[torch.Tensor], dim: int = 1, layout: str = "zigzag"
) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: every rank's piece, in rank order, back to the
    full sequence.

    Args:
        shards: ``cp_size`` tensors of equal shape, ``shards[r]`` being rank ``r``'s piece.
        dim: the sequence dimension.
    """
    if len(shards) == 0:
        raise ValueError("unshard_sequence needs at least one shard")
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise ValueError(f"every shard must have the same shape, got {sorted(shapes)}")
    cp_size = len(shards)
    dim = dim % shards[0].dim()
    seq_len = shards[0].shape[dim] * cp_size
    stacked = torch.cat(list(shards), dim=dim)
    order = torch.cat([shard_indices(seq_len, cp_size, r, layout) for r in range(cp_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len)
    return stacked.index_select(dim, inverse.to(stacked.device))
