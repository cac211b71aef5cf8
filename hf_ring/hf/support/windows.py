"""Detector: sliding windows and attention chunks as the config sets them, whatever the
model passes to the attention function. Qwen2-MoE, PhiMoE and Llama 4 apply theirs
through the mask only, which ring_flash under CP (and on packed rows) does not take: they
are exact only for sequences no longer than the window or chunk, and bounded there. The
ring computes a sliding window on dense rows when the attention layers pass it as
``sliding_window=`` to the attention function (Mistral, Mixtral, Gemma 2/3, Qwen2,
GPT-OSS, Cohere 2, ...): such models are bounded on packed rows only.

Whether a layer passes its window is read from its forward's source, through
``hf_ring.patches.transformers`` (how transformers writes a forward is its implementation
detail). Owns: ``bounds``, ``passes_window``. Must not import: Trainer, TRL, hf_ring's
training or memory layers.
"""

from __future__ import annotations

from typing import Any, Iterator

from hf_ring.hf.support.reading import Bound, Modules, attention_modules, config_values, first, listed, smallest
from hf_ring.patches.transformers import forward_passes_keyword


def bounds(config: Any, modules: Modules) -> Iterator[Bound]:
    """The bound of the config's sliding window and of its attention chunks, if any."""
    window = smallest(config, "sliding_window")
    # Qwen2 / Qwen3-MoE clear the window when use_sliding_window is False, Qwen2-MoE sets it to 0.
    if window is not None and not all(v is False for v in config_values(config, "use_sliding_window")):
        # Key j is visible to query i when 0 <= i - j < window: a window of at least the
        # span masks nothing.
        measure = "packed" if passes_window(modules) else "span"
        yield from _masked_layers(config, "sliding_window", window, "sliding_attention", "a sliding window",
                                  measure)
    chunk = smallest(config, "attention_chunk_size")
    if chunk is not None:
        # Query i sees key j only in the same chunk (i // chunk == j // chunk): a chunk of
        # at least the span masks nothing.
        yield from _masked_layers(config, "attention_chunk_size", chunk, "chunked_attention", "chunked attention")


def passes_window(modules: Modules) -> bool:
    """Whether every attention layer hands its window to the attention function: the
    forward of its class passes ``sliding_window=``. Qwen2-MoE and PhiMoE do not: their
    window lives in the mask only (Qwen2-MoE even sets a ``sliding_window`` attribute it
    never passes, so the attribute cannot tell them apart; the call can). Source that
    cannot be read counts as not passing: refused, never silently wrong."""
    classes = {type(m) for _, m in attention_modules(modules)}
    return bool(classes) and all(forward_passes_keyword(cls, "sliding_window") for cls in classes)


def _masked_layers(
    config: Any, field: str, size: int, kind: str, what: str, measure: str = "span"
) -> Iterator[Bound]:
    """The bound of a window or chunk of ``size`` tokens on the layers of ``kind`` (every
    layer when the config has no layer_types: Mistral, Mixtral, PhiMoE, Starcoder2);
    ``measure`` ``"packed"`` where the ring computes it on dense rows."""
    kinds = first(config, "layer_types")
    layers = [i for i, k in enumerate(kinds) if k == kind] if isinstance(kinds, (list, tuple)) else None
    if layers == []:
        return
    on = "every layer" if layers is None else f"layers {listed([str(i) for i in layers], 8)}"
    if measure == "packed":
        message = (
            f"config.{field}={size} gives {on} {what} of {size} tokens, which ring_flash computes "
            "on dense rows but not yet {where} (packed rows); this forward's longest document has "
            "{length} tokens. Use documents of at most {limit} tokens, or dense rows (no packing)"
        )
    else:
        message = (
            f"config.{field}={size} gives {on} {what} of {size} tokens, which {{where}} ring_flash does "
            "not compute (the model applies it through its mask only, not by passing it to the "
            "attention function, so ring_flash attends to the whole causal past); this forward's "
            "longest sequence (document) has {length} tokens. Use sequences of at most {limit} "
            "tokens, or train without context parallelism and without packed rows"
        )
    yield Bound(size + 1, measure, message)
