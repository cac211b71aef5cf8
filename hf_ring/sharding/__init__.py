"""Sharding layer: which tokens each context-parallel rank holds (pure index math): the
layouts (zigzag, stripe, contiguous), shard / unshard, and per-document layouts of packed
rows, and the placement of a packed row's documents by length (whole on one rank, or sharded).

Must not import torch.distributed or any other layer of hf_ring.
"""

from hf_ring.sharding.layouts import LAYOUTS, required_multiple, shard_indices, shard_sequence, unshard_sequence
from hf_ring.sharding.packed import local_cu_seqlens, packed_shard_indices, shard_packed, unshard_packed
from hf_ring.sharding.placement import DocumentPlacement, PlacementCosts, place_by_length, shard_placed
from hf_ring.sharding.placement_auto import place_auto

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
    "DocumentPlacement",
    "PlacementCosts",
    "place_auto",
    "place_by_length",
    "shard_placed",
]
