"""``ring_flash`` under ``torch.compile``: the attention of a decoder layer as one custom op.

Why: compiled, a guarded model's decoder layers are traced by dynamo; the ring (its Python
loop over steps, its transfers, the plan built at a forward's first layer, the refusals)
must not be. When the ring runs (under context parallelism, or on packed rows), the
traced code of ``ring_flash_attention_forward`` only settles q, k, v's dtype (autocast's
casts are traced; the op's body runs without autocast) and calls
``torch.ops.hf_ring.ring_flash_attention``, whose body runs the uncompiled attention
function itself, eagerly, with the forward's validated context
(``hf_ring.patterns.compiled.run_taped``); its backward replays that call's autograd graph
(``hf_ring::tape_backward``). So the compiled model computes what the uncompiled one does,
and every refusal and check of the eager path holds.

What cannot travel into a custom op travels by handle: the forward's
:class:`~hf_ring.hf.forward_context.ForwardContext` is registered by the guard's pre-forward
hook (which runs outside the compiled region) under a 0-d int64 tensor handle (a graph
input, so a new forward recompiles nothing), and every guarded attention layer (and routed
token-mixer layer, whose op is ``hf_ring.hf.mixers.compiled``'s) under an int slot given at
the model's first forward (a constant of the graph). The op notes the layer
in the context's ``ran_ring`` as the eager path does, so the guard's check after the
forward sees a compiled model whose attention did not run the op.

Not compiled, refused by name: generation under CP (decode steps and prefills keep their
cache through the context).

Must not import the Trainer, TRL, or hf_ring's training and memory layers.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn as nn

from hf_ring.hf.attention_refusals import layer_name, refuse_uncomputed
from hf_ring.hf.forward_context import CONTEXT_KWARG, ForwardContext
from hf_ring.kernels.autocast import one_dtype
from hf_ring.patterns.compiled import run_taped, tape_backward

# The attribute of a ForwardContext holding its handle, and of a guarded layer holding its slot.
HANDLE_ATTR = "_hf_ring_compile_handle"
SLOT_ATTR = "_hf_ring_compile_slot"
# The id of the model object whose layers' slots are registered (a copy's differs).
_SLOTS_OWNER = "_hf_ring_compile_slots_of"

_CONTEXTS: "weakref.WeakValueDictionary[int, ForwardContext]" = weakref.WeakValueDictionary()
_LAYERS: dict[int, "weakref.ref[nn.Module]"] = {}
_IDS = itertools.count(1)
# How many times the op's body ran, by layer slot: tests and benchmarks read it to tell a
# compiled forward that ran the op from one that fell back to eager Python.
OP_CALLS: collections.Counter = collections.Counter()


def register_context(context: ForwardContext) -> None:
    """Give ``context`` its handle (called by the guard once per forward, outside any
    compiled region); it is found by the op while the forward holds it."""
    handle = next(_IDS)
    _CONTEXTS[handle] = context
    setattr(context, HANDLE_ATTR, torch.tensor(handle, dtype=torch.int64))


def register_layers(model: nn.Module, layers: Callable[[], Iterable[nn.Module]]) -> None:
    """Give each guarded attention layer of ``model`` (``layers()``) a slot of its own, once
    per model object (called by the guard before a forward's layers run, outside any
    compiled region). A copy of a model (``copy.deepcopy``) carries its original's slots in
    its layers' ``__dict__``: it gets new ones, so the op never runs another model's layer."""
    if model.__dict__.get(_SLOTS_OWNER) == id(model):
        return
    for module in layers():
        ref = _LAYERS.get(module.__dict__.get(SLOT_ATTR))
        if ref is None or ref() is not module:
            slot = next(_IDS)
            _LAYERS[slot] = weakref.ref(module)
            module.__dict__[SLOT_ATTR] = slot
    model.__dict__[_SLOTS_OWNER] = id(model)


def context_of(handle: torch.Tensor) -> ForwardContext:
    """The forward's context registered under ``handle`` (:func:`register_context`)."""
    context = _CONTEXTS.get(int(handle))
    if context is None:
        raise RuntimeError("a compiled ring_flash layer ran without its forward's context (the forward that "
                           "registered it has ended); a layer recomputed outside its forward under torch.compile "
                           "is not supported: turn gradient checkpointing off when compiling under CP")
    return context


def layer_of(slot: int) -> nn.Module:
    """The live layer holding compile slot ``slot`` (:func:`register_layers`)."""
    ref = _LAYERS.get(slot)
    module = ref() if ref is not None else None
    if module is None:
        raise RuntimeError(f"no live attention layer holds compile slot {slot}")
    return module


@torch.library.custom_op("hf_ring::ring_flash_attention", mutates_args=())
def ring_flash_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sinks: Optional[torch.Tensor],
    cu_seq_lens_q: Optional[torch.Tensor],
    cu_seq_lens_k: Optional[torch.Tensor],
    handle: torch.Tensor,
    layer: int,
    dropout: float,
    scaling: Optional[float],
    sliding_window: Optional[int],
    softcap: Optional[float],
    is_causal: Optional[bool],
    record: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ring_flash attention call of a compiled forward, run eagerly.

    Args:
        query: ``(batch, n_heads, seq_local, head_dim)``; key, value ``(batch, n_kv_heads,
            seq_local, head_dim)`` (value's last dim may differ); one float dtype.
        sinks: ``(n_heads,)`` float (the layer's ``s_aux``), or None.
        cu_seq_lens_q, cu_seq_lens_k: int32 ``(n_docs + 1,)`` global document boundaries
            of a packed row, or None.
        handle: 0-d int64, the forward's context (:func:`register_context`).
        layer: the layer's slot (:func:`register_layer`).
        dropout, scaling, sliding_window, softcap, is_causal: the layer's attention keywords.
        record: keep the autograd graph for the backward.

    Returns:
        ``out`` ``(batch, seq_local, n_heads, value_dim)`` in q's dtype, contiguous, and the tape id
        (0-d int64).
    """
    context, module = context_of(handle), layer_of(layer)
    OP_CALLS[layer] += 1

    def run(q, k, v, s):
        kwargs: dict[str, Any] = {CONTEXT_KWARG: context}
        for name, value_ in (("s_aux", s), ("cu_seq_lens_q", cu_seq_lens_q), ("cu_seq_lens_k", cu_seq_lens_k),
                             ("is_causal", is_causal)):
            if value_ is not None:
                kwargs[name] = value_
        # Deferred import: attention.py imports this module to route compiled calls here.
        from hf_ring.hf.attention import ring_flash_attention_forward
        out, _ = ring_flash_attention_forward(module, q, k, v, None, dropout, scaling, sliding_window, softcap,
                                              **kwargs)
        return (out.contiguous(),)  # contiguous, as the fake implementation promises

    (out,), tape = run_taped(run, (query, key, value, sinks), record)
    return out, tape


@ring_flash_attention_op.register_fake
def _(query, key, value, sinks, cu_seq_lens_q, cu_seq_lens_k, handle, layer, dropout, scaling, sliding_window,
      softcap, is_causal, record):
    b, h, s, _ = query.shape
    out = query.new_empty((b, s, h, value.shape[-1]))
    return out, torch.empty((), dtype=torch.int64)


def _setup(ctx, inputs, output) -> None:
    query, key, value, sinks = inputs[:4]
    ctx.save_for_backward(output[1], query, key, value, sinks)


def _backward(ctx, dout, _dtape):
    tape, query, key, value, sinks = ctx.saved_tensors
    grads = tape_backward(tape, [dout], [query, key, value, sinks])
    dsinks = grads[3] if sinks is not None else None
    return grads[0], grads[1], grads[2], dsinks, *(None,) * 10


ring_flash_attention_op.register_autograd(_backward, setup_context=_setup)


def compiled_attention(
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
) -> Optional[tuple[torch.Tensor, None]]:
    """What ``ring_flash_attention_forward`` runs while dynamo traces it: the op when the
    ring runs (shapes as there), else None (local attention, traced as it is)."""
    context = kwargs.get(CONTEXT_KWARG)
    packed = kwargs.get("cu_seq_lens_q") is not None
    if context is None or (context.state is None and not packed):
        return None
    refuse_uncomputed(module, kwargs)
    if context.generation is not None:
        raise NotImplementedError(
            f"{layer_name(module)}: generation under context parallelism is not supported inside "
            "torch.compile (a prefill and its decode steps keep their cache through the forward's context); "
            "generate with the uncompiled model (the module you passed to torch.compile)"
        )
    if attention_mask is not None and context.state is not None:
        raise ValueError(f"{layer_name(module)} received an attention mask under context parallelism; "
                         "ring_flash takes none (right padding is accepted at the model's input)")
    slot = module.__dict__.get(SLOT_ATTR)
    if slot is None:
        raise RuntimeError(f"{layer_name(module)} runs ring_flash under torch.compile but was not guarded "
                           "(no compile slot); create the model with attn_implementation='ring_flash' after "
                           "`import hf_ring`, or call hf_ring.hf.attention.guard_model(model)")
    query, key, value = one_dtype(query, key, value)
    sinks = kwargs.get("s_aux")
    record = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, sinks))
    out, _ = torch.ops.hf_ring.ring_flash_attention(
        query, key, value, sinks, kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"),
        getattr(context, HANDLE_ATTR), slot, float(dropout), scaling, sliding_window, softcap,
        kwargs.get("is_causal"), record)
    return out, None


__all__ = ["HANDLE_ATTR", "OP_CALLS", "SLOT_ATTR", "compiled_attention", "context_of", "layer_of", "register_context",
           "register_layers", "ring_flash_attention_op"]
