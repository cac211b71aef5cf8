"""The base model's entry and exit for generation under context parallelism.

Why: ``model.generate(input_ids=<the full prompt>)`` is called on every rank of a CP group,
as one process would call it, and must give what one process gives. A forward with a cache
(or ``use_cache=True``) under an active CP state is therefore read as holding the *full*
sequence on every rank, not a shard (a training forward holds shards, and takes no cache):

- **Prefill** (the cache is empty): the prompt is padded on the right to the layout's
  multiple (padding is invisible to the real tokens under causal attention, and is given the
  last real position so that a length-dependent RoPE reads the prompt's own length), cut in
  the state's layout, and run as a training forward runs, through the guard's validation
  (the ranks' prompts must agree: their digest is compared) and the ring; each attention
  layer keeps its shard's K/V, padding dropped, in a :class:`ShardedCache` (one replaces the
  empty ``DynamicCache`` ``generate()`` made; the model returns it, and ``generate()`` carries
  it on). The head's rows (``logits_to_keep``'s last ones, handed down by the head's hook,
  or all) are put together from the ranks that hold them with one all-reduce, so every rank
  gets the logits one process gets.
- **Decode** (the cache holds the prompt): every rank holds the same new tokens and runs
  every layer on them; only attention spans the group, each rank attending its share of the
  cache (``hf_ring.hf.generation.attention``). The new tokens' K/V are kept in turn by
  position, ``position % cp_size`` (every rank once the cache was gathered). The ranks'
  tokens, positions and cache lengths are compared first (one all-gather): ranks that
  sampled apart (seeded differently) would otherwise continue from different sequences.

Refused by name: a cache not made here, left padding (a batch of prompts of other lengths),
packed rows, gradients, token mixers (their states after a CP prefill are not handed to
decode yet), Llama 4's attention chunks (refused by the attention function).

Must not import: the Trainer, TRL, hf_ring's training or memory layers.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from transformers.cache_utils import Cache

from hf_ring.hf import sequence_features
from hf_ring.hf.forward_context import CONTEXT_KWARG, REFUSED_KWARG, SHARDED_KWARG, ForwardContext, FullBatchShards
from hf_ring.hf.generation.cache import CacheStep, Generation, ShardedCache
from hf_ring.hf.guard import bind_arguments
from hf_ring.hf.support import handed_to_the_ring
from hf_ring.patches.transformers.mixers import is_routed_layer
from hf_ring.patterns.state import ContextParallelState, get_context_parallel_state
from hf_ring.patterns.validation import check_agreement, inputs_digest
from hf_ring.sharding.layouts import required_multiple, shard_indices

# The head hands its logits_to_keep down to the base model under this keyword.
KEEP_KWARG = "hf_ring_logits_to_keep"
_CACHE_NAMES = ("cache", "past_key_values")
_TOKENS = ("input_ids", "inputs_embeds")
# Inputs a prefill cuts along the sequence, or rebuilds.
_PER_TOKEN = (*_TOKENS, "position_ids", "attention_mask", "cache_position")
_INSTALLED = "_hf_ring_generation"
_HINT = ("call model.generate(...) (or the forward) on every rank of the context-parallel group with the same "
         "prompt and the same settings, and seed every rank alike (torch.manual_seed) when sampling")


def _cache_name(base: nn.Module, inputs: dict[str, Any]) -> str:
    """What the base model calls its cache: ``cache`` (transformers 5) or ``past_key_values`` (4.57)."""
    for name in _CACHE_NAMES:
        if inputs.get(name) is not None:
            return name
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def _where(state: ContextParallelState) -> str:
    return f"generation under context parallelism (cp_size={state.cp_size})"


def _refuse(base: nn.Module, inputs: dict[str, Any], state: ContextParallelState) -> None:
    where = _where(state)
    if torch.is_grad_enabled() and any(p.requires_grad for p in base.parameters()):
        raise NotImplementedError(
            f"{where} runs without gradients: a cache is for inference. Call the model under torch.no_grad() "
            "(generate() does), or train without use_cache"
        )
    mixers = [name for name, m in base.named_modules() if is_routed_layer(m)]
    if mixers:
        raise NotImplementedError(
            f"{where}: {type(base).__name__} has token mixers ({', '.join(mixers[:3])}{', ...' if len(mixers) > 3 else ''}) "
            "whose convolution and recurrent states after a CP prefill are not yet handed to decoding; generate "
            "without CP: with hf_ring.context_parallel_suspended(): model.generate(...)"
        )
    if inputs.get("cu_seq_lens_q") is not None:
        raise NotImplementedError(f"{where}: packed rows (cu_seq_lens_q) are not generated from; pass one prompt per row")
    for name in ("output_attentions", "output_hidden_states"):
        if inputs.get(name):
            raise NotImplementedError(f"{where}: {name}=True is not supported (each rank holds a shard of them)")
    mask = inputs.get("attention_mask")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        raise NotImplementedError(f"{where} takes a 2-D attention_mask (left padding), or none")
    tokens = next((inputs[n] for n in _TOKENS if inputs.get(n) is not None), None)
    if tokens is None:
        raise ValueError(f"{where} needs input_ids or inputs_embeds")
    known = {*_PER_TOKEN, *_CACHE_NAMES}
    extra = [n for n, v in inputs.items() if isinstance(v, torch.Tensor) and n not in known and v.dim() >= 2
             and tuple(v.shape[:2]) == tuple(tokens.shape[:2])]
    if extra:
        raise NotImplementedError(f"{where}: per-token inputs {extra} are not cut along the sequence; not supported")


def _prompt_positions(inputs: dict[str, Any], rows: int, length: int, where: str) -> torch.Tensor:
    """int64 ``(rows, length)`` on the CPU: the prompt's ``position_ids``, or the model's
    default (the columns, padding counted)."""
    given = inputs.get("position_ids")
    if given is None:
        return torch.arange(length)[None].expand(rows, -1)
    if given.dim() != 2 or given.shape[-1] != length:
        raise NotImplementedError(f"{where} takes position_ids of shape (rows, {length}); got {tuple(given.shape)}")
    return given.cpu().expand(rows, -1)


def _row_lengths(inputs: dict[str, Any], rows: int, length: int, where: str) -> torch.Tensor:
    """int64 ``(rows,)``: each row's real tokens, from a left-padding mask (ones: none)."""
    mask = inputs.get("attention_mask")
    if mask is None:
        return torch.full((rows,), length, dtype=torch.int64)
    mask = mask.to(torch.bool).cpu()
    lengths = mask.sum(1)
    if not torch.equal(mask, torch.arange(length)[None] >= (length - lengths)[:, None]) or not bool(lengths.all()):
        raise NotImplementedError(
            f"{where} takes rows left-padded as generate() pads them (padding first, then the prompt): this "
            "attention_mask has padding after a real token, or an empty row"
        )
    return lengths


def _prefill(base: nn.Module, inputs: dict[str, Any], cache: ShardedCache, state: ContextParallelState,
             keep: Any, cache_name: str) -> tuple[tuple, dict]:
    where = _where(state)
    tokens_name = next(n for n in _TOKENS if inputs.get(n) is not None)
    tokens = inputs[tokens_name]
    rows, length = tokens.shape[:2]
    device = tokens.device
    lengths = _row_lengths(inputs, rows, length, where)  # (rows,) on the CPU
    pads = length - lengths
    # Each row's left padding moves behind its prompt (right padding: invisible to the real
    # tokens under causal attention, so the ring needs no mask), and the batch is padded on
    # the right to the layout's multiple. Source column of each moved column, (rows, padded):
    # padding repeats the row's last token at its last position.
    multiple = required_multiple(state.cp_size, state.layout)
    padded = math.ceil(length / multiple) * multiple
    source = (torch.arange(padded)[None] + pads[:, None]).clamp(max=length - 1)
    moved = tokens.gather(1, source.to(device).view(rows, padded, *([1] * (tokens.dim() - 2)))
                          .expand(rows, padded, *tokens.shape[2:]))
    positions = _prompt_positions(inputs, rows, length, where).gather(1, source)  # (rows, padded)
    steps = positions[:, 1:] - positions[:, :-1]
    if bool(((steps != 1) & (torch.arange(1, padded)[None] < lengths[:, None])).any()):
        raise NotImplementedError(f"{where} takes consecutive position_ids along each row's prompt (got others)")
    next_positions = positions.gather(1, (lengths - 1)[:, None]).view(-1) + 1
    index = shard_indices(padded, state.cp_size, state.cp_rank, state.layout)  # (local,) columns
    local = positions[:, index]
    cache.begin(CacheStep(columns=index, positions=local, valid=index[None] < lengths[:, None],
                          keep=index < int(lengths.max()), next_positions=next_positions, decoding=False,
                          length_after=length))
    out = {n: v for n, v in inputs.items() if n not in _PER_TOKEN and n not in _CACHE_NAMES}
    out.update({tokens_name: moved.index_select(1, index.to(device)), "position_ids": local.to(device),
                cache_name: cache, "use_cache": True})
    if "cache_position" in inputs:
        out["cache_position"] = index.to(device)  # 4.57's layers hand it to the cache, which reads its step
    generation = Generation(cache, state.cp_group, *_head_columns(keep, lengths, length, where))
    out[SHARDED_KWARG] = FullBatchShards(inputs_digest([tokens, inputs.get("attention_mask")], device),
                                         generation=generation)
    return (), out


def _head_columns(keep: Any, lengths: torch.Tensor, length: int, where: str) -> tuple[torch.Tensor, int]:
    """The columns of the moved batch whose hidden states the head reads: each row's last
    ``logits_to_keep`` (``(rows,)`` first columns, and their count), or every column."""
    if isinstance(keep, int) and 0 < keep <= int(lengths.min()):
        return lengths - keep, keep
    if bool((lengths == length).all()):
        return torch.zeros_like(lengths), length
    raise NotImplementedError(
        f"{where} with left padding computes the logits of each row's last tokens only (logits_to_keep, "
        f"1 in generate()), at most its shortest prompt's {int(lengths.min())}; got logits_to_keep={keep!r}"
    )


def _decode(base: nn.Module, inputs: dict[str, Any], cache: ShardedCache, state: ContextParallelState,
            cache_name: str, refused: Optional[Exception] = None) -> tuple[tuple, dict]:
    tokens = next((inputs[n] for n in _TOKENS if inputs.get(n) is not None), None)
    rows, count = tokens.shape[:2] if tokens is not None else (0, 0)
    device = tokens.device if tokens is not None else torch.device("cpu")
    columns = torch.arange(cache.length, cache.length + count)
    positions = cache.next_positions[:, None] + torch.arange(count)[None]  # (rows, count), each row's own
    problem = refused
    if problem is None:
        try:
            _decode_inputs(inputs, rows, cache, positions, _where(state))
        except (NotImplementedError, ValueError) as e:
            problem = e
    # One all-gather, whatever this rank found: a rank that refused makes every rank raise.
    fields = [("refused", int(problem is not None)), ("batch", rows), ("new_tokens", count),
              ("cache_length", cache.length), ("gathered", int(cache.gathered)), ("tokens", 0)]
    values = torch.tensor([v for _, v in fields], dtype=torch.int64, device=device)
    if tokens is not None:
        values[-1] = inputs_digest([tokens], device)
    found = check_agreement(state.cp_group, fields, device, "a decode step's tokens and cache", _HINT,
                            ignore=("refused",), values=values)
    if problem is not None:
        raise problem
    if any(row[0] for row in found):
        raise ValueError(f"CP rank(s) {[r for r, row in enumerate(found) if row[0]]} refused this decode step "
                         f"(see the error there); {_HINT}")
    keep = torch.ones_like(columns, dtype=torch.bool) if cache.gathered else columns % state.cp_size == state.cp_rank
    cache.begin(CacheStep(columns=columns, positions=positions, valid=torch.ones_like(positions, dtype=torch.bool),
                          keep=keep, next_positions=positions[:, -1] + 1, decoding=True,
                          length_after=cache.length + count))
    sequence_features.hand_max_position(base, None)  # the forward holds whole rows
    context = ForwardContext(None, made_by_guard=True, handed=handed_to_the_ring(base),
                             generation=Generation(cache, None if cache.gathered else state.cp_group))
    out = {n: v for n, v in inputs.items() if n not in ("attention_mask", *_CACHE_NAMES)}
    out.update({"position_ids": positions.to(device), cache_name: cache, "use_cache": True, CONTEXT_KWARG: context})
    if "cache_position" in inputs:
        out["cache_position"] = columns.to(device)
    return (), out


def _decode_inputs(inputs: dict[str, Any], rows: int, cache: ShardedCache, positions: torch.Tensor, where: str) -> None:
    """Refuse a decode step that does not continue the prefilled rows: other rows, new tokens
    masked as padding, positions other than each row's next."""
    if rows != cache.next_positions.shape[0]:
        raise ValueError(f"{where}: a decode step of {rows} rows onto a cache of {cache.next_positions.shape[0]}")
    mask = inputs.get("attention_mask")
    if mask is not None and not bool(mask[:, -positions.shape[1]:].all()):
        raise NotImplementedError(f"{where}: a decode step's new tokens are masked as padding; not supported")
    given = inputs.get("position_ids")
    if given is not None and not torch.equal(given.cpu().expand_as(positions), positions):
        raise ValueError(f"{where}: a decode step's position_ids must continue each row's positions "
                         f"({positions[:, 0].tolist()} next); got {given[:, 0].tolist()}")


def _empty_sharded(cache: Any, state: ContextParallelState) -> ShardedCache:
    """The cache a prefill fills: the one given, or one replacing the empty cache generate() made."""
    if isinstance(cache, ShardedCache):
        return cache
    if cache is not None and not (isinstance(cache, Cache) and cache.get_seq_length() == 0):
        raise NotImplementedError(
            f"{_where(state)} got a {type(cache).__name__} that already holds tokens; under CP the cache is "
            "hf_ring's ShardedCache, filled by a prefill on every rank: start from an empty cache"
        )
    return ShardedCache()


def _enter(base: nn.Module, args: tuple, kwargs: dict):
    keep = kwargs.pop(KEEP_KWARG, None)
    state = get_context_parallel_state()
    if state is None or state.cp_size == 1 or kwargs.get(CONTEXT_KWARG) is not None:
        return args, kwargs
    try:
        inputs = bind_arguments(base, args, kwargs)
    except TypeError:
        return args, kwargs  # arguments the forward does not take: let it raise its own error
    name = _cache_name(base, inputs)
    cache = inputs.get(name)
    if cache is None and inputs.get("use_cache") is not True:
        return args, kwargs  # a training forward: shards, no cache
    decoding = isinstance(cache, ShardedCache) and cache.length > 0
    try:
        _refuse(base, inputs, state)
        if not decoding:
            return _prefill(base, inputs, _empty_sharded(cache, state), state, keep, name)
    except (NotImplementedError, ValueError) as e:
        if decoding:
            return _decode(base, inputs, cache, state, name, refused=e)
        # Raised by the guard once its header went round, so that every rank of the group raises.
        return args, {**kwargs, REFUSED_KWARG: e}
    return _decode(base, inputs, cache, state, name)


def _exit(base: nn.Module, args: tuple, kwargs: dict, output: Any):
    context: Optional[ForwardContext] = kwargs.get(CONTEXT_KWARG)
    if context is None or context.generation is None:
        return None
    generation = context.generation
    index = generation.cache.step.columns  # (local,) this rank's columns
    generation.cache.end()
    if generation.head_start is None:
        return None  # a decode step: every rank holds the same rows
    hidden = output.last_hidden_state  # (rows, local, hidden)
    picked = hidden.new_zeros((hidden.shape[0], generation.head_count, *hidden.shape[2:]))
    for row, start in enumerate(generation.head_start.tolist()):
        mine = (index >= start) & (index < start + generation.head_count)
        picked[row, index[mine] - start] = hidden[row, mine.to(hidden.device)]
    # Each row is held by one rank and is zero on the others: the sum is exact.
    dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=generation.group)
    output.last_hidden_state = picked
    if generation.cache.decode == "gathered":
        generation.cache.gather(generation.group)
    return output


def _hand_keep_down(head: nn.Module, args: tuple, kwargs: dict):
    """The head's pre-hook: under CP with a cache, its ``logits_to_keep`` goes down to the
    base model, which then puts together only those rows."""
    state = get_context_parallel_state()
    caching = kwargs.get("use_cache") is True or any(kwargs.get(n) is not None for n in _CACHE_NAMES)
    if state is None or state.cp_size == 1 or not caching or kwargs.get("logits_to_keep") is None:
        return None
    return args, {**kwargs, KEEP_KWARG: kwargs["logits_to_keep"]}


def install_generation(model: nn.Module) -> None:
    """Put the generation hooks on ``model``'s base model (and its head), after the guard
    (idempotent)."""
    base = getattr(model, "base_model", model)
    if _INSTALLED in base.__dict__:
        return
    base.register_forward_pre_hook(_enter, with_kwargs=True, prepend=True)
    base.register_forward_hook(_exit, with_kwargs=True)
    if base is not model:
        model.register_forward_pre_hook(_hand_keep_down, with_kwargs=True)
    base.__dict__[_INSTALLED] = True
