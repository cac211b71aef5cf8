"""Where :class:`~hf_ring.hf.randomness.draws.OneProcessDraws` is in force: the guarded base
model's forward, and each checkpointed layer's recompute under gradient checkpointing.

Why both: the forward's draws (embedding dropout, every layer's dropout and router noise)
run inside the base model's forward, but a checkpointed layer runs its forward a second
time in the backward, outside it, and must draw there as it drew in the forward (torch
restores the generator for the recompute; the mode makes the draw full-shaped again).
transformers calls a checkpointed layer as ``layer._gradient_checkpointing_func(partial(
forward, **kwargs), *args)``, and in 5.x that partial is the bare forward, which runs no
module hook. So each such layer's checkpoint function is wrapped (once, at the first CP
forward that finds checkpointing on; the wrapper outlives the forward): the function it
hands to the checkpoint enters the draws of the forward whose context its keyword
arguments carry, when they are not in force already, i.e. in the recompute.

A head around the base model (``LlamaForTokenClassification``'s classifier dropout, PEFT's
LoRA on ``lm_head``) draws on the sharded hidden states after the base model returned: when
the base model runs inside a guarded head's forward, its draws stay in force until the head's
forward ends (the head's hooks open a holder the base model's hook fills).

Hooks, not a ``with`` block: the model's forward is transformers' code. The exit hooks are
``always_call``, so a forward that raises leaves no mode behind.

Must not import the Trainer, TRL, or hf_ring's training and memory layers.
"""

from __future__ import annotations

import functools
from contextvars import ContextVar
from typing import Any, Callable, Optional

import torch.nn as nn

from hf_ring.hf.forward_context import CONTEXT_KWARG
from hf_ring.hf.randomness.draws import OneProcessDraws
from hf_ring.patches.transformers import wrap_checkpoint_function

try:  # transformers' checkpointed decoder layer (4.52 and later, 5.x)
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # pragma: no cover - older than the tested range
    GradientCheckpointingLayer = ()

_SCOPED = "_hf_ring_draw_scope"
_HEAD_SCOPED = "_hf_ring_head_draw_scope"
_LAYERS = "_hf_ring_checkpointed_layers"


class _HeadHolder:
    """One guarded head's forward: its id, and the draws its base model entered for it."""

    def __init__(self, head_id: int) -> None:
        self.head_id, self.draws, self.token = head_id, None, None


_HEAD: ContextVar[Optional[_HeadHolder]] = ContextVar("hf_ring_head_draw_scope", default=None)


def _draws(kwargs: dict) -> Optional[OneProcessDraws]:
    return getattr(kwargs.get(CONTEXT_KWARG), "draws", None)


def _enter(draws: Optional[OneProcessDraws], module_id: int) -> None:
    if draws is None or draws.active:
        return  # no CP, or in force already (a guarded model inside another's forward)
    draws.__enter__()
    draws.active, draws.entered_by = True, module_id


def _exit(draws: Optional[OneProcessDraws], module_id: int) -> None:
    if draws is not None and draws.active and draws.entered_by == module_id:
        draws.active, draws.entered_by = False, None
        draws.__exit__(None, None, None)


def _in_scope(fn: Callable) -> Callable:
    """``fn``, a layer's forward with its keyword arguments bound, run with the draws of the
    forward its context belongs to in force (the recompute enters them; the forward has)."""
    keywords = getattr(fn, "keywords", None) or {}

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        draws = _draws({**keywords, **kwargs})
        _enter(draws, id(run))
        try:
            return fn(*args, **kwargs)
        finally:
            _exit(draws, id(run))

    return run


def _scoped_checkpoint(checkpoint: Callable) -> Callable:
    def call(fn: Callable, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(_in_scope(fn), *args, **kwargs)

    return call


def _model_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    draws = _draws(kwargs)
    if draws is None:
        return
    for layer in module.__dict__.get(_LAYERS, ()):
        wrap_checkpoint_function(layer, _scoped_checkpoint)
    holder = _HEAD.get()
    if holder is not None and holder.draws is None and not draws.active:
        holder.draws = draws  # the head closes them, after its own draws on the hidden states
        _enter(draws, holder.head_id)
    else:
        _enter(draws, id(module))


def _model_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    _exit(_draws(kwargs), id(module))


def _head_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    holder = _HeadHolder(id(module))
    holder.token = _HEAD.set(holder)


def _head_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    holder = _HEAD.get()
    if holder is None or holder.head_id != id(module):
        return
    _HEAD.reset(holder.token)
    _exit(holder.draws, id(module))


def install_head_scope(head: nn.Module) -> None:
    """Keep the draws of the base model's CP forward in force until ``head``'s forward (the
    model around the base model) ends. Idempotent."""
    if head.__dict__.get(_HEAD_SCOPED):
        return
    head.register_forward_pre_hook(_head_pre_hook, with_kwargs=True)
    head.register_forward_hook(_head_hook, with_kwargs=True, always_call=True)
    head.__dict__[_HEAD_SCOPED] = True


def install_draw_scopes(base: nn.Module) -> None:
    """Put each CP forward's draws in force in ``base``'s forward and in the recompute of
    every checkpointed layer under it. Register after the guard's pre-hook, which puts the
    context in the keyword arguments these hooks read. Idempotent."""
    if base.__dict__.get(_SCOPED):
        return
    base.__dict__[_LAYERS] = [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]
    base.register_forward_pre_hook(_model_pre_hook, with_kwargs=True)
    base.register_forward_hook(_model_hook, with_kwargs=True, always_call=True)
    base.__dict__[_SCOPED] = True
