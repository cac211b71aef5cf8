"""Detector: Llama 4's attention temperature tuning on NoPE layers, which scales each query
by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``, with p numbered 0.. over the
tokens the forward holds (the local shard under CP, the whole row in packed rows): exact
while every p + 1 < floor_scale, where the scale is 1 whatever p, and bounded there.

Owns: ``bounds``. Must not import: Trainer, TRL, hf_ring's training or memory layers.
"""

from __future__ import annotations

from typing import Any, Iterator

from hf_ring.hf.support.reading import Bound, Modules, config_values, first, listed, smallest


def bounds(config: Any, modules: Modules) -> Iterator[Bound]:
    """The row-length bound of temperature tuning, when the config turns it on for NoPE layers."""
    if not any(config_values(config, "attn_temperature_tuning")):
        return
    no_rope = first(config, "no_rope_layers")
    # no_rope_layers[i] == 0 marks a NoPE layer (1: RoPE is used).
    nope = [i for i, use_rope in enumerate(no_rope or []) if not use_rope]
    floor_scale = smallest(config, "floor_scale")
    if not nope:
        return
    yield Bound(
        floor_scale or 0,
        "row",
        f"Llama 4 attention temperature tuning (config.attn_temperature_tuning) on NoPE layers "
        f"{listed([str(i) for i in nope], 8)} scales queries by a position the model numbers from 0 "
        "over the tokens it holds, so {where} it would use local positions, not the sequence's; it is "
        "exact only for rows of at most {limit} tokens (config.floor_scale) and this one has {length}. "
        "Use shorter rows, or train without context parallelism and without packed rows",
    )
