"""``ring_flash``'s attention in the forwards of generation under context parallelism.

A decode step's queries (the new tokens, the same on every rank) attend this rank's share of
the layer's cache, merged with the other ranks' (``hf_ring.patterns.cached``), with the
layer's window (its own, or the one its model applies through the mask only), softcap and
sinks. After a prefill or a decode step, a sliding-window layer's cache forgets what its
window will not see again, so it holds at most a window of entries over the group.

Must not import: the Trainer, TRL, hf_ring's training or memory layers.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from hf_ring.hf.attention_refusals import layer_name, refuse_dropout, refuse_under_ring
from hf_ring.hf.forward_context import ForwardContext
from hf_ring.hf.generation.cache import ShardedLayer
from hf_ring.kernels.autocast import one_dtype
from hf_ring.patterns.cached import cached_attention


def _layer(module: nn.Module, context: ForwardContext, keys: torch.Tensor) -> ShardedLayer:
    layers = context.generation.cache.layers
    index = getattr(module, "layer_idx", None)
    layer = layers[index] if index is not None and index < len(layers) else None
    if layer is None or layer.keys is None or layer.keys.shape[-2] != keys.shape[-2]:
        raise NotImplementedError(
            f"{layer_name(module)} attends keys that are not its layer's entries in the ShardedCache (a model "
            "that shares or rewrites cached K/V across layers); generation under context parallelism does not "
            "support it: generate without CP, with hf_ring.context_parallel_suspended()"
        )
    return layer


def forget_outside_window(module: nn.Module, context: ForwardContext, window: Optional[int]) -> None:
    """After layer ``module`` ran, drop the entries of its cache that no later token's window
    reaches: each row's next token, at position ``p``, sees keys from ``p + 1 - window`` on."""
    if window is None:
        return
    cache = context.generation.cache
    cache.layers[module.layer_idx].forget_before(cache.step.next_positions + 1 - window)


def decode_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: Optional[float],
    window: Optional[int],
    chunk: Optional[int],
    softcap: Optional[float],
    context: ForwardContext,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """One decode step's attention in layer ``module``.

    Args:
        query: ``(batch, n_heads, q_len, head_dim)``, the new tokens' queries (every rank's alike).
        key, value: ``(batch, n_kv_heads, n_entries, head_dim / v_dim)``: this rank's entries of
            the layer's cache, as its ``update`` returned them.
        window, chunk: the layer's sliding window and attention chunk (None: none).

    Returns:
        ``((batch, q_len, n_heads, v_dim), None)`` in the query's dtype.
    """
    refuse_dropout(module, dropout)
    refuse_under_ring(module, query, query, kwargs, "generation under context parallelism")
    if chunk is not None:
        raise NotImplementedError(
            f"{layer_name(module)} attends in chunks of {chunk} tokens (Llama 4's attention_chunk_size), which "
            "decoding under context parallelism does not compute; generate without CP"
        )
    layer = _layer(module, context, key)
    query, key, value = one_dtype(query, key, value)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    generation = context.generation
    out = cached_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), layer.positions, layer.valid,
        generation.cache.step.positions, scale, window=window, softcap=softcap, sinks=kwargs.get("s_aux"),
        group=generation.group,
    )
    forget_outside_window(module, context, window)
    context.ran_ring.add(id(module))
    return out, None
