"""The base model's entry and exit for generation under context parallelism.

Why: ``model.generate(input_ids=<the full prompt>)`` is called on every rank of a CP group,
as one process would call it, and must give what one process gives. A forward with a cache
(or ``use_cache=True``) under an active CP state is therefore read as holding the *full*
batch on every rank, not a shard (a training forward holds shards, and takes no cache):

- **Prefill** (the cache is empty): each row's left padding (``generate()`` pads a batch of
  prompts of other lengths on the left) is moved behind its prompt, the batch is padded on
  the right to the layout's multiple (right padding is invisible to the real tokens under
  causal attention; it takes its row's last position, so that a length-dependent RoPE reads
  the prompt's own length), cut in the state's layout, and run as a training forward runs,
  through the guard's validation (the ranks' prompts, masks, positions and settings must
  agree: their digest is compared) and the ring; each attention layer keeps its shard's
  K/V, padding dropped, in a :class:`ShardedCache` (one replaces the empty cache
  ``generate()`` made; the model returns it, and ``generate()`` carries it on). The head's
  rows (each row's last ``logits_to_keep``, handed down by the head's hook, or all) are put
  together from the ranks that hold them with one all-reduce, so every rank gets the logits
  one process gets. Every rank samples the next token from its own generators: if they
  differed at the prefill (torch seeds each new process apart), the next decode step
  refuses on every rank once a rank's generator moved since the prefill (``generate()``
  sampled); greedy decoding draws nothing and runs on. A sampled token after the last
  forward (``max_new_tokens=1``, or the last of any generation) is not compared: no forward
  of hf_ring's follows its draw.
- **Hybrid models** (gated delta nets, short convolutions): the cache takes transformers' own state layers for
  the mixers; the prefill's mixers (``hf_ring.hf.mixers``) hand over each row's recurrent
  state and convolution inputs over the whole rows, which the exit writes into them; decode
  steps run transformers' own recurrent step on every rank.
- **Decode** (the cache holds the prompt): every rank holds the same new tokens and runs
  every layer on them; only attention spans the group, each rank attending its share of the
  cache (``hf_ring.hf.generation.attention``). The new tokens' K/V are kept in turn by
  column, ``column % cp_size`` (every rank once the cache was gathered). The ranks' tokens,
  their count, the cache's length and mode are compared first (one all-gather): ranks that
  sampled apart would otherwise continue from different sequences.

Refused by name, on every rank: a cache not made here or a static one, padding after a real
token, packed rows, gradients, Mamba and Kimi delta attention mixers (their states after a
CP prefill are not handed to decode yet), left padding beside mixers with biased
projections, Llama 4's attention chunks, a random draw in a prefill whose columns were moved
or padded (training mode with dropout: they would not be one process's draws).

Must not import: the Trainer, TRL, hf_ring's training or memory layers.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn as nn
from transformers.cache_utils import DynamicCache

from hf_ring.hf import sequence_features
from hf_ring.hf.forward_context import CONTEXT_KWARG, REFUSED_KWARG, SHARDED_KWARG, ForwardContext, FullBatchShards
from hf_ring.hf.generation.cache import DECODE_MODES, CacheStep, Generation, ShardedCache
from hf_ring.hf.generation.checks import (
    CACHE_NAMES, PER_TOKEN, TOKENS, cache_name, check_decode_inputs, empty_sharded, generation_under, head_columns,
    prompt_positions, refuse_inputs, refuse_left_padding_into_mixers, row_lengths,
)
from hf_ring.hf.guard import bind_arguments
from hf_ring.hf.randomness.draws import generator_digest
from hf_ring.hf.support import handed_to_the_ring
from hf_ring.patches.transformers.mixers import is_routed_layer
from hf_ring.patterns.cached import columns_of_rows
from hf_ring.patterns.state import ContextParallelState, get_context_parallel_state
from hf_ring.patterns.validation import check_agreement, inputs_digest
from hf_ring.sharding.layouts import required_multiple, shard_indices

# The head hands its logits_to_keep down to the base model under this keyword.
KEEP_KWARG = "hf_ring_logits_to_keep"
_INSTALLED = "_hf_ring_generation"
_MOVED = ("a generation prefill under CP runs each row's prompt moved before its left padding and the batch padded to "
          "the layout's multiple, so its columns are not one process's; generate in eval mode (model.eval()) or "
          "with prompts of one length, a multiple of 2 x cp_size")
_HINT = ("call model.generate(...) (or the forward) on every rank of the context-parallel group with the same "
         "prompt and the same settings, and seed every rank alike (torch.manual_seed) when sampling")


def _prefill(base: nn.Module, inputs: dict[str, Any], cache: ShardedCache, state: ContextParallelState,
             keep: Any, cache_name: str) -> tuple[tuple, dict]:
    where = generation_under(state)
    tokens_name = next(n for n in TOKENS if inputs.get(n) is not None)
    tokens = inputs[tokens_name]
    rows, length = tokens.shape[:2]
    device = tokens.device
    lengths = row_lengths(inputs, rows, length, where)  # (rows,) on the CPU
    pads = length - lengths
    if bool(pads.any()):
        refuse_left_padding_into_mixers(base, where)
    # Each row's left padding moves behind its prompt (right padding: invisible to the real
    # tokens under causal attention, so the ring needs no mask), and the batch is padded on
    # the right to the layout's multiple. Source column of each moved column, (rows, padded):
    # padding repeats the row's last token at its last position.
    multiple = required_multiple(state.cp_size, state.layout)
    padded = math.ceil(length / multiple) * multiple
    source = (torch.arange(padded)[None] + pads[:, None]).clamp(max=length - 1)
    moved = tokens.gather(1, source.to(device).view(rows, padded, *([1] * (tokens.dim() - 2)))
                          .expand(rows, padded, *tokens.shape[2:]))
    positions = prompt_positions(inputs, rows, length, where).gather(1, source)  # (rows, padded)
    steps = positions[:, 1:] - positions[:, :-1]
    if bool(((steps != 1) & (torch.arange(1, padded)[None] < lengths[:, None])).any()):
        raise NotImplementedError(f"{where} takes consecutive position_ids along each row's prompt (got others)")
    next_positions = positions.gather(1, (lengths - 1)[:, None]).view(-1) + 1
    index = shard_indices(padded, state.cp_size, state.cp_rank, state.layout)  # (local,) columns
    local = positions[:, index]
    if not cache.layers and any(is_routed_layer(m) for m in base.modules()):
        # A hybrid model: its mixers' state layers as transformers builds them, beside sharded attention.
        cache.adopt_mixer_layers(DynamicCache(config=base.config.get_text_config(decoder=True)))
    cache.begin(CacheStep(columns=index, positions=local, valid=index[None] < lengths[:, None],
                          keep=index < int(lengths.max()), next_positions=next_positions, decoding=False,
                          length_after=length, row_lengths=lengths))
    out = {n: v for n, v in inputs.items() if n not in PER_TOKEN and n not in CACHE_NAMES}
    out.update({tokens_name: moved.index_select(1, index.to(device)), "position_ids": local.to(device),
                cache_name: cache, "use_cache": True})
    head_start, head_count = head_columns(keep, lengths, length, where)
    moved_columns = padded != length or bool(pads.any())
    generation = Generation(cache, state.cp_group, head_start, head_count,
                            draws_refusal=_MOVED if moved_columns else None)
    # Everything that sizes a later collective, or that one rank alone could have otherwise.
    settings = torch.tensor([head_count, DECODE_MODES.index(cache.decode)])
    digest = inputs_digest([tokens, inputs.get("attention_mask"), inputs.get("position_ids"), settings, head_start],
                           device)
    out[SHARDED_KWARG] = FullBatchShards(digest, generation=generation)
    return (), out


def _decode(base: nn.Module, inputs: dict[str, Any], cache: ShardedCache, state: ContextParallelState,
            cache_name: str, refused: Optional[Exception] = None) -> tuple[tuple, dict]:
    tokens = next((inputs[n] for n in TOKENS if inputs.get(n) is not None), None)
    rows, count = tokens.shape[:2] if tokens is not None else (0, 0)
    device = tokens.device if tokens is not None else torch.device("cpu")
    columns = torch.arange(cache.length, cache.length + count)
    positions = cache.next_positions[:, None] + torch.arange(count)[None]  # (rows, count), each row's own
    problem = refused
    if problem is None:
        try:
            check_decode_inputs(inputs, rows, cache, positions, generation_under(state))
        except (NotImplementedError, ValueError) as e:
            problem = e
    sampled_apart = bool(cache.generators_apart) and generator_digest(device) != cache.digest_after_forward
    if problem is None and sampled_apart:
        # generate() drew from this rank's generators since the last forward: it samples, and
        # the ranks' generators differed, so their tokens are not one process's.
        problem = RuntimeError(
            f"{generation_under(state)}: generate() samples, and the ranks' random generators differ (CP ranks "
            f"{list(cache.generators_apart)} against rank 0, at the prefill); {_HINT}"
        )
    # One all-gather, whatever this rank found: a rank that refused makes every rank raise.
    fields = [("refused", int(problem is not None)), ("batch", rows), ("new_tokens", count),
              ("cache_length", cache.length), ("gathered", int(cache.gathered)), ("tokens", 0)]
    values = torch.tensor([v for _, v in fields], dtype=torch.int64, device=device)
    if tokens is not None:
        values[-1] = inputs_digest([tokens], device)
    # Tokens sampled from generators apart differ: the generators' refusal names the cause.
    found = check_agreement(state.cp_group, fields, device, "a decode step's tokens and cache", _HINT,
                            ignore=("refused", "tokens") if sampled_apart else ("refused",), values=values)
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
    out = {n: v for n, v in inputs.items() if n not in ("attention_mask", *CACHE_NAMES)}
    out.update({"position_ids": positions.to(device), cache_name: cache, "use_cache": True, CONTEXT_KWARG: context})
    if "cache_position" in inputs:
        out["cache_position"] = columns.to(device)
    return (), out


def _enter(base: nn.Module, args: tuple, kwargs: dict):
    keep = kwargs.pop(KEEP_KWARG, None)
    state = get_context_parallel_state()
    if state is None or state.cp_size == 1 or kwargs.get(CONTEXT_KWARG) is not None:
        return args, kwargs
    try:
        inputs = bind_arguments(base, args, kwargs)
    except TypeError:
        return args, kwargs  # arguments the forward does not take: let it raise its own error
    name = cache_name(base, inputs)
    cache = inputs.get(name)
    if cache is None and inputs.get("use_cache") is not True:
        return args, kwargs  # a training forward: shards, no cache
    decoding = isinstance(cache, ShardedCache) and cache.length > 0
    try:
        refuse_inputs(base, inputs, state)
        if not decoding:
            return _prefill(base, inputs, empty_sharded(cache, state), state, keep, name)
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
    if generation.conv_tails:  # a hybrid model's prefill: its mixers' convolution states over the whole rows
        for module in base.modules():
            if id(module) in generation.conv_tails:
                generation.cache.layers[module.layer_idx].conv_states[0].copy_(generation.conv_tails[id(module)])
    generation.cache.end()
    cache = generation.cache
    device = output.last_hidden_state.device
    if generation.head_start is None:  # a decode step: every rank holds the same rows
        if cache.generators_apart:
            cache.digest_after_forward = generator_digest(device)
        return None
    digests = context.draws.generator_digests if context.draws is not None else ()
    if len(set(digests)) > 1:
        # Each rank samples the next tokens from its own generators: apart, they would fork
        # silently. Greedy decoding draws nothing, so the refusal waits for a draw: the next
        # decode step compares this rank's generator with its digest now (_decode).
        cache.generators_apart = tuple(r for r, d in enumerate(digests) if d != digests[0])
        cache.digest_after_forward = generator_digest(device)
    # (rows, local, hidden) -> (rows, head_count, hidden) on every rank
    output.last_hidden_state = columns_of_rows(output.last_hidden_state, index, generation.head_start,
                                               generation.head_count, generation.group)
    if generation.cache.decode == "gathered":
        generation.cache.gather(generation.group)
    return output


def _hand_keep_down(head: nn.Module, args: tuple, kwargs: dict):
    """The head's pre-hook: under CP with a cache, its ``logits_to_keep`` goes down to the
    base model, which then puts together only those rows."""
    state = get_context_parallel_state()
    caching = kwargs.get("use_cache") is True or any(kwargs.get(n) is not None for n in CACHE_NAMES)
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
