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
from hf_ring.sharding.layouts import required_multiple, shard_indices, shard_sequence

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
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.all())):
        raise NotImplementedError(
            f"{where} takes rows without padding (an attention_mask of ones, or none): prompts of different "
            "lengths, left-padded, are not supported; generate them one at a time, or with the same length"
        )
    tokens = next((inputs[n] for n in _TOKENS if inputs.get(n) is not None), None)
    if tokens is None:
        raise ValueError(f"{where} needs input_ids or inputs_embeds")
    known = {*_PER_TOKEN, *_CACHE_NAMES}
    extra = [n for n, v in inputs.items() if isinstance(v, torch.Tensor) and n not in known and v.dim() >= 2
             and tuple(v.shape[:2]) == tuple(tokens.shape[:2])]
    if extra:
        raise NotImplementedError(f"{where}: per-token inputs {extra} are not cut along the sequence; not supported")


def _positions_given(inputs: dict[str, Any], expected: torch.Tensor, where: str) -> None:
    """Refuse ``position_ids`` other than ``expected`` (int64 ``(q_len,)``) on every row."""
    given = inputs.get("position_ids")
    if given is not None and not bool((given.to(expected.device) == expected).all()):
        raise ValueError(
            f"{where}: position_ids must number the tokens from the cache's length ({int(expected[0])}) on, as "
            "generate() does for rows without padding; got others"
        )


def _prefill(base: nn.Module, inputs: dict[str, Any], cache: ShardedCache, state: ContextParallelState,
             keep: Any, cache_name: str) -> tuple[tuple, dict]:
    where = _where(state)
    tokens_name = next(n for n in _TOKENS if inputs.get(n) is not None)
    tokens = inputs[tokens_name]
    rows, length = tokens.shape[:2]
    device = tokens.device
    _positions_given(inputs, torch.arange(length, device=device), where)
    multiple = required_multiple(state.cp_size, state.layout)
    padded = math.ceil(length / multiple) * multiple
    # Padding repeats the last token at the last real position: invisible to the real tokens.
    filler = tokens[:, -1:].expand(rows, padded - length, *tokens.shape[2:])
    full = torch.cat([tokens, filler], dim=1)
    positions = torch.arange(padded, device=device).clamp(max=length - 1)[None].expand(rows, -1)
    index = shard_indices(padded, state.cp_size, state.cp_rank, state.layout)  # (local,) global rows
    cache.begin(CacheStep(index, index < length, decoding=False, length_after=length))
    out = {n: v for n, v in inputs.items() if n not in _PER_TOKEN and n not in _CACHE_NAMES}
    local_positions = shard_sequence(positions, state.cp_size, state.cp_rank, dim=1, layout=state.layout)
    out.update({
        tokens_name: shard_sequence(full, state.cp_size, state.cp_rank, dim=1, layout=state.layout),
        "position_ids": local_positions,
        cache_name: cache,
        "use_cache": True,
    })
    if "cache_position" in inputs:
        out["cache_position"] = local_positions[0]  # 4.57's layers pass it to the cache, which reads its step
    # The head's rows: logits_to_keep's last ones (an int), else all of them.
    head_rows = range(length - keep if isinstance(keep, int) and 0 < keep < length else 0, length)
    generation = Generation(cache, state.cp_group, head_rows)
    out[SHARDED_KWARG] = FullBatchShards(inputs_digest([tokens], device), generation=generation)
    return (), out


def _decode(base: nn.Module, inputs: dict[str, Any], cache: ShardedCache, state: ContextParallelState,
            cache_name: str, refused: Optional[Exception] = None) -> tuple[tuple, dict]:
    tokens = next((inputs[n] for n in _TOKENS if inputs.get(n) is not None), None)
    rows, count = tokens.shape[:2] if tokens is not None else (0, 0)
    device = tokens.device if tokens is not None else torch.device("cpu")
    positions = torch.arange(cache.length, cache.length + count, device=device)
    problem = refused
    if problem is None:
        try:
            _positions_given(inputs, positions, _where(state))
        except ValueError as e:
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
    keep = torch.ones_like(positions, dtype=torch.bool) if cache.gathered else positions % state.cp_size == state.cp_rank
    cache.begin(CacheStep(positions, keep, decoding=True, length_after=cache.length + count))
    sequence_features.hand_max_position(base, None)  # the forward holds whole rows
    context = ForwardContext(None, made_by_guard=True, handed=handed_to_the_ring(base),
                             generation=Generation(cache, None if cache.gathered else state.cp_group))
    out = {n: v for n, v in inputs.items() if n not in ("attention_mask", *_CACHE_NAMES)}
    out.update({"position_ids": positions[None].expand(rows, -1), cache_name: cache, "use_cache": True,
                CONTEXT_KWARG: context})
    if "cache_position" in inputs:
        out["cache_position"] = positions
    return (), out


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
    index = generation.cache.step.positions  # (local,) this rank's global rows
    generation.cache.end()
    rows = generation.head_rows
    if rows is None:
        return None  # a decode step: every rank holds the same rows
    hidden = output.last_hidden_state  # (batch, local, hidden)
    mine = (index >= rows.start) & (index < rows.stop)
    picked = hidden.new_zeros((hidden.shape[0], len(rows), *hidden.shape[2:]))
    picked[:, index[mine] - rows.start] = hidden[:, mine.to(hidden.device)]
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
