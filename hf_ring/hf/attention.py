"""The attention function registered with transformers as ``attn_implementation="ring_flash"``.

Every attention layer of a model loaded with ``ring_flash`` calls
``ring_flash_attention_forward``. The model's guard (``hf_ring.hf.guard``) validated the
forward's inputs once and hands a :class:`~hf_ring.hf.forward_context.ForwardContext`
down through the forward's keyword arguments; what this function does depends on it:

- No context-parallel state in the context (none active, or ``cp_size == 1``): exact
  local attention. It delegates to transformers' own SDPA attention function with the
  mask transformers built for SDPA (``hf_ring.hf.mask``), so padding masks, sliding
  windows, KV caches and ``generate()`` behave exactly as with ``attn_implementation="sdpa"``.
- ``cp_size > 1``: each rank holds a shard of the sequence; q, k, v are moved to the
  flash layout and handed, with the context's plan for this kind of layer (built once per
  forward: the state's pattern, ``"auto"`` resolved per kind of layer, the kernel resolved
  for the layer's features), to ``hf_ring.patterns.run.run_plan``, the entry point every
  pattern runs through, with no collective but the pattern's own transfers and no host
  sync. Inputs were validated by the guard: global position_ids, right
  padding only (which a causal mask makes harmless, so the mask is dropped), and a cache
  only in generation (a prefill's layers keep their shard's K/V in it as the ring runs).
- Generation under CP, a decode step (``hf_ring.hf.generation``): the new tokens' queries,
  the same on every rank, against this rank's share of the layer's cache, merged across the
  group (``generation/attention.py``).
- Without a context under CP (an unguarded model, or one that does not hand its keyword
  arguments to its attention layers) it refuses rather than attend within the shard.
- Packed rows (``cu_seq_lens_q`` among the kwargs, see the collator contract), with or
  without CP: the varlen ring, documents never attending to each other; batch size 1.

Attention sinks (GPT-OSS's ``s_aux``) are computed, with and without CP, and so are the
sliding windows a layer passes as ``sliding_window`` or applies through its mask only,
Llama 4's attention chunks (handed down by the guard, ``hf_ring.hf.sequence_features``) and
logit softcapping (Gemma 2's ``softcap``) on dense rows (without CP: sinks and softcapping
eagerly, local_eager.py, windows and chunks through transformers' mask; under CP: by the
pattern, which refuses, naming one that computes it, what it or its kernel does not).
On packed rows, with or without CP, the varlen ring computes sinks and sliding windows
(inside each document) and refuses chunks and softcapping. What ``ring_flash`` cannot
compute is refused, naming the model feature (attention_refusals.py): attention dropout,
keywords such as a sparse indexer's ``indices`` or a ``position_bias``, non-causal
attention; what is read from the model's config and structure once
per forward (token mixers, chunks on packed rows, ...) is refused by ``hf_ring.hf.support``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_ring.hf.compiled import compiled_attention
from hf_ring.hf.attention_refusals import (
    is_causal, layer_name, refuse_dropout, refuse_softcap_on_packed, refuse_uncomputed,
    refuse_under_ring, refuse_without_context,
)
from hf_ring.hf.forward_context import CONTEXT_KWARG, ForwardContext
from hf_ring.hf.generation.attention import decode_attention, forget_outside_window
from hf_ring.hf.guard import RING_FLASH
from hf_ring.hf.multimodal import guard_model
from hf_ring.hf.local_eager import eager_attention
from hf_ring.hf.sequence_features import global_query_temperature, layer_window_and_chunk
from hf_ring.patterns.api import ring_flash_attn_varlen_func
from hf_ring.patterns.run import run_plan
from hf_ring.kernels.autocast import one_dtype

# guard_model is re-exported: models loaded with "ring_flash" are guarded automatically,
# one whose config was set by hand is guarded with hf_ring.hf.attention.guard_model(model).
__all__ = ["guard_model", "ring_flash_attention_forward"]


def _local_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float,
    scaling: Optional[float],
    sliding_window: Optional[int],
    softcap: Optional[float],
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    if attention_mask is not None and attention_mask.dim() != 4:
        raise ValueError(
            f"{layer_name(module)} passed a {attention_mask.dim()}-D attention mask to ring_flash: this "
            "model treats ring_flash as a flash-attention kernel (flash masks are 2-D), but ring_flash "
            "takes the 4-D masks transformers builds for SDPA; the model is not supported"
        )
    sinks = kwargs.pop("s_aux", None)
    if sinks is not None or softcap is not None:
        refuse_dropout(module, dropout)  # hf_ring's eager path draws none
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = eager_attention(query, key, value, attention_mask, scale, is_causal(module, kwargs), sinks, softcap)
        return out, None
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    return sdpa(
        module, query, key, value, attention_mask,
        dropout=dropout, scaling=scaling, sliding_window=sliding_window, **kwargs,
    )


def _ring_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float],
    sliding_window: Optional[int],
    softcap: Optional[float],
    chunk: Optional[int],
    context: ForwardContext,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    refuse_under_ring(module, query, key, kwargs, "ring_flash under context parallelism",
                      causal_by_mask=context.causal_by_mask)
    if attention_mask is not None:
        raise ValueError(
            f"{layer_name(module)} received a {attention_mask.dim()}-D attention mask under context "
            "parallelism; ring_flash computes causal attention over the global positions and takes "
            "no mask (right padding is accepted at the model's input and needs none)"
        )
    seq = query.shape[-2] * context.cp_size
    # transformers' window keeps key j for query i when i - j < window: one of at least the
    # sequence masks nothing, and the plan runs without it (any backend).
    window = sliding_window if sliding_window is not None and sliding_window < seq else None
    query, key, value = one_dtype(query, key, value)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    try:
        plan = context.plan(q, k.shape[2], scale, window, softcap, v.shape[3], chunk)
    except NotImplementedError as e:
        # A feature the pattern or its kernel does not compute; every rank resolves the same
        # pattern and kernel, so all raise alike.
        features = ", ".join(f"{n}={v}" for n, v in (("sliding_window", window), ("softcap", softcap),
                                                      ("attention_chunk_size", chunk)) if v is not None)
        raise NotImplementedError(
            f"{layer_name(module)} under context parallelism (pattern {context.state.pattern!r}, "
            f"{seq} tokens{', ' + features if features else ''}): {e}"
        ) from e
    out, _ = run_plan(q, k, v, plan, kwargs.get("s_aux"))
    if context.generation is not None:
        forget_outside_window(module, context, sliding_window)  # a prefill's cache keeps what decoding sees
    context.ran_ring.add(id(module))
    return out, None


def _run_packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: Optional[float],
    context: ForwardContext,
    sinks: Optional[torch.Tensor],
    window: Optional[int],
    chunk: Optional[int],
) -> torch.Tensor:
    """transformers' ``(batch, heads, seq_local, dim)`` through the forward's (varlen) ring
    plan, with the layer's attention sinks (``s_aux``, ``(heads,)``) if it has them, its
    sliding window (inside each document) and its attention chunk (refused by the plan on
    packed rows); returns ``(batch, seq_local, heads, dim)``. No collective but the ring's
    transfers."""
    query, key, value = one_dtype(query, key, value)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    plan = context.plan(q, k.shape[2], scale, window, value_head_dim=v.shape[3], chunk=chunk)
    out, _ = run_plan(q, k, v, plan, sinks)
    return out


def _packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: Optional[float],
    sliding_window: Optional[int],
    chunk: Optional[int],
    context: Optional[ForwardContext],
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    what = "ring_flash on packed rows"
    if query.shape[0] != 1:
        raise ValueError(
            f"packed rows (cu_seq_lens_q given) must come with batch size 1, got {query.shape[0]}; "
            "concatenate the documents into one row"
        )
    refuse_under_ring(module, query, key, kwargs, what)
    if context is None:
        # An unguarded model without context parallelism: the boundaries are read here.
        _refuse_unguarded_packed()
        out = _packed_without_context(query, key, value, scaling, sliding_window, kwargs)
        return out, None
    out = _run_packed(query, key, value, scaling, context, kwargs.get("s_aux"), sliding_window, chunk)
    if context.state is not None:
        context.ran_ring.add(id(module))
    return out, None


def _refuse_unguarded_packed() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            "packed rows with ring_flash in a multi-process run need hf_ring.setup_context_parallel("
            "cp_size) first (cp_size=1 for data parallelism alone) and a guarded model (created with "
            f"attn_implementation={RING_FLASH!r} after `import hf_ring`), so that ring_flash knows which "
            "processes share a sequence"
        )


def _packed_without_context(query, key, value, scaling, sliding_window, kwargs) -> torch.Tensor:
    cu_q = kwargs["cu_seq_lens_q"]
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_k is not None and not torch.equal(cu_k.to(cu_q.device), cu_q):
        raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q: ring_flash computes self-attention")
    query, key, value = one_dtype(query, key, value)
    # (1, heads, tokens, dim) -> (tokens, heads, dim)
    out = ring_flash_attn_varlen_func(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_q,
        causal=True, softmax_scale=scaling, sinks=kwargs.get("s_aux"), window=sliding_window,
    )
    return out.unsqueeze(0)


def ring_flash_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature.

    Args:
        module: the calling attention layer (``is_causal``, ``layer_idx`` are read).
        query: ``(batch, n_heads, seq_local, head_dim)``, float16 / bfloat16 / float32.
        key, value: ``(batch, n_kv_heads, kv_len, head_dim)``, same dtype; ``kv_len`` equals
            ``seq_local`` unless a KV cache is in use (under CP: a decode step's, whose keys are this
            rank's share of the cache, hf_ring.hf.generation).
        attention_mask: the mask built by ``hf_ring.hf.mask.ring_flash_mask``: a 4-D SDPA mask
            or None without CP; None under CP.
        dropout: attention dropout probability (must be 0).
        scaling: softmax scale (default ``1 / sqrt(head_dim)``).
        sliding_window: the layer's window in tokens, or None.
        softcap: logit softcapping (scores become ``softcap * tanh(scores / softcap)``), or None;
            dense rows only.
        kwargs: the model's remaining kwargs; ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32
            ``(n_docs + 1,)``, global document boundaries) select the packed path.

    Returns:
        ``(attn_output, None)``, attn_output ``(batch, seq_local, n_heads, head_dim)`` in the
        query's dtype.
    """
    if torch.compiler.is_compiling():
        # Traced by dynamo: the ring runs as one custom op whose body is this function, eagerly.
        routed = compiled_attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                                    softcap, kwargs)
        if routed is not None:
            return routed
    refuse_uncomputed(module, kwargs)
    context: Optional[ForwardContext] = kwargs.pop(CONTEXT_KWARG, None)
    chunk = None
    if context is None:
        refuse_without_context(module)
    elif context.generation is not None and context.generation.cache.step.decoding:
        # A decode step under CP: the new tokens' queries against every rank's cached share.
        window, chunk = layer_window_and_chunk(module, sliding_window, context)
        return decode_attention(module, query, key, value, dropout, scaling, window, chunk, softcap, context, kwargs)
    ring_runs = kwargs.get("cu_seq_lens_q") is not None or (context is not None and context.state is not None)
    if ring_runs:
        refuse_dropout(module, dropout)  # without the ring, SDPA (or eager) draws it as transformers does
    if context is not None and ring_runs:
        # The ring runs: what the model applies outside this call (its mask's window and
        # chunks, the temperature of its shard's positions) is computed here over the row.
        sliding_window, chunk = layer_window_and_chunk(module, sliding_window, context)
        query = global_query_temperature(module, query, context)
    if kwargs.get("cu_seq_lens_q") is not None:
        refuse_softcap_on_packed(module, softcap)
        return _packed_attention(module, query, key, value, scaling, sliding_window, chunk, context, kwargs)
    if context is None or context.state is None:
        return _local_attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                                softcap, kwargs)
    return _ring_attention(module, query, key, value, attention_mask, scaling, sliding_window, softcap, chunk,
                           context, kwargs)
