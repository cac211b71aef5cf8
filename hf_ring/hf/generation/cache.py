"""``ShardedCache``: a transformers ``Cache`` whose layers hold one rank's share of a
context-parallel group's keys and values, each entry with its column, and its position and
validity in each row.

Why: a prompt prefilled under context parallelism is cut over the ranks, and each rank's
attention layers see only their shard's K/V; kept as they are, the shards together are the
cache one process would hold (without its rows' padding), and no rank ever holds all of it.
A decode step attends every rank's share and merges the results (``hf_ring.patterns.cached``);
the new token's K/V is kept by one rank, in turn by column (round robin), so the shares stay
balanced over long outputs. With ``decode="gathered"`` the shares are gathered onto every rank once, after the
prefill, and each rank then decodes locally, holding what one process's cache holds.

What a forward brings is told to the cache before it runs (:meth:`ShardedCache.begin`, by
``hf_ring.hf.generation.entry``, which validated the forward), so ``update`` needs nothing
from the attention layer but the layer's keys and values, whatever the transformers
release passes beside them.

The cache's length (``get_seq_length``) is the group's: the number of columns of the whole
batch so far (padding included, as one process's cache counts them), which is what
``generate()`` cuts the next step's tokens by. A forward that raised midway is undone when
the next one begins, so a retry does not store its K/V twice.

Must not import: the Trainer, TRL, hf_ring's training or memory layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from transformers import cache_utils
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from hf_ring.patterns.cached import gathered_in_order

DECODE_MODES = ("sharded", "gathered")
# Token-mixer state layers (transformers 5.x; 4.57 has none, and refuses token mixers under CP).
_MIXER_STATES = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())


@dataclass(frozen=True)
class CacheStep:
    """What one forward brings to a :class:`ShardedCache`.

    The incoming tokens are *columns* of the group's padded batch: a prompt's columns with
    each row's real tokens first (left padding moved behind them: ``hf_ring.hf.generation.entry``),
    then one column per decode step, numbered on from the prompt's length.

    Attributes:
        columns: int64 ``(n_in,)``: the column of each incoming token this rank computes K/V
            for (its shard of a prompt, or the new tokens of a decode step).
        positions: int64 ``(rows, n_in)``: each incoming token's position in its row (the
            model's ``position_ids``: rows of other lengths number alike from their own start).
        valid: bool ``(rows, n_in)``: which are real tokens of their row (not padding).
        keep: bool ``(n_in,)``: which columns this rank stores (the prompt's, but padding no
            row reads; a decode step's on the rank whose turn it is).
        next_positions: int64 ``(rows,)``: the position of each row's next token, once this
            forward has run (what a sliding window measures from).
        decoding: True: ``update`` returns every entry this rank holds, which the new
            queries attend; False (a prefill): it returns the incoming K/V, which the ring
            attends.
        length_after: the group's number of columns once this forward has run.
        row_lengths: a prefill's real tokens per row, int64 ``(rows,)`` (they are its first
            columns); None for a decode step.
    """

    columns: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    keep: torch.Tensor
    next_positions: torch.Tensor
    decoding: bool
    length_after: int
    row_lengths: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Generation:
    """One forward of generation under context parallelism, handed down to its attention
    layers: the cache (whose :class:`CacheStep` says whether it is a prefill or a decode
    step), the group whose ranks hold the other shares (None once gathered: each rank
    then holds every entry) and, for a prefill, the columns whose hidden states the head
    reads: ``head_count`` of them from each row's ``head_start`` (int64 ``(rows,)``), put
    together on every rank after the forward; ``draws_refusal``: why a random draw on the
    prefill's shards would not be one process's (its columns moved or padded), or None;
    ``conv_tails``: a hybrid model's prefill, each token mixer's convolution state over the
    whole rows by the layer's id (``hf_ring.hf.mixers``), which the cache takes after it."""

    cache: "ShardedCache"
    group: Optional[dist.ProcessGroup]
    head_start: Optional[torch.Tensor] = None
    head_count: int = 0
    draws_refusal: Optional[str] = None
    conv_tails: dict = field(default_factory=dict)


class ShardedLayer(DynamicLayer):
    """One attention layer's share: ``keys`` ``(batch, n_kv_heads, n_entries, head_dim)``,
    ``values`` ``(batch, n_kv_heads, n_entries, v_dim)``, and per entry its ``columns``
    int64 ``(n_entries,)``, ``positions`` int64 ``(batch, n_entries)`` and ``valid`` bool
    ``(batch, n_entries)``, on the keys' device, in the order they came (not sorted)."""

    # ring_flash applies a layer's window itself, from the layer's own (attention.py).
    is_sliding = False
    # Assisted and contrastive decoding crop the cache: refused (crop below) before they start.
    is_croppable = False

    def __init__(self, cache: "ShardedCache") -> None:
        super().__init__()
        self._cache = cache
        self.columns: Optional[torch.Tensor] = None
        self.positions: Optional[torch.Tensor] = None
        self.valid: Optional[torch.Tensor] = None

    def _entries(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.columns, self.positions, self.valid]

    def _set_entries(self, entries: list[torch.Tensor]) -> None:
        self.keys, self.values, self.columns, self.positions, self.valid = entries

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        step = self._cache.step
        device = key_states.device
        if not self.is_initialized:
            self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
            self.columns = step.columns[:0].to(device)
            self.positions, self.valid = step.positions[:, :0].to(device), step.valid[:, :0].to(device)
            self.device, self.is_initialized = device, True
        if bool(step.keep.any()):  # the step's tensors live on the CPU: no device sync
            keep = step.keep.to(device)
            incoming = [key_states[..., keep, :], value_states[..., keep, :], step.columns.to(device)[keep],
                        step.positions.to(device)[:, keep], step.valid.to(device)[:, keep]]
            self._set_entries([torch.cat([old, new], dim=-2 if old.dim() == 4 else -1)
                               for old, new in zip(self._entries(), incoming)])
        if step.decoding:
            return self.keys, self.values
        return key_states, value_states

    def forget_before(self, first_positions: torch.Tensor) -> None:
        """Drop the entries no row will see again: row ``b`` sees positions from
        ``first_positions[b]`` on (int64 ``(batch,)``; a sliding window's reach)."""
        if self.positions is None:
            return
        needed = (self.valid & (self.positions >= first_positions.to(self.positions.device).view(-1, 1))).any(0)
        if not bool(needed.all()):
            self._set_entries([t[..., needed, :] if t.dim() == 4 else t[..., needed] for t in self._entries()])

    def gather(self, group: Optional[dist.ProcessGroup]) -> list[torch.Tensor]:
        """Every rank's entries of this layer in column order: ``[keys, values, columns,
        positions, valid]`` (collective)."""
        (keys, values), columns = gathered_in_order([self.keys, self.values], self.columns, 2, group)
        # gloo gathers no bool: the validity travels as bytes.
        (positions, valid), _ = gathered_in_order([self.positions, self.valid.to(torch.uint8)], self.columns, 1, group)
        return [keys, values, columns, positions, valid.bool()]

    def get_seq_length(self) -> int:
        return self._cache.length

    def get_mask_sizes(self, query: Any, *args: Any) -> tuple[int, int]:
        return self._cache.get_mask_sizes(query)

    def crop(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "cropping a ShardedCache (assisted or contrastive decoding) is not supported: the tokens to "
            "drop are spread over the ranks of the context-parallel group; decode greedily or by sampling"
        )

    def entry_count(self) -> int:
        return 0 if self.columns is None else self.columns.numel()

    def keep_first(self, count: int) -> None:
        """Drop every entry after the first ``count`` (a forward that failed midway)."""
        if self.columns is not None:
            self._set_entries([t[..., :count, :] if t.dim() == 4 else t[..., :count] for t in self._entries()])

    # The batch operations act on the rows, whatever this rank's share (possibly no entry).
    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._set_entries([t if t.dim() == 1 else t.repeat_interleave(repeats, dim=0) for t in self._entries()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._set_entries([t if t.dim() == 1 else t[indices] for t in self._entries()])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            index = beam_idx.to(self.device)
            self._set_entries([t if t.dim() == 1 else t.index_select(0, index) for t in self._entries()])


class ShardedCache(Cache):
    """A key/value cache for generation under context parallelism: each rank of the CP group
    holds its share of every attention layer's entries (see the module docstring).

    A forward under an active context-parallel state makes one in place of the empty cache
    ``generate()`` made (any empty, non-static ``Cache``); pass
    ``cache=ShardedCache(decode="gathered")`` (``past_key_values=`` on transformers 4.57) to
    gather the shares onto every rank after the prefill and decode locally, or
    ``ShardedCache()`` to keep a reference to it.

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
        self.next_positions: Optional[torch.Tensor] = None  # (rows,): each row's next token's position
        self.gathered = False
        # Set by a prefill whose ranks' random generators differed (greedy decoding draws
        # nothing, so that is no error by itself): the CP ranks that differed from rank 0, and
        # this rank's generator digest after the latest forward. A digest that moved by the
        # next forward means generate() sampled in between, each rank from its own generators.
        self.generators_apart: tuple[int, ...] = ()
        self.digest_after_forward: Optional[int] = None
        self._step: Optional[CacheStep] = None
        self._counts: list[int] = []  # each layer's entries when the current forward began

    @property
    def step(self) -> CacheStep:
        if self._step is None:
            raise RuntimeError(
                "a ShardedCache was updated outside a forward that hf_ring prepared: it is filled by a "
                "ring_flash model's forward under context parallelism (model.generate(...) or a forward "
                "with use_cache=True on every rank of the CP group)"
            )
        return self._step

    def adopt_mixer_layers(self, template: Cache) -> None:
        """A hybrid model's cache: ``template``'s layers (transformers' own, built from the
        model's config), its token mixers' state layers kept as they are (every rank holds the
        whole rows' states) and its attention layers sharded; a layer holding both is refused."""
        both = [i for i, layer in enumerate(template.layers)
                if isinstance(layer, CacheLayerMixin) and isinstance(layer, _MIXER_STATES)]
        if both:
            raise NotImplementedError(
                f"generation under context parallelism: layers {both} of this model's cache hold both attention "
                "K/V and token-mixer states, which the ShardedCache does not split; generate without CP"
            )
        self.layers = [ShardedLayer(self) if isinstance(layer, CacheLayerMixin) else layer for layer in template.layers]

    def _sharded_layers(self) -> list["ShardedLayer"]:
        return [layer for layer in self.layers if isinstance(layer, ShardedLayer)]

    def begin(self, step: CacheStep) -> None:
        """Tell the cache what the forward about to run brings. A forward that began and never
        ended (it raised midway, some layers having stored their K/V) is undone first; a token
        mixer's state, updated in place, is undone only for a prefill (it starts from none)."""
        if self._step is not None:
            mixers = [layer for layer in self.layers if not isinstance(layer, ShardedLayer)]
            if mixers and self._step.decoding:
                raise RuntimeError(
                    "a decode step failed midway on a ShardedCache holding token-mixer states, which it "
                    "updated in place and cannot take back; start the generation again from the prompt"
                )
            for layer in mixers:
                layer.reset()
            sharded = self._sharded_layers()
            for layer, count in zip(sharded, self._counts + [0] * (len(sharded) - len(self._counts))):
                layer.keep_first(count)  # a layer made during the failed forward keeps none
        self._step, self._counts = step, [layer.entry_count() for layer in self._sharded_layers()]

    def end(self) -> None:
        """The forward ran: its tokens count."""
        self.length, self.next_positions, self._step = self.step.length_after, self.step.next_positions, None

    @property
    def pending(self) -> bool:
        """Whether a forward began on this cache and did not end."""
        return self._step is not None

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.next_positions is not None:
            self.next_positions = self.next_positions.repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.next_positions is not None:
            self.next_positions = self.next_positions[indices.cpu()]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.next_positions is not None:
            self.next_positions = self.next_positions.index_select(0, beam_idx.cpu())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer ``layer_idx``'s K/V ``(batch, n_kv_heads, n_in, head_dim)`` as this
        forward's :class:`CacheStep` says; returns what the layer's attention attends."""
        while len(self.layers) <= layer_idx:  # a model without token mixers: built on the way
            self.layers.append(ShardedLayer(self))
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        return self.length

    def get_mask_sizes(self, query: Any, *args: Any) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` as transformers' mask builders read them (4.57 passes the
        queries' cache positions, 5.x their count); ring_flash builds no mask under CP."""
        return self.length + (query if isinstance(query, int) else int(query.shape[0])), 0

    def gather(self, group: Optional[dist.ProcessGroup]) -> None:
        """Gather every layer's shares onto every rank, in column order (collective)."""
        for layer in self._sharded_layers():
            layer._set_entries(layer.gather(group))
        self.gathered = True

    def layer_in_order(self, layer_idx: int, group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s keys and values over the whole group, in column order: for
        rows without padding, what one process's cache holds (collective unless gathered)."""
        layer = self.layers[layer_idx]
        if self.gathered:
            return layer.keys, layer.values
        keys, values = layer.gather(group)[:2]
        return keys, values
