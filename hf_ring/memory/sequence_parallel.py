"""Sequence parallelism inside tensor parallelism: each TP rank keeps 1/T of its tokens
between the attention and MLP blocks.

Why: under transformers' tensor parallelism (``DistributedConfig(tp_size=T)``) the decoder
layers' code is unchanged, so every TP rank holds every token of its (CP-local) sequence
between the TP blocks: the residual stream, the norms' inputs and outputs, and with
gradient checkpointing every layer's saved input, ``T`` copies of the same numbers.
Megatron's sequence parallelism splits them along the sequence over the TP group;
transformers reserves ``DistributedConfig(enable_sequence_parallel=True)`` for it and does
not wire it (5.24). Here, per decoder layer:

- the first layer's input (the embeddings, whole on every rank) is cut into ``T`` equal
  pieces along the sequence and each rank keeps its own;
- each TP block (``self_attn``, ``mlp``) gets the pieces gathered back into the whole
  sequence, which is what plain TP feeds it, and its output (whole on every rank after TP's
  row-parallel all-reduce) is cut again;
- the norms and residual adds between run on the piece; the norms' weights, which see
  only this rank's tokens, have their gradients summed over TP in backward;
- the base model's output (after its final norm, on the piece) is gathered whole for the
  LM head and the loss.

Exact: everything that runs on a piece is per token, and each gather or cut has the
backward that keeps the gradients one process computes (``distributed/sequence_pieces.py``).
The attention blocks see the whole CP-local sequence, so every CP pattern runs unchanged.

Cost: per block, the forward adds one all-gather along the sequence to TP's all-reduce,
and the backward one all-gather to TP's all-reduces (Megatron replaces the all-reduce by a
reduce-scatter, one all-gather's bytes less; that needs transformers' row-parallel layers
changed, which hf_ring does not do); the norms' weight gradients add one all-reduce of
``hidden_size`` numbers each.

Refused by name: image-text models, a sequence whose length does not divide by ``T`` (pad rows to a
multiple of ``layout unit x cp x tp``), decoder layers with anything but an attention, a
dense MLP and per-token norms (mixture-of-experts blocks, token mixers, dropout on the
residual stream, a layer's own weights), a base model with weights outside its embeddings,
its layers and its final ``norm``, and ``output_hidden_states`` (the layers' outputs are
pieces).

Must not import the Trainer, TRL, or hf_ring's training layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from hf_ring.distributed.collectives import GroupCollectives
from hf_ring.distributed.sequence_pieces import TP_GROUP, grad_summed_over, piece_of, whole_from_pieces
from hf_ring.hf.support.tensor_parallel import model_tp_group
from hf_ring.memory.tiled_mlp import check_dense_mlp
from hf_ring.patches import transformers as transformers_patches

_PLAN = "_hf_ring_sequence_parallel"
_SEQ_DIM = 1  # hidden states are (batch, sequence, hidden) between transformers' decoder layers
# Leaf modules that act on each token alone and may run on a piece.
_PER_TOKEN_LEAVES = ("Norm", "Identity", "Dropout")
_BLOCKS = ("self_attn", "mlp")
_OWN = "_hf_ring_own_weights"  # a norm's weights while its forward runs on the grad-summed views


@dataclass(frozen=True)
class SequenceParallelPlan:
    """Sequence parallelism installed on one model.

    Attributes:
        tp_size: the TP group's size, ``T``: each rank keeps ``1 / T`` of the tokens.
        layers: how many decoder layers run with it.
        norms: the paths of the modules whose weights' gradients are summed over TP.
    """

    tp_size: int
    layers: int
    norms: tuple[str, ...]


def _refuse(what: str) -> NotImplementedError:
    return NotImplementedError(f"sequence parallelism inside TP: {what}; load the model without "
                               "enable_sequence_parallel (plain TP computes it exactly, with every token on every TP rank)")


def _check_layer(path: str, layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """The per-token modules with weights of one decoder layer (run on a piece); refuses
    anything else than them, a TP-split attention and a dense MLP."""
    if any(True for _ in layer.parameters(recurse=False)):
        raise _refuse(f"{path} ({type(layer).__name__}) has weights of its own, which hf_ring cannot tell run per token")
    weighted = []
    for name, child in layer.named_children():
        label = f"{path}.{name}"
        if name in _BLOCKS:
            if not any(transformers_patches.tensor_parallel_forward(m) for m in child.modules()):
                raise _refuse(f"{label} ({type(child).__name__}) is not split by tensor parallelism")
            if name == "mlp":
                check_dense_mlp(label, child, "sequence parallelism inside TP",
                                "load the model without enable_sequence_parallel")
            continue
        kind = type(child).__name__
        if any(True for _ in child.children()) or not kind.endswith(_PER_TOKEN_LEAVES) or "BatchNorm" in kind:
            raise _refuse(f"{label} ({kind}) is neither a TP block ({', '.join(_BLOCKS)}) nor a per-token norm, so "
                          "hf_ring cannot tell it may run on a piece of the sequence (a token mixer, a mixture of "
                          "experts, ...)")
        if kind.endswith("Dropout") and getattr(child, "p", 0) > 0:
            raise _refuse(f"{label} is a dropout with p={child.p} on the residual stream, whose draws on a piece "
                          "hf_ring does not place; set it to 0")
        if any(True for _ in child.parameters(recurse=False)):
            weighted.append((label, child))
    missing = [name for name in _BLOCKS if not isinstance(getattr(layer, name, None), nn.Module)]
    if missing:
        raise _refuse(f"{path} ({type(layer).__name__}) has no {' or '.join(missing)}")
    return weighted


def _base_norm(base: nn.Module) -> tuple[str, nn.Module]:
    """The base model's final norm (applied to the last layer's output, on the piece); refuses
    any other weighted module beside the embeddings and the layers."""
    embeddings = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    norm = None
    for name, child in base.named_children():
        if child is embeddings or name == "layers" or not any(True for _ in child.parameters()):
            continue
        if name != "norm" or any(True for _ in child.children()):
            raise _refuse(f"{type(base).__name__}.{name} ({type(child).__name__}) has weights and is not the "
                          "final norm, so hf_ring cannot tell where it runs")
        norm = child
    if norm is None:
        raise _refuse(f"{type(base).__name__} has no final 'norm' module")
    return "norm", norm


def _hidden_arg(args: tuple, kwargs: dict, where: str) -> tuple[bool, Any]:
    if args:
        return True, args[0]
    if "hidden_states" in kwargs:
        return False, kwargs["hidden_states"]
    raise _refuse(f"{where} was called without the hidden states as its first argument or 'hidden_states'")


def _with_hidden(args: tuple, kwargs: dict, positional: bool, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if positional:
        return (hidden,) + tuple(args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _split_input(coll: GroupCollectives, layer: nn.Module, args: tuple, kwargs: dict):
    positional, hidden = _hidden_arg(args, kwargs, "the first decoder layer")
    length = hidden.shape[_SEQ_DIM]
    if length % coll.world:
        raise _refuse(f"this rank's sequence of {length} tokens does not divide into {coll.world} equal pieces "
                      f"(tp_size={coll.world}); pad rows to a multiple of (the layout's unit x cp_size x "
                      "tp_size): RingDataCollator(pad_to_multiple_of=...)")
    return _with_hidden(args, kwargs, positional, piece_of(hidden, coll, _SEQ_DIM))


def _gather_input(coll: GroupCollectives, block: nn.Module, args: tuple, kwargs: dict):
    positional, hidden = _hidden_arg(args, kwargs, type(block).__name__)
    return _with_hidden(args, kwargs, positional, whole_from_pieces(hidden, coll, _SEQ_DIM))


def _cut_output(coll: GroupCollectives, block: nn.Module, args: tuple, output: Any):
    if isinstance(output, torch.Tensor):
        return piece_of(output, coll, _SEQ_DIM)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (piece_of(output[0], coll, _SEQ_DIM),) + output[1:]
    raise _refuse(f"{type(block).__name__} returned {type(output).__name__}, not its hidden states first")


def _gather_output(coll: GroupCollectives, base: nn.Module, args: tuple, kwargs: dict, output: Any):
    asked = kwargs.get("output_hidden_states", getattr(getattr(base, "config", None), "output_hidden_states", False))
    if getattr(output, "hidden_states", None) is not None or (isinstance(output, tuple) and asked):
        raise _refuse("output_hidden_states=True: the decoder layers' outputs are pieces of the sequence; call the "
                      "model without it")
    if isinstance(output, tuple):
        return (whole_from_pieces(output[0], coll, _SEQ_DIM),) + output[1:]
    output.last_hidden_state = whole_from_pieces(output.last_hidden_state, coll, _SEQ_DIM)
    return output


def _sum_grads(group: dist.ProcessGroup, module: nn.Module, args: tuple) -> None:
    """Forward pre-hook: for this call, ``module``'s own weights are views whose gradients
    are summed over ``group`` (the originals put back by :func:`_put_back`)."""
    own = {name: param for name, param in module._parameters.items() if param is not None}
    module.__dict__[_OWN] = own
    for name, param in own.items():
        module._parameters[name] = grad_summed_over(param, group)


def _put_back(module: nn.Module, args: tuple, output: Any) -> None:
    """Forward hook (run after a failed forward too): ``module``'s own weights again."""
    module._parameters.update(module.__dict__.pop(_OWN, {}))


def enable_sequence_parallel(model: nn.Module) -> SequenceParallelPlan:
    """Run ``model``'s residual stream as ``1 / tp_size`` of the tokens on each TP rank.

    Args:
        model: a transformers causal LM (or its base model) loaded tensor-parallel with
            ``DistributedConfig(tp_size=T, ...)``, ``T > 1``. Every rank of its TP group
            must call this, and then run every forward and backward alike.

    Returns:
        The plan installed (again the same one when called twice).

    Raises:
        ValueError: a model that is not tensor-parallel.
        NotImplementedError: what the module docstring lists, naming the module.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if _PLAN in decoder.__dict__:
        return decoder.__dict__[_PLAN]
    if getattr(model, "base_model", decoder) is not decoder:
        raise _refuse(f"{type(model).__name__}'s decoder is not its base model (an image-text model): not checked "
                      "against one process")
    group = model_tp_group(model)
    if group is None or dist.get_world_size(group) == 1:
        raise ValueError(f"sequence parallelism inside TP: {type(model).__name__} is not tensor-parallel (no weight is "
                         "a DTensor on a 'tp' mesh dimension); load it with DistributedConfig(tp_size=T), T > 1")
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise _refuse(f"{type(decoder).__name__} has no decoder 'layers'")
    weighted = [w for i, layer in enumerate(layers) for w in _check_layer(f"layers.{i}", layer)]
    weighted.append(_base_norm(decoder))
    coll = GroupCollectives(group, names=TP_GROUP)
    layers[0].register_forward_pre_hook(functools.partial(_split_input, coll), with_kwargs=True)
    for layer in layers:
        for name in _BLOCKS:
            block = getattr(layer, name)
            block.register_forward_pre_hook(functools.partial(_gather_input, coll), with_kwargs=True)
            block.register_forward_hook(functools.partial(_cut_output, coll))
    # Hooks, not a replaced forward: transformers (5.25 on) kernelizes its models again at every
    # train() / eval() (``kernels``), which resets the forward of every norm it may swap for a
    # hub kernel and would drop a replaced one, and the norms' gradients with it (1.4 off).
    for _, module in weighted:
        module.register_forward_pre_hook(functools.partial(_sum_grads, group))
        module.register_forward_hook(_put_back, always_call=True)
    decoder.register_forward_hook(functools.partial(_gather_output, coll), with_kwargs=True)
    plan = SequenceParallelPlan(coll.world, len(layers), tuple(label for label, _ in weighted))
    decoder.__dict__[_PLAN] = plan
    return plan


__all__ = ["SequenceParallelPlan", "enable_sequence_parallel"]
