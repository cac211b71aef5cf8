"""Detector: Llama 4's attention temperature tuning on NoPE layers, which scales each query
by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``, with p numbered 0.. over the
tokens the forward holds (the local shard under CP). The layers whose forward computes it
as transformers 4.57.6 / 5.24.0 write it are listed (:func:`rescaled_layers`), and the
ring rescales their queries to the global positions (``hf_ring.hf.sequence_features``;
on packed rows, as transformers does, the row's positions, not each document's). Any
other layer with temperature tuning is exact only while every p + 1 < floor_scale, where
the scale is 1 whatever p, and bounded there.

Owns: ``bounds``, ``rescaled_layers``. Must not import: Trainer, TRL, hf_ring's training
or memory layers.
"""

from __future__ import annotations

from typing import Any, Iterator

from hf_ring.hf.support.reading import Bound, Modules, attention_modules, config_values, first, listed, smallest
from hf_ring.patches.transformers import UnsupportedTransformersVersion, query_temperature


def rescaled_layers(config: Any, modules: Modules) -> dict[int, tuple[float, float]]:
    """``(floor_scale, attn_scale)`` of each attention layer (by ``layer_idx``) that scales
    its queries by the temperature of positions numbered within the forward, as hf_ring
    reads it (the ring then rescales them to the global positions)."""
    if not any(config_values(config, "attn_temperature_tuning")):
        return {}
    found = {}
    for _, m in attention_modules(modules):
        try:
            temperature = query_temperature(m)
        except UnsupportedTransformersVersion:
            continue  # computed another way: bounded below
        if temperature is not None and isinstance(getattr(m, "layer_idx", None), int):
            found[m.layer_idx] = temperature
    return found


def bounds(config: Any, modules: Modules) -> Iterator[Bound]:
    """The row-length bound of temperature tuning, when the config turns it on for NoPE
    layers that the ring does not rescale."""
    if not any(config_values(config, "attn_temperature_tuning")):
        return
    no_rope = first(config, "no_rope_layers")
    # no_rope_layers[i] == 0 marks a NoPE layer (1: RoPE is used).
    rescaled = rescaled_layers(config, modules)
    nope = [i for i, use_rope in enumerate(no_rope or []) if not use_rope and i not in rescaled]
    floor_scale = smallest(config, "floor_scale")
    if not nope:
        return
    yield Bound(
        floor_scale or 0,
        "row",
        f"Llama 4 attention temperature tuning (config.attn_temperature_tuning) on NoPE layers "
        f"{listed([str(i) for i in nope], 8)} scales queries by a position the model numbers from 0 "
        "over the tokens it holds, and these layers' forward does not compute it as hf_ring reads it "
        "(transformers 4.57.6 / 5.24.0), so {where} it would use local positions, not the sequence's; "
        "it is exact only for rows of at most {limit} tokens (config.floor_scale) and this one has "
        "{length}. Use shorter rows, a supported transformers release, or train without context "
        "parallelism and without packed rows",
    )
