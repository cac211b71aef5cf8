"""Whole rows back from every CP rank's shard of them.

Under context parallelism each rank holds its shard of every row (``(batch, local_seq,
...)``, in the layout's order); what a user reads per token of a whole row (TRL's
per-token log-probabilities, ``RingTrainer.predict``'s logits and labels) must be put
back together, in token order, on every rank of the CP group: an all-gather over the group
and the layout's inverse permutation. One function for both, so that the two cannot
disagree on the order.

Must not import transformers, accelerate or hf_ring's patterns (the caller hands in the
group, its size and the layout).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from hf_ring.sharding import unshard_packed, unshard_sequence


def gather_rows(local: torch.Tensor, group: Optional[dist.ProcessGroup], cp_size: int, layout: str,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Every rank's shard ``(batch, local_seq, ...)`` (any dtype, bool included) back into
    whole rows ``(batch, cp_size * local_seq, ...)`` in token order, on every rank of
    ``group`` (the CP group, of ``cp_size`` ranks, sharded by ``layout``; collective over it;
    not differentiable). ``cu_seqlens``: int ``(n_docs + 1,)``, the boundaries of a packed
    row (``batch`` 1), each document sharded on its own (``hf_ring.sharding.shard_packed``)."""
    if cp_size == 1:
        return local
    dtype = local.dtype
    send = local.to(torch.int32) if dtype == torch.bool else local  # gloo has no bool all-gather
    pieces = [torch.empty_like(send) for _ in range(cp_size)]
    dist.all_gather(pieces, send.contiguous(), group=group)
    if cu_seqlens is not None:
        return unshard_packed(pieces, cu_seqlens, dim=1).to(dtype)
    return unshard_sequence(pieces, dim=1, layout=layout).to(dtype)
