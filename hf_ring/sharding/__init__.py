"""Sharding layer: which tokens each context-parallel rank holds (pure index math): the
layouts (zigzag, stripe, contiguous), shard / unshard, and per-document layouts of packed
rows.

Must not import torch.distributed or any other layer of hf_ring.
"""

from hf_ring.sharding.layouts import LAYOUTS, required_multiple, shard_indices, shard_sequence, unshard_sequence
from hf_ring.sharding.packed import local_cu_seqlens, packed_shard_indices, shard_packed, unshard_packed

__all__ = [
    "LAYOUTS",
    "required_multiple",
    "shard_indices",
    "shard_sequence",
    "unshard_sequence",
    "local_cu_seqlens",
    "packed_shard_indices",
    "shard_packed",
    "unshard_packed",
]
