"""``ShardedCache``: a transformers ``Cache`` whose layers hold one rank's share of a
context-parallel group's keys and values, each entry with its global position.

Why: a prompt prefilled under context parallelism is cut over the ranks, and each rank's
attention layers see only their shard's K/V; kept as they are, the shards together are the
cache one process would hold, and no rank ever holds all of it. A decode step attends every
rank's share and merges the results (``hf_ring.patterns.cached``); the new token's K/V is
kept by one rank, in turn by position (round robin), so the shares stay balanced over long
outputs. With ``decode="gathered"`` the shares are gathered onto every rank once, after the
prefill, and each rank then decodes locally, holding what one process's cache holds.

What a forward brings is told to the cache before it runs (:meth:`ShardedCache.begin`, by
``hf_ring.hf.generation.entry``, which validated the forward), so ``update`` needs nothing
from the attention layer but the layer's keys and values, whatever the transformers
release passes beside them.

The cache's length (``get_seq_length``) is the group's: the number of tokens of the whole
sequence so far, which is what ``generate()`` and the model number new positions from.

Must not import: the Trainer, TRL, hf_ring's training or memory layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from transformers.cache_utils import Cache, DynamicLayer

from hf_ring.patterns.cached import gathered_in_order

DECODE_MODES = ("sharded", "gathered")


@dataclass(frozen=True)
class CacheStep:
    """What one forward brings to a :class:`ShardedCache`.

    Attributes:
        positions: int64 ``(n_in,)``: the global position of each incoming token this rank
            computes K/V for (its shard of a prompt, or the new tokens of a decode step).
        keep: bool ``(n_in,)``: which of them this rank stores (a prompt's real tokens, not
            its padding; a new token on the rank whose turn it is).
        decoding: True: ``update`` returns every entry this rank holds, which the new
            queries attend; False (a prefill): it returns the incoming K/V, which the ring
            attends.
        length_after: the group's number of tokens once this forward has run.
    """

    positions: torch.Tensor
    keep: torch.Tensor
    decoding: bool
    length_after: int


@dataclass(frozen=True)
class Generation:
    """One forward of generation under context parallelism, handed down to its attention
    layers: the cache (whose :class:`CacheStep` says whether it is a prefill or a decode
    step), the group whose ranks hold the other shares (None once gathered: each rank
    then holds every entry) and, for a prefill, the global rows of the prompt whose hidden
    states the head reads (put together on every rank after the forward)."""

    cache: "ShardedCache"
    group: Optional[dist.ProcessGroup]
    head_rows: Optional[range] = None


class ShardedLayer(DynamicLayer):
    """One attention layer's share: ``keys`` ``(batch, n_kv_heads, n_entries, head_dim)``,
    ``values`` ``(batch, n_kv_heads, n_entries, v_dim)``, ``positions`` int64
    ``(n_entries,)`` on the keys' device, in the order they came (not sorted)."""

    is_sliding = False  # a layer's window is applied by ring_flash, from the layer's own

    def __init__(self, cache: "ShardedCache") -> None:
        super().__init__()
        self._cache = cache
        self.positions: Optional[torch.Tensor] = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        step = self._cache.step
        if not self.is_initialized:
            self.keys = key_states[..., :0, :]
            self.values = value_states[..., :0, :]
            self.positions = step.positions[:0].to(key_states.device)
            self.device, self.is_initialized = key_states.device, True
        keep = step.keep.to(key_states.device)
        if bool(keep.any()):
            self.keys = torch.cat([self.keys, key_states[..., keep, :]], dim=-2)
            self.values = torch.cat([self.values, value_states[..., keep, :]], dim=-2)
            self.positions = torch.cat([self.positions, step.positions.to(key_states.device)[keep]])
        if step.decoding:
            return self.keys, self.values
        return key_states, value_states

    def forget_before(self, position: int) -> None:
        """Drop the entries before ``position``: what a sliding window will not see again."""
        if self.positions is not None and bool((self.positions < position).any()):
            kept = self.positions >= position
            self.keys, self.values = self.keys[..., kept, :], self.values[..., kept, :]
            self.positions = self.positions[kept]

    def get_seq_length(self) -> int:
        return self._cache.length

    def get_mask_sizes(self, query: Any, *args: Any) -> tuple[int, int]:
        return self._cache.get_mask_sizes(query)

    def crop(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "cropping a ShardedCache (assisted or contrastive decoding) is not supported: the tokens to "
            "drop are spread over the ranks of the context-parallel group; decode greedily or by sampling"
        )


class ShardedCache(Cache):
    """A key/value cache for generation under context parallelism: each rank of the CP group
    holds its share of every attention layer's entries (see the module docstring).

    ``generate()`` under an active context-parallel state makes one when it would have made a
    ``DynamicCache``; pass ``cache=ShardedCache(decode="gathered")`` (``past_key_values=`` on
    transformers 4.57) to gather the shares onto every rank after the prefill and decode
    locally, or ``ShardedCache()`` to keep a reference to it.

    Args:
        decode: ``"sharded"`` (each new token's queries attend every rank's share, one
            all-gather per layer and token) or ``"gathered"`` (every rank holds the whole
            cache after the prefill; no collective while decoding).
    """

    def __init__(self, decode: Literal["sharded", "gathered"] = "sharded") -> None:
        if decode not in DECODE_MODES:
            raise ValueError(f"ShardedCache(decode={decode!r}): choose one of {DECODE_MODES}")
        super().__init__(layers=[])
        self.decode = decode
        self.length = 0
        self.gathered = False
        self._step: Optional[CacheStep] = None

    @property
    def step(self) -> CacheStep:
        if self._step is None:
            raise RuntimeError(
                "a ShardedCache was updated outside a forward that hf_ring prepared: it is filled by a "
                "ring_flash model's forward under context parallelism (model.generate(...) or a forward "
                "with use_cache=True on every rank of the CP group)"
            )
        return self._step

    def begin(self, step: CacheStep) -> None:
        """Tell the cache what the forward about to run brings."""
        self._step = step

    def end(self) -> None:
        """The forward ran: its tokens count."""
        self.length, self._step = self.step.length_after, None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer ``layer_idx``'s K/V ``(batch, n_kv_heads, n_in, head_dim)`` as this
        forward's :class:`CacheStep` says; returns what the layer's attention attends."""
        while len(self.layers) <= layer_idx:
            self.layers.append(ShardedLayer(self))
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        return self.length

    def get_mask_sizes(self, query: Any, *args: Any) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` as transformers' mask builders read them (4.57 passes the
        queries' cache positions, 5.x their count); ring_flash builds no mask under CP."""
        return self.length + (query if isinstance(query, int) else int(query.shape[0])), 0

    def gather(self, group: Optional[dist.ProcessGroup]) -> None:
        """Gather every layer's shares onto every rank, in global order (collective)."""
        for layer in self.layers:
            (layer.keys, layer.values), layer.positions = gathered_in_order(
                [layer.keys, layer.values], layer.positions, 2, group)
        self.gathered = True

    def layer_in_order(self, layer_idx: int, group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s keys and values over the whole group, in global order: what
        one process's cache holds (collective unless gathered already)."""
        layer = self.layers[layer_idx]
        if self.gathered:
            return layer.keys, layer.values
        (keys, values), _ = gathered_in_order([layer.keys, layer.values], layer.positions, 2, group)
        return keys, values
