"""Detector: position biases a model adds to its attention mask (ALiBi), which the ring
never reads. Refused under CP and on packed rows.

Why: transformers 5.25 moved Falcon onto the attention interface, and an ALiBi Falcon
(``config.alibi=True``) now builds its position bias into the float mask it hands every
attention layer (``FalconModel.forward``: the causal mask, materialised, plus the ALiBi
slopes times the key positions). Without CP ``ring_flash`` is SDPA with that mask: exact.
Under CP the mask builder returns no mask (the ring computes the causal mask from global
positions), so the bias would have nowhere to go; on packed rows the ring reads no mask
either. Refused by name rather than left to fail inside the model's own code.

Owns: ``refusals``. Must not import: Trainer, TRL, hf_ring's training or memory layers.
"""

from __future__ import annotations

from typing import Any, Iterator

from hf_ring.hf.support.reading import Modules, first


def refusals(config: Any, modules: Modules) -> Iterator[str]:
    """One refusal (formatted with ``{where}``) when the config asks for ALiBi biases: Falcon's
    ``alibi``, MPT's ``attn_config.alibi``."""
    attn_config = first(config, "attn_config")
    alibi = bool(first(config, "alibi")) or bool(getattr(attn_config, "alibi", False))
    if alibi:
        yield (
            f"{type(config).__name__} has alibi=True: the model adds ALiBi position biases to the attention "
            "mask it hands its attention layers, which ring_flash does not read {where} (the ring builds "
            "the causal mask from global positions, and no bias); train it without context parallelism "
            "and without packing, or use a variant with rotary positions (alibi=False)"
        )
