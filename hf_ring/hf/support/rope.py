"""Detector: RoPE variants whose frequencies depend on the largest position in the forward
(``dynamic`` NTK scaling, ``longrope``). Under CP each rank would pick them from the
positions it holds, not from the full sequence's. Transformers' own rotary embeddings
(``dynamic_rope_update``) are handed the sequence's largest position by the guard
(``hf_ring.hf.sequence_features``), which makes them exact, on packed rows too (where,
as transformers does on a packed row, the frequencies follow the row's largest position,
its longest document). A config asking for such RoPE in a model whose rotary modules
transformers' wrapper does not drive is exact only below the length where the
frequencies change, and bounded there.

Owns: the RoPE parameter readers, ``bounds``. Must not import: Trainer, TRL, hf_ring's
training or memory layers.
"""

from __future__ import annotations

from typing import Any, Iterator

from hf_ring.hf.support.reading import Bound, Modules, config_values, smallest
from hf_ring.patches.transformers import length_dependent_rope, reads_max_position


def _rope_dicts(config: Any) -> Iterator[tuple[str, dict]]:
    """Every RoPE parameter dict of the config: transformers 5's ``rope_parameters`` (one
    dict, or one per layer type) and 4.57's ``rope_scaling``, with where each was found."""
    for field in ("rope_parameters", "rope_scaling"):
        for value in config_values(config, field):
            if not isinstance(value, dict):
                continue
            if any(isinstance(v, dict) for v in value.values()):
                for layer_type, sub in value.items():
                    if isinstance(sub, dict):
                        yield f"config.{field}[{layer_type!r}]", sub
            else:
                yield f"config.{field}", value


def handed_max_position(modules: Modules) -> bool:
    """Whether the text stack has rotary embeddings with a length-dependent ``rope_type`` and
    every one is driven by transformers' ``dynamic_rope_update``, which the guard hands the
    sequence's largest position (a family's own would read its shard's positions)."""
    rotaries = [m for _, m in modules if length_dependent_rope(m)]
    return bool(rotaries) and all(reads_max_position(m) for m in rotaries)


def bounds(config: Any, modules: Modules) -> Iterator[Bound]:
    """One bound per length-dependent RoPE parameter dict of the config, unless the model's
    rotary embeddings are handed the sequence's largest position."""
    if handed_max_position(modules):
        return
    max_positions = smallest(config, "max_position_embeddings")
    # The rotary modules' own threshold for recomputing frequencies (transformers sets it
    # from max_position_embeddings; read in case a family sets it otherwise).
    thresholds = [getattr(m, "original_max_seq_len", None) for _, m in modules]
    for where_found, rope in _rope_dicts(config):
        rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        original = rope.get("original_max_position_embeddings")
        original = original or smallest(config, "original_max_position_embeddings")
        if "dynamic" in rope_type:
            # Recomputed from max(position_ids) + 1 once it reaches max_position_embeddings
            # (and reset below it): a rank sees its own shard's largest position. Below
            # the threshold no rank and no full-sequence run recomputes, or all reset.
            limit = min([x for x in (max_positions, original, *thresholds) if isinstance(x, int)], default=0)
            yield Bound(limit, "span", _rope_message(rope_type, where_found, "max_position_embeddings"))
        elif rope_type == "longrope":
            # Long factors once max(position_ids) + 1 exceeds original_max_position_embeddings:
            # the rank holding the last token switches, the others may not.
            limit = original + 1 if isinstance(original, int) else 0
            yield Bound(limit, "span", _rope_message(rope_type, where_found, "original_max_position_embeddings"))


def _rope_message(rope_type: str, where_found: str, threshold: str) -> str:
    return (
        f"{where_found} has rope_type={rope_type!r}, whose frequencies depend on the largest position "
        "in the forward, and this model's rotary embedding is not transformers' dynamic_rope_update, "
        "which hf_ring hands the full sequence's largest position: {where} each rank would pick them "
        "from the positions it holds, and the ranks would disagree. It is exact only for sequences "
        f"(documents) of at most {{limit}} tokens (below {threshold}); this forward has {{length}}. Use "
        "shorter sequences, a RoPE type that does not depend on the length (default, linear, yarn, "
        "llama3), or train without context parallelism and without packed rows"
    )
