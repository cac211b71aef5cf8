"""Runs the token mixers of hybrid models (gated delta nets) exactly under context
parallelism and on packed rows: the runners that ``patches/transformers/mixers.py`` puts
in place of the modeling module's ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule``
and around the layer's forward.

Why: those functions see only this rank's shard under CP (and a packed row's documents
as one sequence). When the layer's keyword arguments carry a guarded
:class:`ForwardContext` under CP, the runners call :mod:`hf_ring.mixers`' ops on the shard
(group and layout from the context's state; packed rows: each document zigzag-sharded on
its own, ``local_doc_lens = doc_lens // cp_size``); on packed rows without CP they call
the original function once per document; otherwise the original, unchanged. Each layer
notes in the context that both its functions ran their CP path, so that the guard can
check, after the forward, that none was bypassed.

Owns: the runners, ``route_mixers``. Must not import: Trainer, TRL, hf_ring's training or
memory layers.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from hf_ring.hf.forward_context import CONTEXT_KWARG, ForwardContext
from hf_ring.mixers import context_parallel_causal_conv1d, context_parallel_gated_delta_rule
from hf_ring.patches.transformers.mixers import is_routed, route

# What each routed layer must have run in a forward under CP (the guard checks both).
MIXER_STEPS = ("conv", "delta_rule")


def _routing(kwargs: dict) -> Optional[ForwardContext]:
    """The guarded context when this call must not run the original on its own: under CP
    or on packed rows; else None."""
    context = kwargs.get(CONTEXT_KWARG)
    if not isinstance(context, ForwardContext) or not context.made_by_guard:
        return None
    return context if context.state is not None or context.doc_lens is not None else None


def _where(context: ForwardContext) -> str:
    return f"under context parallelism (cp_size={context.cp_size})" if context.state else "on packed rows"


def _layer_of(context: ForwardContext, name: str) -> int:
    if context.mixer_layer is None:
        raise RuntimeError(
            f"{name} was called {_where(context)} outside a gated delta net layer that hf_ring routes, "
            "so hf_ring cannot tell which layer it serves; use a supported transformers release "
            "(5.24) or report the model"
        )
    return context.mixer_layer


def _local_docs(context: ForwardContext) -> Optional[list[int]]:
    return None if context.doc_lens is None else [n // context.cp_size for n in context.doc_lens]


def _layout(context: ForwardContext) -> str:
    # Packed rows are zigzag-sharded per document whatever the state's layout (as the ring).
    return "zigzag" if context.doc_lens is not None else context.state.layout


def _spans(docs: list[int]) -> list[tuple[int, int]]:
    starts = [sum(docs[:i]) for i in range(len(docs))]
    return [(s, s + n) for s, n in zip(starts, docs)]


def run_layer(original, module: nn.Module, *args, **kwargs):
    """The layer's forward; refuses a cache under CP or on packed rows (each rank's cache
    would hold its shard's states only), and tells the runners below which layer runs."""
    context = _routing(kwargs)
    if context is None:
        return original(module, *args, **kwargs)
    cache = kwargs.get("cache", kwargs.get("cache_params", args[1] if len(args) > 1 else None))
    if cache is not None:
        raise NotImplementedError(
            f"{type(module).__name__} got a cache {_where(context)}: a conv / recurrent state cache "
            "filled there holds only this rank's shard (or mixes documents). Pass use_cache=False"
        )
    context.mixer_layer = id(module)
    try:
        return original(module, *args, **kwargs)
    finally:
        context.mixer_layer = None


def run_conv(original, hidden_states: torch.Tensor, weight: torch.Tensor, bias=None, activation=None, **kwargs):
    """``causal_conv1d_fn``: hidden_states ``(batch, channels, local_seq)``, weight
    ``(channels, width)``; returns ``(batch, channels, local_seq)``."""
    context = _routing(kwargs)
    if context is None:
        return original(hidden_states, weight, bias, activation=activation, **kwargs)
    layer = _layer_of(context, "causal_conv1d_fn")
    docs = _local_docs(context)
    if context.state is not None:
        out = context_parallel_causal_conv1d(
            hidden_states, weight, bias, activation=activation, group=context.state.cp_group,
            layout=_layout(context), local_doc_lens=docs,
        )
    else:
        out = torch.cat([original(hidden_states[..., s:e], weight, bias, activation=activation)
                         for s, e in _spans(docs)], dim=-1)
    context.ran_mixers.add((layer, "conv"))
    return out


def run_delta_rule(original, query, key, value, g=None, beta=None, chunk_size=64, initial_state=None,
                   output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """``torch_chunk_gated_delta_rule``: query, key ``(batch, local_seq, heads, k_dim)``, value
    ``(batch, local_seq, heads, v_dim)``, g and beta ``(batch, local_seq, heads)``; returns
    ``(out (batch, local_seq, heads, v_dim), None)``."""
    context = _routing(kwargs)
    if context is None:
        return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                        output_final_state=output_final_state,
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
    layer = _layer_of(context, "torch_chunk_gated_delta_rule")
    if initial_state is not None or output_final_state:
        raise NotImplementedError(
            f"the gated delta rule got a recurrent state {_where(context)}; hf_ring runs it from a "
            "zero state per row (per document on packed rows): pass use_cache=False"
        )
    if kwargs.get("cu_seqlens") is not None and context.doc_lens is None:
        raise NotImplementedError(
            f"the gated delta rule got cu_seqlens {_where(context)} on a row hf_ring's guard did not "
            "validate as packed; pass packed rows as RingDataCollator makes them (cu_seq_lens_q/k, "
            "max_length_q/k and per-document position_ids)"
        )
    docs = _local_docs(context)
    if context.state is not None:
        out, _ = context_parallel_gated_delta_rule(
            query, key, value, g, beta, group=context.state.cp_group, layout=_layout(context),
            local_doc_lens=docs, chunk_size=chunk_size, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
    else:
        out = torch.cat([
            original(query[:, s:e], key[:, s:e], value[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                     chunk_size=chunk_size, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0]
            for s, e in _spans(docs)
        ], dim=1)
    context.ran_mixers.add((layer, "delta_rule"))
    return out, None


def route_mixers(model: nn.Module) -> list[nn.Module]:
    """Route every gated delta net layer class of ``model`` that hf_ring knows (idempotent);
    returns the model's layers that are routed."""
    routed = {cls for cls in {type(m) for m in model.modules()} if route(cls, run_layer, run_conv, run_delta_rule)}
    return [m for m in model.modules() if type(m) in routed]


def routed_mixer(module: nn.Module) -> bool:
    """Whether ``module``'s class runs through the runners above."""
    return is_routed(type(module))
