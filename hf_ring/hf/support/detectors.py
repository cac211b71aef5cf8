"""The list of detectors and the entry points of model support.

- :func:`check_model_under_cp`: whenever the ring runs (``cp_size > 1``, or packed rows
  without CP), once per guarded forward, after the inputs were validated (so every rank
  passes the same lengths and raises the same error). The model's structure is read on
  the first call (every detector of ``REFUSALS`` and ``BOUNDS``) and cached in the model's
  ``__dict__``; later calls only compare the forward's lengths with the cached bounds.
- :func:`handed_to_the_ring`: what the model computes outside its attention function that
  the ring computes in it (windows and chunks applied through the mask only, Llama 4's
  temperature), read with the rest and handed down by the guard.
- :func:`check_model_supported`: when a model asks for ``ring_flash`` (model creation,
  ``set_attn_implementation``): the detectors of ``AT_CREATION``, which refuse models that
  ``ring_flash`` cannot run with or without CP.

A detector of ``REFUSALS`` or ``BOUNDS`` takes ``(config, modules)`` (the text stack's
named modules) and yields refusals formatted with ``{where}``, or bounds (:class:`Bound`);
one of ``AT_CREATION`` takes the model and returns a refusal or None. The first refusal found is
raised, in the order of the lists.

Owns: the lists, the per-model cache, the entry points. Must not import: Trainer, TRL,
hf_ring's training or memory layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch.nn as nn

from hf_ring.hf.support import interface, layer_kinds, position_bias, rope, temperature, token_mixers, windows
from hf_ring.hf.support.reading import RING_FLASH, Bound, Modules, text_stack
from hf_ring.patches.transformers import attn_implementation

# Cached in the module's own __dict__, like the guard's flags: copies of the model carry it.
_CACHE = "_hf_ring_model_support"

# Run when a model asks for ring_flash: the first two read the config and the class only
# (they run at the end of PreTrainedModel.__init__, before the layers are built).
AT_CREATION: tuple[Callable[[nn.Module], Optional[str]], ...] = (
    layer_kinds.uncomputed_attention,
    interface.class_table,
    interface.bypassing_modules,
)
# Run once per model (and config) when the ring first runs.
REFUSALS: tuple[Callable[[Any, Modules], Iterable[str]], ...] = (
    token_mixers.refusals,
    layer_kinds.refusals,
    position_bias.refusals,  # before dropped_keywords: an ALiBi Falcon is refused for its ALiBi
    interface.dropped_keywords,
)
BOUNDS: tuple[Callable[[Any, Modules], Iterable[Bound]], ...] = (
    rope.bounds,
    windows.bounds,
    temperature.bounds,
)


@dataclass(frozen=True)
class Handed:
    """What the model computes outside its attention function that the ring computes in
    it, by ``layer_idx``.

    Attributes:
        windows: the sliding window of each layer that applies it through the mask only
            (``windows.mask_windows``).
        temperatures: ``(floor_scale, attn_scale)`` of each layer that scales its queries by
            Llama 4's temperature of positions numbered within the forward
            (``temperature.rescaled_layers``).
        chunks: the attention chunk of each layer that applies one through the mask only
            (``windows.mask_chunks``).
    """

    windows: dict[int, int] = field(default_factory=dict)
    temperatures: dict[int, tuple[float, float]] = field(default_factory=dict)
    chunks: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Support:
    config_id: int
    refusals: tuple[str, ...]  # formatted with {where}
    bounds: tuple[Bound, ...]
    handed: Handed


def read_model(model: nn.Module) -> _Support:
    """Every detector's findings on ``model`` (its text stack and its config)."""
    config = getattr(model, "config", None)
    modules = list(text_stack(model).named_modules())
    refusals = [found for detect in REFUSALS for found in detect(config, modules)]
    bounds = [found for detect in BOUNDS for found in detect(config, modules)]
    handed = Handed(windows.mask_windows(config, modules), temperature.rescaled_layers(config, modules),
                    windows.mask_chunks(config, modules))
    return _Support(id(config), tuple(refusals), tuple(bounds), handed)


def _support(model: nn.Module) -> _Support:
    """The model's reading, cached in its ``__dict__`` (re-read when its ``config`` object is
    replaced; a config edited in place is not re-read)."""
    support = model.__dict__.get(_CACHE)
    if support is None or support.config_id != id(getattr(model, "config", None)):
        support = read_model(model)
        model.__dict__[_CACHE] = support
    return support


def handed_to_the_ring(model: nn.Module) -> Handed:
    """What the ring must be handed of ``model``'s layers (read once, with the rest)."""
    return _support(model).handed


def check_model_under_cp(
    model: nn.Module, cp_size: int, seq_len: int, doc_lens: Optional[Sequence[int]] = None
) -> None:
    """Refuse a model that the ring cannot run exactly on this forward's lengths.

    Call it whenever the ring runs: under context parallelism (``cp_size > 1``) and for
    packed rows without it (``cp_size == 1`` with ``doc_lens``), after the forward's
    inputs were validated across the CP group, so that every rank raises the same error.
    The model is read on the first call (cached in its ``__dict__``, re-read when its
    ``config`` object is replaced; a config edited in place is not re-read).

    Args:
        model: the model or its base model (``LlamaForCausalLM`` or ``LlamaModel``).
        cp_size: the context-parallel group's size (1: packed rows without CP).
        seq_len: the forward's full (global) row length in tokens, padding included:
            ``local_seq * cp_size``.
        doc_lens: a packed row's global document lengths, or None for dense rows.

    Raises:
        NotImplementedError: naming the module or config field and what to do.
    """
    if cp_size <= 1 and doc_lens is None:
        return  # the ring does not run: ring_flash is transformers' SDPA
    support = _support(model)
    where = f"under context parallelism (cp_size={cp_size})" if cp_size > 1 else "on packed rows"
    if support.refusals:
        raise NotImplementedError(support.refusals[0].format(where=where))
    span = max(doc_lens) if doc_lens else seq_len
    for b in support.bounds:
        if b.measure == "packed_row" and not doc_lens:
            continue
        length = seq_len if b.measure in ("row", "packed_row") else span
        if length >= b.bound:
            raise NotImplementedError(b.message.format(length=length, where=where, limit=b.bound - 1))


def check_model_supported(model: nn.Module) -> None:
    """Refuse a model that asks for ``ring_flash`` but that ``ring_flash`` cannot run, with
    or without CP: its config has attention layers of kinds the ring does not compute, or
    its attention does not go through transformers' attention interface, so would never
    call it.

    Two ways a model's attention can bypass the interface: its modeling module picks the
    attention class from a table keyed by implementation name (Falcon's
    ``FALCON_ATTENTION_CLASSES``, GPT-Neo's), which has no ``ring_flash`` entry and fails
    with ``KeyError: 'ring_flash'`` while the model builds its layers; or its attention
    classes come from a module that does not use ``ALL_ATTENTION_FUNCTIONS`` (Bloom,
    MPT, ...), which would run their own eager or SDPA code instead. The first is
    checked from the model's class alone, so this can run at the end of
    ``PreTrainedModel.__init__``, before the layers are built; the second needs the
    built modules (after ``post_init``). A model that does not ask for ``ring_flash`` is
    left alone.

    Raises:
        NotImplementedError: naming the class and what to do.
    """
    config = getattr(model, "config", None)
    if config is None or attn_implementation(config) != RING_FLASH:
        return
    for detect in AT_CREATION:
        refusal = detect(model)
        if refusal is not None:
            raise NotImplementedError(refusal)


def unrouted_token_mixers(model: nn.Module) -> Optional[str]:
    """The refusal naming ``model``'s token mixers that hf_ring does not run (its routed
    layers excluded: only a guarded ``ring_flash`` model's are), formatted for packed rows
    without CP, or None. For callers that pack rows for a model that may not be guarded."""
    config = getattr(model, "config", None)
    found = list(token_mixers.refusals(config, list(text_stack(model).named_modules())))
    return found[0].format(where="on packed rows") if found else None
