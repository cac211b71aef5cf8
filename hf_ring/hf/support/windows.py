"""Detector: sliding windows and attention chunks as the config sets them, whatever the
model passes to the attention function.

The ring computes a sliding window on dense rows. Most families hand it to the attention
function as ``sliding_window=`` (Mistral, Mixtral, Gemma 2/3, Qwen2, GPT-OSS, Cohere 2,
...); Qwen2-MoE and PhiMoE apply theirs through the mask only, which ring_flash under CP
(and on packed rows) does not take, so their windows are read from the config here
(:func:`mask_windows`, per layer) and handed to the ring by the guard. Llama 4's
attention chunks live in the mask only too; they are read the same way, on the layers
``config.layer_types`` marks chunked (:func:`mask_chunks`). Windows are computed on packed
rows too (inside each document); chunks are bounded there (the ring cuts them at row
indices, which a packed row's documents do not share).

Whether a layer passes its window is read from its forward's source, through
``hf_ring.patches.transformers`` (how transformers writes a forward is its implementation
detail). Owns: ``bounds``, ``mask_windows``, ``mask_chunks``. Must not import: Trainer,
TRL, hf_ring's training or memory layers.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from hf_ring.hf.support.reading import Bound, Modules, attention_modules, config_values, first, listed, smallest
from hf_ring.patches.transformers import forward_passes_keyword


def bounds(config: Any, modules: Modules) -> Iterator[Bound]:
    """The bound of the config's attention chunks, if any (sliding windows have none: the
    ring computes them on dense and packed rows, handed down by mask_windows where the
    model applies them through its mask only)."""
    chunk = smallest(config, "attention_chunk_size")
    if chunk is not None:
        # Query i sees key j only in the same chunk of the row (i // chunk == j // chunk,
        # row indices: on a packed row too, whose documents a chunk boundary may cut): a
        # chunk of at least the row masks nothing. Dense rows get it from mask_chunks, where
        # the config's layer types say which layers chunk.
        handed = isinstance(first(config, "layer_types"), (list, tuple))
        yield from _masked_layers(config, "attention_chunk_size", chunk, "chunked_attention", "chunked attention",
                                  "packed_row" if handed else "span")


def mask_chunks(config: Any, modules: Modules) -> dict[int, int]:
    """The attention chunk of each attention layer (by ``layer_idx``) that
    ``config.layer_types`` marks ``"chunked_attention"`` (Llama 4's RoPE layers): its model
    applies ``config.attention_chunk_size`` through the mask only, as transformers' chunked
    mask builder reads it. A config without layer types says no layer: bounded instead."""
    chunk = smallest(config, "attention_chunk_size")
    kinds = first(config, "layer_types")
    if chunk is None or not isinstance(kinds, (list, tuple)):
        return {}
    layers = [getattr(m, "layer_idx", None) for _, m in attention_modules(modules)]
    return {i: chunk for i in layers if isinstance(i, int) and i < len(kinds) and kinds[i] == "chunked_attention"}


def mask_windows(config: Any, modules: Modules) -> dict[int, int]:
    """The sliding window of each attention layer that applies it through the mask only, by
    ``layer_idx``: the config's window on the layers ``config.layer_types`` marks
    ``"sliding_attention"``, or on every layer when it has no layer types (PhiMoE), as
    transformers' mask builders read it.

    A layer applies it through the mask only when the forward of its class does not pass
    ``sliding_window=`` (Qwen2-MoE even sets a ``sliding_window`` attribute it never passes,
    so the attribute cannot tell; the call can). Source that cannot be read counts as not
    passing: the window from the config is then applied, as the mask applies it."""
    window = _config_window(config)
    if window is None:
        return {}
    kinds = first(config, "layer_types")
    found = {}
    for _, m in attention_modules(modules):
        layer = getattr(m, "layer_idx", None)
        if not isinstance(layer, int) or forward_passes_keyword(type(m), "sliding_window"):
            continue
        if not isinstance(kinds, (list, tuple)) or (layer < len(kinds) and kinds[layer] == "sliding_attention"):
            found[layer] = window
    return found


def _config_window(config: Any) -> Optional[int]:
    """The config's sliding window, None where there is none or it is off (Qwen2 / Qwen3-MoE
    clear it when use_sliding_window is False, Qwen2-MoE sets it to 0)."""
    window = smallest(config, "sliding_window")
    if window is None or all(v is False for v in config_values(config, "use_sliding_window")):
        return None
    return window


def _masked_layers(
    config: Any, field: str, size: int, kind: str, what: str, measure: str = "span"
) -> Iterator[Bound]:
    """The bound of a window or chunk of ``size`` tokens on the layers of ``kind`` (every
    layer when the config has no layer_types: Mistral, Mixtral, PhiMoE, Starcoder2);
    ``measure`` ``"packed_row"`` where the ring computes it on dense rows."""
    kinds = first(config, "layer_types")
    layers = [i for i, k in enumerate(kinds) if k == kind] if isinstance(kinds, (list, tuple)) else None
    if layers == []:
        return
    on = "every layer" if layers is None else f"layers {listed([str(i) for i in layers], 8)}"
    if measure == "packed_row":
        message = (
            f"config.{field}={size} gives {on} {what} of {size} tokens of the row, which ring_flash "
            "computes on dense rows but not yet {where} (packed rows); this packed row has {length} "
            "tokens. Use packed rows of at most {limit} tokens, or dense rows (no packing)"
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
