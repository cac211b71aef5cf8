"""A routed token-mixer layer under ``torch.compile``: the whole layer one custom op.

Why the whole layer: the mixing functions' runners learn which layer calls them, and that
forward's context, from a context variable the layer's forward sets (``layers.py``), and
dynamo does not trace ``ContextVar.set`` / ``get``: it broke the graph there and ran the frame
uncompiled. So, compiled, a routed layer's call is one op, ``hf_ring::token_mixer_layer``,
over the layer's tensor arguments and its trainable parameters. Its body calls the layer
eagerly, exactly as an uncompiled forward does (``run_layer``'s own path: the context made
active, the CP convolution halo and recurrent-state exchange, the per-document runs of a
packed row, the notes the guard checks after the forward), under
:func:`hf_ring.patterns.compiled.run_taped`; its backward replays that autograd graph
(``hf_ring::tape_backward``) and returns the gradients of the tensor arguments and of the
parameters. Everything around the layer (norms, attention, MLPs) is compiled; the mixer
layer itself, its projections included, runs as uncompiled code runs it.

What travels into the op: the forward's context and the layer by handle and slot, as for the
attention's op (``hf_ring.hf.compiled``: the guard registers both outside the compiled
region); the arguments' names and their plain constants (None, bools, ints, floats,
strings) as a string, a constant of the graph. What is refused, by name: an argument of
another kind (a cache object, a tuple of tensors), and a layer whose output is not one
tensor shaped like its ``hidden_states`` (the op's fake implementation promises that shape).
Carriers (Mamba-1 blocks run without keyword arguments) stay refused by ``layers.py``.

Must not import the Trainer, TRL, or hf_ring's training and memory layers.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import torch
import torch.nn as nn
from torch.func import functional_call

from hf_ring.hf.compiled import HANDLE_ATTR, SLOT_ATTR, context_of, layer_of
from hf_ring.hf.forward_context import CONTEXT_KWARG
from hf_ring.patterns.compiled import run_taped, tape_backward

_CONSTANT_TYPES = (type(None), bool, int, float, str)
# A routed layer's forward parameters by name, in order (set when the layer is routed, so
# that traced code names positional arguments without inspecting the signature).
FORWARD_NAMES_ATTR = "_hf_ring_forward_names"


def note_forward_names(module: nn.Module) -> None:
    """Keep ``module``'s forward parameter names on it (called when it is routed, uncompiled)."""
    params = tuple(inspect.signature(type(module).forward).parameters)[1:]
    module.__dict__[FORWARD_NAMES_ATTR] = params


@torch.compiler.assume_constant_result
def _encode(names: tuple, param_names: tuple, constants: tuple) -> str:
    """The call's spec as a JSON string (a custom op takes no list of strings): the tensor
    arguments' names, the parameters' names and the constants ``(name, value), ...``. Run at
    trace time, its result a constant of the graph."""
    return json.dumps({"names": list(names), "params": list(param_names), "constants": dict(constants)})


def _hidden_index(names: list[str]) -> int:
    return names.index("hidden_states") if "hidden_states" in names else 0


@torch.library.custom_op("hf_ring::token_mixer_layer", mutates_args=())
def token_mixer_layer_op(
    tensors: list[torch.Tensor],
    params: list[torch.Tensor],
    spec: str,
    handle: torch.Tensor,
    layer: int,
    record: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One routed token-mixer layer's call in a compiled forward, run eagerly.

    Args:
        tensors: the layer's tensor arguments (a None one travels as a constant, since
            PyTorch gives a list holding None no gradients); ``hidden_states`` ``(batch, local_seq, hidden)`` float among them.
        params: the layer's trainable parameters.
        spec: JSON: ``names``, the keyword each of ``tensors`` is passed as; ``params``, the
            parameters' names in the layer (``in_proj.weight``, ``A_log``, ...);
            ``constants``, the layer's other keyword arguments (plain constants).
        handle: 0-d int64, the forward's context (``hf_ring.hf.compiled.register_context``).
        layer: the layer's slot (``hf_ring.hf.compiled.register_layers``).
        record: keep the autograd graph for the backward.

    Returns:
        the layer's output, shaped, typed and strided like ``hidden_states``, and the tape id
        (0-d int64).
    """
    context, module = context_of(handle), layer_of(layer)
    call = json.loads(spec)
    names = call["names"]
    hidden = tensors[_hidden_index(names)]
    n = len(tensors)

    def run(*leaves):
        kwargs: dict[str, Any] = dict(zip(names, leaves[:n]))
        kwargs.update(call["constants"])
        kwargs[CONTEXT_KWARG] = context
        out = functional_call(module, dict(zip(call["params"], leaves[n:])), (), kwargs, strict=False)
        if not isinstance(out, torch.Tensor) or out.shape != hidden.shape or out.dtype != hidden.dtype:
            what = type(out).__name__ if not isinstance(out, torch.Tensor) else f"{tuple(out.shape)} {out.dtype}"
            raise NotImplementedError(
                f"{type(module).__name__} under torch.compile: hf_ring runs a token-mixer layer as one op whose "
                f"output is one tensor shaped like its hidden_states ({tuple(hidden.shape)} {hidden.dtype}), but "
                f"it returned {what}; run this model uncompiled, or report the model")
        # In hidden_states' layout (the fake implementation's promise) and never an alias of an input.
        return (torch.empty_like(hidden).copy_(out),)

    (out,), tape = run_taped(run, (*tensors, *params), record)
    return out, tape


@token_mixer_layer_op.register_fake
def _(tensors, params, spec, handle, layer, record):
    return torch.empty_like(tensors[_hidden_index(json.loads(spec)["names"])]), torch.empty((), dtype=torch.int64)


def _setup(ctx, inputs, output) -> None:
    tensors, params = inputs[:2]
    ctx.n_tensors = len(tensors)
    ctx.save_for_backward(output[1], *tensors, *params)


def _backward(ctx, dout, _dtape):
    tape, *like = ctx.saved_tensors
    grads = tape_backward(tape, [dout], like)
    # Integer arguments (positions, document bounds) take no gradient.
    tensor_grads = [g if g.is_floating_point() else None for g in grads[:ctx.n_tensors]]
    return tensor_grads, list(grads[ctx.n_tensors:]), None, None, None, None


token_mixer_layer_op.register_autograd(_backward, setup_context=_setup)


def _split_arguments(module: nn.Module, kwargs: dict[str, Any]) -> tuple[list, list[str], tuple]:
    """The layer's keyword arguments as the op takes them: tensors with their names, the
    plain constants (None among them) as ``(name, value)`` pairs; anything else refused by name."""
    tensors, names, constants = [], [], []
    for name, value in kwargs.items():
        if name == CONTEXT_KWARG:
            continue
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            names.append(name)
        elif isinstance(value, _CONSTANT_TYPES):
            constants.append((name, value))
        else:
            raise NotImplementedError(
                f"{type(module).__name__} under torch.compile got {name}={type(value).__name__}: hf_ring passes a "
                "token-mixer layer's tensors and plain constants into its compiled op, nothing else; run this "
                "model uncompiled, or report the model")
    return tensors, names, tuple(constants)


def compiled_mixer_layer(module: nn.Module, args: tuple, kwargs: dict[str, Any], context: Any) -> torch.Tensor:
    """What a routed layer's forward runs while dynamo traces it under CP or on packed rows:
    the layer as ``hf_ring::token_mixer_layer`` (``args`` bound to the forward's parameter
    names first)."""
    slot = module.__dict__.get(SLOT_ATTR)
    if slot is None:
        raise RuntimeError(f"{type(module).__name__} runs under torch.compile but was not registered by hf_ring's "
                           "guard (no compile slot); create the model with attn_implementation='ring_flash' after "
                           "`import hf_ring`")
    if args:
        positional = module.__dict__.get(FORWARD_NAMES_ATTR, ())
        if len(args) > len(positional):
            raise RuntimeError(f"{type(module).__name__} got {len(args)} positional arguments under torch.compile, "
                               "but hf_ring noted fewer forward parameters when it routed the layer")
        kwargs = {**dict(zip(positional, args)), **kwargs}
    tensors, names, constants = _split_arguments(module, kwargs)
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    record = torch.is_grad_enabled() and any(t.requires_grad for t in (*tensors, *params))
    spec = _encode(tuple(names), tuple(name for name, _ in named), constants)
    out, _ = torch.ops.hf_ring.token_mixer_layer(tensors, params, spec, getattr(context, HANDLE_ATTR), slot, record)
    return out


__all__ = ["FORWARD_NAMES_ATTR", "compiled_mixer_layer", "note_forward_names", "token_mixer_layer_op"]
