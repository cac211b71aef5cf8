"""The entries of a cache spread over a context-parallel group, gathered onto every rank in
global order.

Why: a long prompt is prefilled under context parallelism into a sharded cache, but
decoding against the shards costs a collective per layer and per token
(:mod:`hf_ring.patterns.cached.decode`). Where the whole cache fits one device, gathering it
once after the prefill and decoding locally is faster; gathered in order it is exactly the
cache one process would have built.

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
    tensors: Sequence[torch.Tensor], positions: torch.Tensor, dim: int, group: Optional[dist.ProcessGroup]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every rank's entries, concatenated and sorted by their global positions. Collective
    over ``group``: one all-gather of the counts, one per tensor.

    Args:
        tensors: this rank's entries along ``dim`` (a cache layer's keys ``(batch,
            n_kv_heads, n_entries, head_dim)`` and values with ``dim=2``); ``n_entries`` may
            differ by rank.
        positions: int64 ``(n_entries,)``, the global position of each entry.
        dim: the entries' dimension.
        group: the group holding the other entries.

    Returns:
        The tensors with every rank's entries in global order along ``dim``, and their
        positions ``(n_total,)``, sorted.
    """
    coll = GroupCollectives(group)
    counts = coll.all_gather(torch.tensor([positions.numel()], device=positions.device)).view(-1).tolist()
    longest = max(counts)
    order_parts = coll.all_gather(_padded(positions, 0, longest))
    pos = torch.cat([order_parts[r, :n] for r, n in enumerate(counts)])
    order = torch.argsort(pos)
    out = []
    for t in tensors:
        parts = coll.all_gather(_padded(t, dim, longest))  # (world, ...)
        whole = torch.cat([parts[r].narrow(dim, 0, n) for r, n in enumerate(counts)], dim=dim)
        out.append(whole.index_select(dim, order.to(whole.device)))
    return out, pos[order]
