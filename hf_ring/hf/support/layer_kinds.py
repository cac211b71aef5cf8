"""Detector: the kinds of layers a config declares (transformers' ``layer_types`` and the
older per-family lists). Kinds named as attention that ``ring_flash`` does not compute at
all (sparse, indexed, compressed attention) are refused when the model asks for
``ring_flash``; token-mixing kinds (Mamba, linear attention, convolutions) and unknown
kinds are refused under CP and on packed rows.

Owns: the vocabulary of layer kinds, ``uncomputed_attention`` (at model creation),
``refusals`` (under CP). Must not import: Trainer, TRL, hf_ring's training or memory layers.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch.nn as nn

from hf_ring.hf.support.reading import RING_FLASH, Modules, first, listed
from hf_ring.patches.transformers.mixers import is_routed_layer

# Layer kinds (config.layer_types and the older per-family lists) that mix tokens only
# through attention the ring computes, or not at all (MLP / MoE layers are per token).
_RING_LAYER_KINDS = frozenset({"full_attention", "attention", "sliding_attention", "chunked_attention"})
_PER_TOKEN_LAYER_KINDS = frozenset({"moe", "mlp", "dense", "sparse"})
_TOKEN_MIXING_LAYER_KINDS = frozenset(
    {"conv", "linear_attention", "hybrid", "hybrid_sliding", "mamba", "mamba2", "recurrent", "rwkv", "ssm"}
)
# Per-family lists of layer kinds besides transformers' `layer_types` (Jamba and
# Nemotron-H in 4.57, RecurrentGemma), and Nemotron-H's pattern string, one character a
# layer, read through its legend.
_LAYER_KIND_FIELDS = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern")
_PATTERN_LEGEND = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def _uncomputed_attention_kinds(config: Any) -> list[str]:
    """Layer kinds named as attention that are neither the ring's (full, sliding, chunked)
    nor token mixers refused only under CP (linear attention runs whole without CP)."""
    found: set[str] = set()
    for field in _LAYER_KIND_FIELDS:
        kinds = first(config, field)
        if isinstance(kinds, (list, tuple)):
            found |= {
                str(k) for k in kinds
                if "attention" in str(k).lower() and str(k) not in _RING_LAYER_KINDS
                and str(k).lower() not in _TOKEN_MIXING_LAYER_KINDS
            }
    return sorted(found)


def uncomputed_attention(model: nn.Module) -> Optional[str]:
    """The refusal of a model whose config has attention layers ``ring_flash`` does not
    compute with or without CP, or None. Reads the config only (runs before the layers exist)."""
    variants = _uncomputed_attention_kinds(model.config)
    if not variants:
        return None
    return (
        f"{type(model).__name__}'s config has attention layers of kinds {variants} (sparse, indexed "
        f"or compressed attention), which {RING_FLASH!r} does not compute with or without context "
        "parallelism (it computes dense causal attention); use the attention implementation the "
        "model documents (e.g. 'eager') without context parallelism"
    )


def _routed_layers(modules: Modules) -> set[int]:
    """Indices of the decoder layers (``layers.N``) holding a mixer routed to hf_ring's CP ops."""
    found = set()
    for path, m in modules:
        parts = path.split(".")
        if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit() and is_routed_layer(m):
            found.add(int(parts[1]))
    return found


def refusals(config: Any, modules: Modules) -> Iterator[str]:
    """One refusal (formatted with ``{where}``) for the first layer-kind field that names a
    kind other than the ring's attention or per-token layers, or none."""
    for field in _LAYER_KIND_FIELDS:
        kinds = first(config, field)
        if isinstance(kinds, str):
            kinds = [_PATTERN_LEGEND.get(c, c) for c in kinds]
        if not isinstance(kinds, (list, tuple)):
            continue
        others = sorted({str(k) for k in kinds} - _RING_LAYER_KINDS - _PER_TOKEN_LAYER_KINDS)
        # Token-mixing layers whose mixer hf_ring routes to its CP ops run exactly.
        routed = _routed_layers(modules)
        others = [k for k in others if not (
            k.lower() in _TOKEN_MIXING_LAYER_KINDS and all(i in routed for i, kind in enumerate(kinds) if str(kind) == k)
        )]
        if not others:
            continue
        layers = [i for i, k in enumerate(kinds) if str(k) in others]
        mixing = [k for k in others if k.lower() in _TOKEN_MIXING_LAYER_KINDS]
        what = (
            "layers that mix tokens without attention (convolutions, SSM / Mamba, linear attention)"
            if mixing
            else "attention variants the ring does not compute (sparse / indexed / compressed / "
            "non-overlapping windows), or kinds hf_ring does not know"
        )
        yield (
            f"config.{field} has {others} layers (layers {listed([str(i) for i in layers], 8)}): {what}; "
            "{where} ring_flash would compute them wrongly without a word. Train this model without "
            "context parallelism and without packed rows"
        )
        return
