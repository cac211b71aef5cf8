"""What a forward of generation under context parallelism must hold, checked on each rank:
the inputs (:func:`refuse_inputs`), a prompt batch's rows (left padding, positions, the
head's columns), a decode step's inputs, the cache to fill.

Why apart from the hooks (entry.py): each check raises on the rank that finds the problem,
and the hooks hand what was raised to a collective (the guard's header for a prefill, the
decode step's agreement), so that every rank of the group raises together; the checks
themselves are plain reads of the inputs.

Must not import: the Trainer, TRL, hf_ring's training or memory layers.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn
from transformers.cache_utils import Cache

from hf_ring.hf.generation.cache import ShardedCache
from hf_ring.hf.support import handed_to_the_ring
from hf_ring.patches.transformers.mixers import GATED_DELTA_NET, SHORT_CONV, is_routed_layer, route_of
from hf_ring.patterns.state import ContextParallelState

CACHE_NAMES = ("cache", "past_key_values")
# The token mixers whose states after a CP prefill are handed to decoding (hf_ring.hf.mixers).
STATES_HANDED_OVER = (GATED_DELTA_NET, SHORT_CONV)
TOKENS = ("input_ids", "inputs_embeds")
# Inputs a prefill cuts along the sequence, or rebuilds; cache_position (4.57) is left out, and
# the model numbers the shard from 0 as in a training forward (the ring and Llama 4's
# temperature read the global positions from the guard's context).
PER_TOKEN = (*TOKENS, "position_ids", "attention_mask", "cache_position")


def cache_name(base: nn.Module, inputs: dict[str, Any]) -> str:
    """What the base model calls its cache: ``cache`` (transformers 5) or ``past_key_values`` (4.57)."""
    for name in CACHE_NAMES:
        if inputs.get(name) is not None:
            return name
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def generation_under(state: ContextParallelState) -> str:
    """What the errors name."""
    return f"generation under context parallelism (cp_size={state.cp_size})"


def refuse_inputs(base: nn.Module, inputs: dict[str, Any], state: ContextParallelState) -> None:
    """Refuse what generation under CP does not compute exactly, naming it: gradients, attention
    chunks, token mixers whose states are not handed over (Mamba, Kimi delta attention), packed
    rows, per-shard outputs, masks other than 2-D, per-token inputs it does not know how to cut."""
    where = generation_under(state)
    if torch.is_grad_enabled() and any(p.requires_grad for p in base.parameters()):
        raise NotImplementedError(
            f"{where} runs without gradients: a cache is for inference. Call the model under torch.no_grad() "
            "(generate() does), or train without use_cache"
        )
    chunks = handed_to_the_ring(base).chunks
    if chunks:
        raise NotImplementedError(
            f"{where}: layers {sorted(chunks)} attend in chunks (Llama 4's attention_chunk_size), which decoding "
            "under CP does not compute; generate without CP: with hf_ring.context_parallel_suspended()"
        )
    mixers = [name for name, m in base.named_modules()
              if is_routed_layer(m) and route_of(type(m)).runs not in STATES_HANDED_OVER]
    if mixers:
        raise NotImplementedError(
            f"{where}: {type(base).__name__} has token mixers ({', '.join(mixers[:3])}"
            f"{', ...' if len(mixers) > 3 else ''}: Mamba, short convolutions or Kimi delta attention) "
            "whose convolution and recurrent states after a CP prefill are not yet handed to decoding (gated "
            "delta nets' are); generate without CP: with hf_ring.context_parallel_suspended(): model.generate(...)"
        )
    if inputs.get("cu_seq_lens_q") is not None:
        raise NotImplementedError(
            f"{where}: packed rows (cu_seq_lens_q) are not generated from; pass one prompt per row")
    for name in ("output_attentions", "output_hidden_states"):
        if inputs.get(name):
            raise NotImplementedError(f"{where}: {name}=True is not supported (each rank holds a shard of them)")
    mask = inputs.get("attention_mask")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        raise NotImplementedError(f"{where} takes a 2-D attention_mask (left padding), or none")
    tokens = next((inputs[n] for n in TOKENS if inputs.get(n) is not None), None)
    if tokens is None:
        raise ValueError(f"{where} needs input_ids or inputs_embeds")
    known = {*PER_TOKEN, *CACHE_NAMES}
    extra = [n for n, v in inputs.items() if isinstance(v, torch.Tensor) and n not in known and v.dim() >= 2
             and tuple(v.shape[:2]) == tuple(tokens.shape[:2])]
    if extra:
        raise NotImplementedError(f"{where}: per-token inputs {extra} are not cut along the sequence; not supported")


def refuse_left_padding_into_mixers(base: nn.Module, where: str) -> None:
    """Left padding beside token mixers is exact where a padding token feeds them zeros (the
    model zeroes its hidden states, and no projection adds a bias): one process's mixers then
    start each row from the state they start it from alone, which is what hf_ring's prefill
    computes. A bias inside a mixer layer would feed them something else: refused."""
    biased = [name for name, m in base.named_modules() if is_routed_layer(m)
              and any(isinstance(sub, nn.Linear) and sub.bias is not None for sub in m.modules())]
    if biased:
        raise NotImplementedError(
            f"{where}: left-padded rows beside token mixers whose projections add a bias ({biased[0]}, ...): one "
            "process feeds their padding the bias, which hf_ring's prefill does not reproduce; generate prompts of "
            "one length"
        )


def prompt_positions(inputs: dict[str, Any], rows: int, length: int, where: str) -> torch.Tensor:
    """int64 ``(rows, length)`` on the CPU: the prompt's ``position_ids``, or the model's
    default (the columns, padding counted)."""
    given = inputs.get("position_ids")
    if given is None:
        return torch.arange(length)[None].expand(rows, -1)
    if given.dim() != 2 or given.shape[-1] != length:
        raise NotImplementedError(f"{where} takes position_ids of shape (rows, {length}); got {tuple(given.shape)}")
    return given.cpu().expand(rows, -1)


def row_lengths(inputs: dict[str, Any], rows: int, length: int, where: str) -> torch.Tensor:
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


def head_columns(keep: Any, lengths: torch.Tensor, length: int, where: str) -> tuple[torch.Tensor, int]:
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


def check_decode_inputs(inputs: dict[str, Any], rows: int, cache: ShardedCache, positions: torch.Tensor,
                        where: str) -> None:
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


def empty_sharded(cache: Any, state: ContextParallelState) -> ShardedCache:
    """The cache a prefill fills: the one given, or one replacing the empty cache generate() made."""
    if isinstance(cache, ShardedCache):
        return cache
    if isinstance(cache, Cache) and cache.is_compileable:
        raise NotImplementedError(
            f"{generation_under(state)} got a static {type(cache).__name__} (cache_implementation='static' or a static "
            "kind): under CP the cache is hf_ring's ShardedCache; leave cache_implementation unset"
        )
    if cache is not None and not (isinstance(cache, Cache) and cache.get_seq_length() == 0):
        raise NotImplementedError(
            f"{generation_under(state)} got a {type(cache).__name__} that already holds tokens; under CP the cache is "
            "hf_ring's ShardedCache, filled by a prefill on every rank: start from an empty cache"
        )
    return ShardedCache()
