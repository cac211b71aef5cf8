"""The routed token-mixer layers' own forwards: which guarded context a layer runs under
(its keyword arguments, or its carrier's for the Mamba-1 blocks called without them), made
the active one for the mixing functions it calls (a context variable set only for the
layer's call), and the head inputs a model's head drops before its base model runs.

Part of :mod:`hf_ring.hf.mixers` (whose docstring says why); the functions' runners are in
``runners.py``. Must not import: Trainer, TRL, hf_ring's training or memory layers.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Optional

import torch
import torch.nn as nn
from transformers import PreTrainedModel

from hf_ring.hf.forward_context import CONTEXT_KWARG, ForwardContext
from hf_ring.hf.mixers.compiled import compiled_mixer_layer

# The routed layer running now and its context (set only for the layer's call).
_ACTIVE: ContextVar[Optional[tuple[ForwardContext, int]]] = ContextVar("hf_ring_mixer_layer", default=None)
# The context a carrier received, for a mixer its caller runs without keyword arguments.
_CARRIED: ContextVar[Optional[ForwardContext]] = ContextVar("hf_ring_carried_context", default=None)
# What a head that drops its keyword arguments was given, for the guard of its base model.
_HEAD_INPUTS: ContextVar[dict] = ContextVar("hf_ring_head_inputs", default={})
HEAD_INPUT_NAMES = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _routing(kwargs: dict) -> Optional[ForwardContext]:
    """The guarded context when this call must not run the original on its own: under CP
    or on packed rows; else None."""
    context = kwargs.get(CONTEXT_KWARG)
    if not isinstance(context, ForwardContext) or not context.made_by_guard:
        return None
    return context if context.state is not None or context.doc_lens is not None else None


def _where(context: ForwardContext) -> str:
    return f"under context parallelism (cp_size={context.cp_size})" if context.state else "on packed rows"


@contextmanager
def _set(var: ContextVar, value) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


@torch.compiler.disable
def _refuse_compiled(module: nn.Module, context: ForwardContext) -> None:
    """Raise, at run time, for a carrier that dynamo traced. Called only from traced code: a
    ``raise`` there is not an error to dynamo but a graph break, after which the frame ran
    uncompiled and the refusal never fired (the layers' mixers then ran eagerly between
    compiled graphs); a disabled function's call runs, and its error reaches the caller."""
    raise NotImplementedError(
        f"{type(module).__name__} under torch.compile {_where(context)}: it runs its Mamba blocks without keyword "
        "arguments, so their token mixers cannot be handed their forward's context inside the compiled graph "
        "(routed mixer layers called with it run as one op each: hf_ring.hf.mixers.compiled); run this model "
        "uncompiled"
    )


def run_carrier(original, module: nn.Module, *args, **kwargs):
    """The carrier's forward: hands its context to the mixers it calls without it."""
    context = _routing(kwargs)
    if context is None:
        return original(module, *args, **kwargs)
    if torch.compiler.is_compiling():
        _refuse_compiled(module, context)
    # A carrier that is a checkpointed layer itself (Jamba's) reruns with its kwargs; a base
    # model (Mamba's) runs checkpointed blocks that get none.
    if isinstance(module, PreTrainedModel) and module.is_gradient_checkpointing and module.training \
            and torch.is_grad_enabled():
        raise NotImplementedError(
            f"{type(module).__name__} runs its Mamba blocks without keyword arguments, so a block "
            f"recomputed by gradient checkpointing in the backward would not know it runs {_where(context)} "
            "and would mix this rank's tokens only. Turn gradient checkpointing off for this model "
            "(model.gradient_checkpointing_disable(), or gradient_checkpointing=False in the training "
            "arguments)"
        )
    with _set(_CARRIED, context):
        return original(module, *args, **kwargs)


def run_head(original, module: nn.Module, *args, **kwargs):
    """The forward of a model with its head that calls its base model without its keyword
    arguments (``MambaForCausalLM``): keeps the positions and packed-row lengths it was
    given readable (``head_inputs``) while the base model runs."""
    with _set(_HEAD_INPUTS, {k: v for k, v in kwargs.items() if k in HEAD_INPUT_NAMES and v is not None}):
        return original(module, *args, **kwargs)


def head_inputs() -> dict:
    """What the running head (``run_head``) was given and dropped; empty outside one."""
    return _HEAD_INPUTS.get()


def run_layer(original, module: nn.Module, *args, **kwargs):
    """The mixer layer's forward; refuses a cache under CP or on packed rows (each rank's
    cache would hold its shard's states only), but a generation prefill's (its states over
    the whole rows are handed to it: :func:`run_conv`, the delta rule's runner), and makes its
    context the active one."""
    if torch.compiler.is_compiling() and _routing(kwargs) is not None:
        # Traced: the whole layer one custom op, whose body comes back here uncompiled.
        return compiled_mixer_layer(module, args, kwargs, _routing(kwargs))
    context = _routing(kwargs) or _CARRIED.get()
    if context is None:
        return original(module, *args, **kwargs)
    cache = kwargs.get("cache", kwargs.get("cache_params", args[1] if len(args) > 1 else None))
    if cache is not None and context.generation is None:
        raise NotImplementedError(
            f"{type(module).__name__} got a cache {_where(context)}: a conv / recurrent state cache "
            "filled there holds only this rank's shard (or mixes documents). Pass use_cache=False"
        )
    with _set(_CARRIED, None), _set(_ACTIVE, (context, id(module))):
        return original(module, *args, **kwargs)


def _active(name: str, kwargs: dict) -> Optional[tuple[ForwardContext, int]]:
    """The active layer's context and id, or None: run the original."""
    active = _ACTIVE.get()
    if active is None and _routing(kwargs) is not None:
        raise RuntimeError(
            f"{name} was called {_where(_routing(kwargs))} outside a token-mixer layer that hf_ring "
            "routes, so hf_ring cannot tell which layer it serves; use a supported transformers "
            "release (5.24) or report the model"
        )
    return active

