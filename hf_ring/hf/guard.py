"""Makes sure that, under context parallelism, every attention layer of a ``ring_flash``
model really runs the ring, and that the model's inputs are ones the ring can serve.

Why: a ring that silently becomes local attention (a transformers upgrade that routes a
layer to another attention function, a config switched to "sdpa") trains a wrong model
without a word. A forward pre-hook on the model's base model (the ``LlamaModel`` inside
``LlamaForCausalLM``: it sees every input and runs every layer) validates the inputs once
per forward (``hf_ring.hf.cp_inputs``) and passes a :class:`ForwardContext` down to the
attention layers through the forward's keyword arguments; ``ring_flash`` notes in it
every layer that ran the ring; the forward hook compares that with the model's attention
layers and raises if any is missing. Under CP the context also carries the forward's
random draws, made as one process makes them (``hf_ring.hf.randomness``).

Models created with ``attn_implementation="ring_flash"`` after ``import hf_ring`` are
guarded automatically (``patches/transformers/hooks.py`` calls
``hf_ring.hf.multimodal.guard_if_requested`` after ``PreTrainedModel.post_init`` and
``set_attn_implementation``, which guards a text model here); ``guard_model`` does it by
hand. Without context parallelism (no active state, or ``cp_size == 1``) the guard
checks packed-row inputs and hands their document lengths down.

A multimodal model is guarded differently (``hf_ring.hf.multimodal``): the guard sits on its
language model, whose inputs hf_ring shards itself from the full batch (marked with
:class:`~hf_ring.hf.cp_inputs.FullBatchShards`); its vision tower, which sees whole images
on every rank, is unguarded (:func:`unguard`), and its head is flagged as one output per
token (:func:`guard_head`).
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn

from hf_ring.hf import sequence_features
from hf_ring.hf.compiled import register_context, register_layers
from hf_ring.hf.cp_inputs import compute_dtype, inputs_device, validate_cp_inputs
from hf_ring.hf.row_indices import packed_document_lengths, rows_and_length
from hf_ring.hf.randomness.scope import install_draw_scopes, install_head_scope
from hf_ring.hf.forward_context import COMM_STATS_KWARG, CONTEXT_KWARG, REFUSED_KWARG, SHARDED_KWARG, ForwardContext
from hf_ring.hf.randomness.draws import OneProcessDraws, check_generators_after
from hf_ring.hf.randomness.refusals import current_refusal, refuse_length_scaled_noise
from hf_ring.hf.mixers import head_inputs, required_steps, route_mixers
from hf_ring.hf.support import RING_FLASH, check_model_under_cp, handed_to_the_ring
from hf_ring.hf.support.tensor_parallel import check_mixers_beside_tp, check_tensor_parallel_layout
from hf_ring.patches.transformers import attn_implementation
from hf_ring.patches.transformers.mixers import is_routed_layer, unmark_routed
from hf_ring.patterns.state import get_context_parallel_state

# Flags kept in the modules' own __dict__, so that copies of a model (copy.deepcopy for a
# reference model, pickling) stay guarded: the hooks are module-level functions.
_GUARDED_MODEL = "_hf_ring_guarded_model"
_GUARDED_LAYER = "_hf_ring_guarded_layer"
_GUARDED_LOSS = "_hf_ring_guarded_loss"
# A model whose guard was lifted (a vision tower: it runs outside the sharded sequence).
_UNGUARDED = "_hf_ring_unguarded"
# A head that computes one output per token though its class name does not say so.
_PER_TOKEN_HEAD = "_hf_ring_per_token_head"
# Set while a caller that reads only per-token outputs passes labels (see per_token_labels).
_PER_TOKEN_LABELS: ContextVar[bool] = ContextVar("hf_ring_per_token_labels", default=False)


@contextmanager
def per_token_labels() -> Iterator[None]:
    """Accept ``labels`` / ``shift_labels`` under CP inside this block.

    For callers that read only per-token outputs computed from them (TRL's fused LM head:
    the log-probability of each token's label, sharded like the tokens) and never the
    model's own ``loss``, which would be a mean over this rank's shard (``hf_ring.training.trl``).
    """
    token = _PER_TOKEN_LABELS.set(True)
    try:
        yield
    finally:
        _PER_TOKEN_LABELS.reset(token)


def _is_attention_module(module: nn.Module) -> bool:
    # Transformers' decoder attention classes (LlamaAttention, Qwen2Attention, ...) are
    # the modules that call the attention interface; each carries its layer index.
    return type(module).__name__.endswith("Attention") and hasattr(module, "layer_idx")


def _flagged(model: nn.Module, flag: str) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if m.__dict__.get(flag)}


def _attention_layers(model: nn.Module) -> dict[str, nn.Module]:
    return _flagged(model, _GUARDED_LAYER)


def _mixer_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if is_routed_layer(m)}


@functools.lru_cache(maxsize=None)
def _forward_signature(model_type: type) -> tuple[inspect.Signature, bool]:
    """The forward's signature, and whether it takes ``**kwargs`` (through which the
    context reaches the attention layers)."""
    signature = inspect.signature(model_type.forward)
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    return signature, takes_kwargs


def bind_arguments(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The forward's arguments by name, ``**kwargs`` flattened in."""
    signature, _ = _forward_signature(type(model))
    bound = signature.bind_partial(model, *args, **kwargs).arguments
    bound.pop(next(iter(signature.parameters)))
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            bound.update(bound.pop(name, {}))
    return bound


def _check_guarded_model(model: nn.Module, cp_size: int, takes_kwargs: bool) -> None:
    implementation = attn_implementation(model.config)
    if implementation != RING_FLASH:
        raise RuntimeError(
            f"{type(model).__name__} was set up for attn_implementation={RING_FLASH!r} but its config "
            f"now says {implementation!r}; under context parallelism (cp_size={cp_size}) every "
            f"attention layer must run the ring: call model.set_attn_implementation({RING_FLASH!r})"
        )
    if not _attention_layers(model) and not _mixer_layers(model):
        raise NotImplementedError(
            f"found no attention layers in {type(model).__name__} (modules named *Attention with a "
            "layer_idx) and no token mixer hf_ring routes, so hf_ring cannot check that each runs "
            "its context-parallel path; this model is not supported under context parallelism"
        )
    if not takes_kwargs:
        raise NotImplementedError(
            f"{type(model).__name__}.forward takes no **kwargs, so it cannot hand hf_ring's validated "
            "context down to its attention layers; this model is not supported under context "
            "parallelism"
        )


# The guard's hooks run once per forward and validate across ranks (collectives, host
# syncs, Python-side checks): under torch.compile they run outside the compiled region,
# one graph break each per forward, none inside a decoder layer (docs/performance.md).
@torch.compiler.disable
def _pre_forward(model: nn.Module, args: tuple, kwargs: dict):
    if model.__dict__.get(_UNGUARDED):
        return None
    context = kwargs.get(CONTEXT_KWARG)
    if context is not None:
        if not context.made_by_guard:
            raise ValueError(
                f"{CONTEXT_KWARG} was passed to {type(model).__name__} by hand; it is what hf_ring's guard "
                "hands down after validating a forward's inputs across the ranks, and one made "
                "elsewhere would skip that validation: drop the argument"
            )
        return None  # a guarded model run inside another's guarded forward: one context
    signature, takes_kwargs = _forward_signature(type(model))
    comm_stats = kwargs.pop(COMM_STATS_KWARG, None)
    shards = kwargs.pop(SHARDED_KWARG, None)
    refused = kwargs.pop(REFUSED_KWARG, None)
    try:
        # A head that drops its keyword arguments (pure Mamba models) left them readable.
        inputs = {**head_inputs(), **bind_arguments(model, args, kwargs)}
    except TypeError:
        return None  # arguments the forward does not take: let it raise its own error
    state = get_context_parallel_state()
    if state is None or state.cp_size == 1:
        # The forward holds whole rows: rotaries read the length from their own positions.
        sequence_features.hand_max_position(model, None)
        doc_lens = packed_document_lengths(inputs, 1)
        # A multimodal packed row's spans (Gemma 3's images), which the varlen ring computes.
        spans = shards.spans if shards is not None and doc_lens is not None else None
        context = ForwardContext(None, doc_lens, comm_stats, made_by_guard=True, spans=spans)
        if doc_lens is not None:  # packed rows run the ring, compiled as an op (hf_ring.hf.compiled)
            register_context(context)
            register_layers(model, lambda: [*_attention_layers(model).values(), *_mixer_layers(model).values()])
        if doc_lens is not None:
            # Packed rows run the ring (varlen) even without CP: the same model features apply.
            check_model_under_cp(model, 1, sum(doc_lens), doc_lens=doc_lens)
            context.handed = handed_to_the_ring(model)
        if not takes_kwargs:
            return args, kwargs
        return args, {**kwargs, CONTEXT_KWARG: context}
    _check_guarded_model(model, state.cp_size, takes_kwargs)
    refuse_length_scaled_noise(model, state.cp_size)
    check_tensor_parallel_layout(model, state)
    if state.tp_size > 1:
        check_mixers_beside_tp(model, state.tp_size, tuple(_mixer_layers(model)))
    checked = validate_cp_inputs(inputs, state, *compute_dtype(model, inputs_device(inputs)), shards=shards,
                                 refused=refused)
    # After the collective check: every rank has the same lengths, so raises alike.
    rows, seq_local = rows_and_length(inputs)
    # A packed row's length is its documents' (placed by length, the ranks' rows differ).
    full_len = sum(checked.doc_lens) if checked.doc_lens else seq_local * state.cp_size
    check_model_under_cp(model, state.cp_size, full_len, doc_lens=checked.doc_lens)
    sequence_features.hand_max_position(model, checked.max_position)
    draws = OneProcessDraws(rows, seq_local, state.cp_size, checked.token_index, checked.generator_digests,
                            device=inputs_device(inputs), tp_size=state.tp_size, full_len=full_len,
                            refusal=current_refusal() or (shards.generation.draws_refusal
                                                          if shards is not None and shards.generation else None))
    context = ForwardContext(state, checked.doc_lens, comm_stats, made_by_guard=True,
                             token_index=checked.token_index, handed=handed_to_the_ring(model),
                             spans=shards.spans if shards is not None else None,
                             causal_by_mask=shards is not None and shards.causal_by_mask, draws=draws,
                             generation=shards.generation if shards is not None else None,
                             placement=checked.placement)
    register_context(context)  # the ring, compiled, finds it and the layers (hf_ring.hf.compiled)
    register_layers(model, lambda: [*_attention_layers(model).values(), *_mixer_layers(model).values()])
    kwargs = {**kwargs, CONTEXT_KWARG: context}
    if inputs.get("use_cache") is None and "use_cache" in signature.parameters:
        # A training forward under CP builds no cache (a forward asking for one is generation,
        # hf_ring.hf.generation, which hands down its own).
        kwargs["use_cache"] = False
    return args, kwargs


# Heads that compute one output per token, from that token's hidden state alone: their
# outputs are simply sharded like the tokens. Any other head (sequence classification
# pools "the last real token", found from this rank's local indices) is refused under CP.
_PER_TOKEN_HEADS = ("ForCausalLM", "LMHeadModel", "GenerationDecoder", "ForTokenClassification", "ForQuestionAnswering")


@torch.compiler.disable
def _check_head_under_cp(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Pre-hook of the model around the base model (e.g. ``LlamaForCausalLM``): under CP
    the loss it computes from ``labels`` would be a mean over this rank's shard, and a
    head that pools over the sequence would pool over the shard."""
    state = get_context_parallel_state()
    if state is None or state.cp_size == 1:
        return None
    name = type(model).__name__
    if not name.endswith(_PER_TOKEN_HEADS) and not model.__dict__.get(_PER_TOKEN_HEAD):
        raise NotImplementedError(
            f"{name} puts a head on the base model that is not one output per token (e.g. sequence "
            "classification pools the last real token of each row); under context parallelism "
            f"(cp_size={state.cp_size}) each rank would pool over its own shard. hf_ring supports "
            f"heads ending in {' or '.join(_PER_TOKEN_HEADS)} and the base model "
            "(model.base_model) under CP; run this model without context parallelism"
        )
    try:
        inputs = bind_arguments(model, args, kwargs)
    except TypeError:
        return None  # arguments the forward does not take: let it raise its own error
    given = [name for name in ("labels", "shift_labels") if inputs.get(name) is not None]
    if given and not _PER_TOKEN_LABELS.get():
        raise ValueError(
            f"{type(model).__name__} got {' and '.join(given)} under context parallelism "
            f"(cp_size={state.cp_size}): the loss it would compute is a mean over this rank's shard "
            "only (NaN on a shard without a label), not the sequence's. Call the model without "
            "labels and take the loss with hf_ring.training.loss (token_loss_sum over this rank, divided by "
            "the valid tokens of the whole dp x cp world; tests/ring_custom_loop.py shows it), or "
            "train with RingTrainer, which does"
        )
    keep = inputs.get("logits_to_keep")
    # generate() keeps 1 with a cache: generation under CP hands it down (hf_ring.hf.generation).
    caching = inputs.get("use_cache") is True or any(inputs.get(n) is not None for n in ("cache", "past_key_values"))
    if keep is not None and not (isinstance(keep, int) and keep == 0) and not caching:
        raise ValueError(
            f"{type(model).__name__} got logits_to_keep={keep!r} under context parallelism (cp_size="
            f"{state.cp_size}): it would keep the last tokens of this rank's shard, which in the "
            f"{state.layout!r} layout are not the sequence's last; leave it 0 (every token's logits). generate() "
            "under CP runs with a cache: pass use_cache=True (the config or generation config turns it off)"
        )
    return None


@torch.compiler.disable
def _post_forward(model: nn.Module, args: tuple, kwargs: dict, output: Any):
    context: Optional[ForwardContext] = kwargs.get(CONTEXT_KWARG)
    if context is None or (context.state is None and context.generation is None):
        return None  # without CP, or a decode step's layers under CP (which must all run it)
    missing = [name for name, m in _attention_layers(model).items() if id(m) not in context.ran_ring]
    if missing:
        raise RuntimeError(
            f"ring attention was bypassed: under context parallelism these attention layers of "
            f"{type(model).__name__} did not run ring_flash in this forward: {', '.join(missing)}. "
            "Their attention went to another function (a transformers version hf_ring does not "
            "know, or a patched layer), which computes attention over this rank's shard only, or "
            "the model skipped them (LayerDrop in training: set the config's layerdrop to 0). "
            "Use a supported transformers release, or report the model"
        )
    if context.draws is not None and context.draws.unplaced:
        check_generators_after(context.state.cp_group, context.draws.device)
    # A decode step's mixers run transformers' own recurrent step on the whole rows, as one process.
    mixers = [name for name, m in _mixer_layers(model).items() if context.state is not None
              and any((id(m), step) not in context.ran_mixers for step in required_steps(m))]
    if mixers:
        raise RuntimeError(
            f"a token mixer was bypassed: under context parallelism these layers of {type(model).__name__} "
            f"did not run hf_ring's context-parallel convolution and recurrence in this forward: "
            f"{', '.join(mixers)}. They went to other functions (a GPU kernel or a transformers "
            "version hf_ring does not know), which mix this rank's shard only. Use transformers 5.24 "
            "without hub kernels, or report the model"
        )
    return None


def guard_head(model: nn.Module, per_token: bool = False) -> None:
    """Make ``model``, a head around a base model, refuse ``labels`` under CP (its loss
    would be a per-shard mean) and any head that is not one output per token; ``per_token``:
    this one is, whatever its class name says (a multimodal model's language-modeling head).
    Idempotent."""
    if per_token:
        model.__dict__[_PER_TOKEN_HEAD] = True
    if not model.__dict__.get(_GUARDED_LOSS):
        model.register_forward_pre_hook(_check_head_under_cp, with_kwargs=True)
        install_head_scope(model)  # a head's own dropout draws on the sharded hidden states
        model.__dict__[_GUARDED_LOSS] = True


def unguard(model: nn.Module, subtree: bool = True) -> None:
    """Lift the guard of ``model`` (a vision tower that was guarded as a model of its own
    when it was built: it runs outside the sharded sequence, on whole images on every rank;
    a multimodal base model, whose language model holds the guard), and with ``subtree``
    the flags of the attention layers and mixers under it."""
    model.__dict__[_UNGUARDED] = True
    for m in model.modules() if subtree else ():
        m.__dict__.pop(_GUARDED_LAYER, None)
        unmark_routed(m)


def guard_model(model: nn.Module) -> None:
    """Install the ring guard on ``model``'s base model (idempotent).

    The base model (``model.base_model``, e.g. the ``LlamaModel`` of a ``LlamaForCausalLM``)
    receives every input and runs every decoder layer; its attention layers are those
    whose class name ends in ``Attention`` and that carry a ``layer_idx``. The model
    around it refuses ``labels`` under CP (its loss would be a per-shard mean).
    """
    base = getattr(model, "base_model", model)
    if base is not model:
        guard_head(model)
    if base.__dict__.get(_GUARDED_MODEL) or base.__dict__.get(_UNGUARDED):
        return  # guarded already, or a multimodal model's tower (hf_ring.hf.multimodal)
    # A routed mixer named *Attention (Kimi delta attention) runs hf_ring's mixers, not the ring.
    mixers = {id(m) for m in route_mixers(base)}
    for m in base.modules():
        if _is_attention_module(m) and id(m) not in mixers:
            m.__dict__[_GUARDED_LAYER] = True
    sequence_features.prepare(base)
    base.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    install_draw_scopes(base)  # after the guard's pre-hook: it reads the context it hands down
    base.register_forward_hook(_post_forward, with_kwargs=True)
    base.__dict__[_GUARDED_MODEL] = True
