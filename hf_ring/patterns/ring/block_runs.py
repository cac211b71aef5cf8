"""Runs of equal blocks as one batched kernel call: consecutive packed documents of one length.

A packed row's schedule gives one block per document per step (schedule.py). Documents of
one local length that follow each other in the row give blocks of one shape, each the
documents' length further down the row, in queries and keys alike. Without a varlen
kernel, such a run goes to the kernel as one call whose batch dimension is the run: strided
views of the row's tensors (no copy), and the results go back through the same views. One
call, one merge and one gradient add per run instead of one of each per document: on the
CPU kernel a block of a short document costs as much in the calls around it as in
attention (``benchmarks/packed_runs.py``: 1.94x for 64 documents of 128 tokens at cp=4,
docs/performance.md, "Packed rows of many documents").

Exact: the kernel computes its batch entries independently, so each block of a run gets
what its own call would give. Only unmasked blocks batch (a window's edge blocks carry
their own masks), and only on a batch of one row (packed rows are one row).

Must not import torch.distributed, transformers, accelerate, or hf_ring's integration or
training layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from hf_ring.patterns.ring.schedule import Block


@dataclass(frozen=True)
class Rows:
    """``count`` ranges of ``length`` rows, the first at ``start``, each ``stride`` further."""

    start: int
    length: int
    count: int
    stride: int

    def of(self, t: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
        """These rows of ``t`` (a batch of one row, the sequence along ``seq_dim``) as one
        view with the ranges as its batch: ``(1, s, h, d)`` -> ``(count, length, h, d)``,
        lse ``(1, h, s)`` -> ``(count, h, length)``."""
        if t.shape[0] != 1:
            raise ValueError(f"runs of blocks batch the documents of one packed row (batch 1), got batch {t.shape[0]}")
        row = t[0]
        dim = seq_dim - 1
        size = list(row.shape)
        size[dim] = self.length
        step = row.stride(dim)
        return row.as_strided((self.count, *size), (self.stride * step, *row.stride()),
                              row.storage_offset() + self.start * step)


@dataclass(frozen=True)
class BlockRun:
    """``count`` blocks shaped like ``first``, block ``i`` ``stride * i`` rows further down
    in both queries and keys (a run of documents of one local length, ``stride``)."""

    first: Block
    count: int
    stride: int

    causal = property(lambda self: self.first.causal)
    mask = None  # runs are made of unmasked blocks only

    @property
    def members(self) -> list[Block]:
        """The run's blocks, one by one."""
        f, n = self.first, self.stride
        return [Block(f.q_start + i * n, f.q_end + i * n, f.k_start + i * n, f.k_end + i * n, f.causal)
                for i in range(self.count)]

    def view(self, t: torch.Tensor, seq_dim: int, keys: bool = False) -> torch.Tensor:
        """The run's query rows (``keys``: key rows) of ``t``, a batch of one row with the
        sequence along ``seq_dim``, as one view with the run as its batch: ``(1, s, h, d)``
        -> ``(count, len, h, d)``, lse ``(1, h, s)`` -> ``(count, h, len)``."""
        start, end = (self.first.k_start, self.first.k_end) if keys else (self.first.q_start, self.first.q_end)
        return Rows(start, end - start, self.count, self.stride).of(t, seq_dim)


Call = Union[Block, BlockRun]


def _extends(run: list[Block], blk: Block) -> bool:
    """Whether ``blk`` continues ``run``: one shape, one causal flag, unmasked, and as far
    from the run's last block as that one from the one before, in queries and keys."""
    last = run[-1]
    same = (blk.mask is None and last.mask is None and blk.causal == last.causal
            and blk.q_end - blk.q_start == last.q_end - last.q_start
            and blk.k_end - blk.k_start == last.k_end - last.k_start)
    step = blk.q_start - last.q_start
    # Runs never overlap themselves: one block per document, the documents disjoint.
    if not same or step != blk.k_start - last.k_start or step < max(last.q_end - last.q_start,
                                                                        last.k_end - last.k_start):
        return False
    return len(run) == 1 or step == last.q_start - run[-2].q_start


def group_runs(blocks: list[Block]) -> list[Call]:
    """``blocks`` in order, each run of two or more equal blocks (see :func:`_extends`) as
    one :class:`BlockRun`."""
    runs: list[list[Block]] = []
    for blk in blocks:
        if runs and _extends(runs[-1], blk):
            runs[-1].append(blk)
        else:
            runs.append([blk])
    return [r[0] if len(r) == 1 else BlockRun(r[0], len(r), r[1].q_start - r[0].q_start) for r in runs]


def query_rows(call: Call, t: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
    """A call's query rows of ``t`` (sequence along ``seq_dim``): a slice for a block, the
    batched view for a run."""
    if isinstance(call, BlockRun):
        return call.view(t, seq_dim)
    return t.narrow(seq_dim, call.q_start, call.q_end - call.q_start)


def key_rows(call: Call, t: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
    """As :func:`query_rows`, for the call's key rows."""
    if isinstance(call, BlockRun):
        return call.view(t, seq_dim, keys=True)
    return t.narrow(seq_dim, call.k_start, call.k_end - call.k_start)


def key_ranges(index: Union[slice, BlockRun]) -> list[tuple[int, int]]:
    """The ``(start, end)`` key ranges of a dK/dV index: a key slice, or a run's blocks."""
    if isinstance(index, BlockRun):
        return [(b.k_start, b.k_end) for b in index.members]
    return [(index.start, index.stop)]


__all__ = ["BlockRun", "Call", "Rows", "group_runs", "key_ranges", "key_rows", "query_rows"]
