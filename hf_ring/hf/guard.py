"""Makes sure that, under context parallelism, every attention layer of a ``ring_flash``
model really runs the ring, and that the model's inputs are ones the ring can serve.

Why: a ring that silently becomes local attention (a transformers upgrade that routes a
layer to another attention function, a config switched to "sdpa") trains a wrong model
without a word. A forward pre-hook on the model's base model (the ``LlamaModel`` inside
``LlamaForCausalLM``: it sees every input and runs every layer) validates the inputs once
per forward (``hf_ring.hf.cp_inputs``) and opens a record; ``ring_flash`` notes in it
every layer that ran the ring; the forward hook compares that with the model's attention
layers and raises if any is missing.

Models created with ``attn_implementation="ring_flash"`` after ``import hf_ring`` are
guarded automatically (``patches/transformers.py`` calls ``guard_if_requested`` after
``PreTrainedModel.post_init`` and ``set_attn_implementation``); ``guard_model`` does it
by hand. Without context parallelism (no active state, or ``cp_size == 1``) the guard
only checks packed-row inputs.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from typing import Any, Optional

import torch.nn as nn

from hf_ring.hf.cp_inputs import check_packed_inputs, validate_cp_inputs
from hf_ring.ring.groups import get_context_parallel_state

RING_FLASH = "ring_flash"
# Flags kept in the modules' own __dict__, so that copies of a model (copy.deepcopy for a
# reference model, pickling) stay guarded: the hooks are module-level functions.
_GUARDED_MODEL = "_hf_ring_guarded_model"
_GUARDED_LAYER = "_hf_ring_guarded_layer"

_CURRENT = threading.local()


def _is_attention_module(module: nn.Module) -> bool:
    # Transformers' decoder attention classes (LlamaAttention, Qwen2Attention, ...) are
    # the modules that call the attention interface; each carries its layer index.
    return type(module).__name__.endswith("Attention") and hasattr(module, "layer_idx")


def _attention_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if m.__dict__.get(_GUARDED_LAYER)}


@functools.lru_cache(maxsize=None)
def _forward_signature(model_type: type) -> inspect.Signature:
    return inspect.signature(model_type.forward)


class _ForwardRecord:
    """Which attention layers ran the ring during one guarded forward."""

    def __init__(self, model: nn.Module) -> None:
        self.model = weakref.ref(model)
        self.ran_ring: set[int] = set()


def _bind(model: nn.Module, args: tuple, kwargs: dict) -> tuple[dict[str, Any], bool]:
    """The forward's arguments by name (``**kwargs`` flattened in), and whether the forward
    takes a ``use_cache`` argument."""
    signature = _forward_signature(type(model))
    bound = signature.bind_partial(model, *args, **kwargs).arguments
    bound.pop(next(iter(signature.parameters)))
    takes_any = False
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            bound.update(bound.pop(name, {}))
            takes_any = True
    return bound, takes_any or "use_cache" in signature.parameters


def _nested_in_active_forward(model: nn.Module) -> bool:
    record = getattr(_CURRENT, "record", None)
    outer = record.model() if record is not None else None
    if outer is None or outer is model:
        return False
    # A record left behind by a forward that raised is stale unless its model holds this
    # one; a model's forward never runs inside itself.
    return any(m is model for m in outer.modules())


def _pre_forward(model: nn.Module, args: tuple, kwargs: dict):
    if _nested_in_active_forward(model):
        return None
    _CURRENT.record = None
    inputs, takes_use_cache = _bind(model, args, kwargs)
    state = get_context_parallel_state()
    if state is None or state.cp_size == 1:
        check_packed_inputs(inputs)
        return None
    implementation = model.config._attn_implementation
    if implementation != RING_FLASH:
        raise RuntimeError(
            f"{type(model).__name__} was set up for attn_implementation={RING_FLASH!r} but its config "
            f"now says {implementation!r}; under context parallelism (cp_size={state.cp_size}) every "
            f"attention layer must run the ring: call model.set_attn_implementation({RING_FLASH!r})"
        )
    if not _attention_layers(model):
        raise NotImplementedError(
            f"found no attention layers in {type(model).__name__} (modules named *Attention with a "
            "layer_idx), so hf_ring cannot check that each runs the ring; this model is not "
            "supported under context parallelism"
        )
    validate_cp_inputs(inputs, state)
    _CURRENT.record = _ForwardRecord(model)
    if inputs.get("use_cache") is None and takes_use_cache:
        # A cache filled under CP holds only this rank's shard of K/V: useless to continue
        # from, so none is built unless asked for (and asking is refused above).
        return args, {**kwargs, "use_cache": False}
    return None


def _post_forward(model: nn.Module, args: tuple, output: Any):
    record = getattr(_CURRENT, "record", None)
    if record is None or record.model() is not model:
        return None
    _CURRENT.record = None
    missing = [name for name, m in _attention_layers(model).items() if id(m) not in record.ran_ring]
    if missing:
        raise RuntimeError(
            f"ring attention was bypassed: under context parallelism these attention layers of "
            f"{type(model).__name__} did not run ring_flash in this forward: {', '.join(missing)}. "
            "Their attention went to another function (a transformers version hf_ring does not "
            "know, or a patched layer), which computes attention over this rank's shard only. "
            "Use a supported transformers release, or report the model"
        )
    return None


def note_ring_call(module: nn.Module) -> None:
    """Record that ``module`` ran the ring in the current guarded forward.

    Raises RuntimeError when ``module`` belongs to no guarded model: nothing would then
    check that the other layers run the ring too.
    """
    if not module.__dict__.get(_GUARDED_LAYER):
        raise RuntimeError(
            f"ring_flash ran under context parallelism in {type(module).__name__}, which belongs to no "
            "guarded model, so a layer that bypasses the ring would go unnoticed; create the model "
            f"with attn_implementation={RING_FLASH!r} after `import hf_ring`, or call "
            "hf_ring.hf.guard.guard_model(model)"
        )
    record: Optional[_ForwardRecord] = getattr(_CURRENT, "record", None)
    # Outside a forward (activation recomputation during backward) there is nothing to count.
    if record is not None:
        record.ran_ring.add(id(module))


def guard_model(model: nn.Module) -> None:
    """Install the ring guard on ``model``'s base model (idempotent).

    The base model (``model.base_model``, e.g. the ``LlamaModel`` of a ``LlamaForCausalLM``)
    receives every input and runs every decoder layer; its attention layers are those
    whose class name ends in ``Attention`` and that carry a ``layer_idx``.
    """
    base = getattr(model, "base_model", model)
    if base.__dict__.get(_GUARDED_MODEL):
        return
    for m in base.modules():
        if _is_attention_module(m):
            m.__dict__[_GUARDED_LAYER] = True
    base.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    base.register_forward_hook(_post_forward)
    base.__dict__[_GUARDED_MODEL] = True


def guard_if_requested(model: nn.Module) -> None:
    """Guard ``model`` if its config asks for ``ring_flash`` (the transformers patch hook)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == RING_FLASH:
        guard_model(model)
