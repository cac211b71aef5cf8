"""The entries of a cache spread over a context-parallel group, gathered onto every rank in
global order.

Why: a long prompt is prefilled under context parallelism into a sharded cache, but
decoding against the shards costs a collective per layer and per token
(:mod:`hf_ring.patterns.cached.decode`). Where the whole cache fits one device and the
collectives' latency dominates, gathering it once after the prefill and decoding locally can
be faster (docs/generation.md measures both); gathered in order it is the cache one process
would have built, without its rows' padding.

Must not import: transformers, accelerate, or hf_ring's integration, memory or training
layers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hf_ring.distributed.collectives import GroupCollectives


def _padded(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    if x.shape[dim] == length:
        return x.contiguous()
    shape = list(x.shape)
    shape[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def gathered_in_order(
    tensors: Sequence[torch.Tensor], keys: torch.Tensor, dim: int, group: Optional[dist.ProcessGroup]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every rank's entries, concatenated and sorted by their keys (a cache's columns). Collective
    over ``group``: one all-gather of the counts, one per tensor.

    Args:
        tensors: this rank's entries along ``dim`` (a cache layer's keys ``(batch,
            n_kv_heads, n_entries, head_dim)`` and values with ``dim=2``); ``n_entries`` may
            differ by rank.
        keys: int64 ``(n_entries,)``, each entry's place in the global order (a cache's column).
        dim: the entries' dimension.
        group: the group holding the other entries.

    Returns:
        The tensors with every rank's entries in global order along ``dim``, and their
        keys ``(n_total,)``, sorted.
    """
    coll = GroupCollectives(group)
    counts = coll.all_gather(torch.tensor([keys.numel()], device=keys.device)).view(-1).tolist()
    longest = max(counts)
    order_parts = coll.all_gather(_padded(keys, 0, longest))
    every_key = torch.cat([order_parts[r, :n] for r, n in enumerate(counts)])
    order = torch.argsort(every_key)
    out = []
    for t in tensors:
        parts = coll.all_gather(_padded(t, dim, longest))  # (world, ...)
        whole = torch.cat([parts[r].narrow(dim, 0, n) for r, n in enumerate(counts)], dim=dim)
        out.append(whole.index_select(dim, order.to(whole.device)))
    return out, every_key[order]


def columns_of_rows(
    x: torch.Tensor, columns: torch.Tensor, starts: torch.Tensor, count: int, group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """Each row's ``count`` columns from ``starts[row]`` on, put together on every rank of
    ``group`` with one all-reduce: each column is held by one rank and zero on the others,
    so the sum is exact; a column no rank holds (before a row's start) stays zero.

    Args:
        x: ``(rows, local_seq, ...)``, this rank's columns along dim 1.
        columns: int64 ``(local_seq,)``, the column of each of them.
        starts: int64 ``(rows,)``, each row's first wanted column (may be negative).
        count: how many columns per row.
        group: the group holding the other columns.

    Returns:
        ``(rows, count, ...)``, the same on every rank.
    """
    columns = columns.to(x.device)
    picked = x.new_zeros((x.shape[0], count, *x.shape[2:]))
    for row, start in enumerate(starts.tolist()):
        mine = (columns >= start) & (columns < start + count)
        picked[row, columns[mine] - start] = x[row, mine]
    dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)
    return picked
