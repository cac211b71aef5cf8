"""How model support reads a model: its config's values (one, or one per layer in
transformers 5's heterogeneous configs), the modules that run along the token sequence,
its attention modules, and the bound a detector reports.

Owns: the config readers, the text stack and the towers of other modalities, ``Bound``.
Must not import: Trainer, TRL, hf_ring's training or memory layers, other detectors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch.nn as nn

RING_FLASH = "ring_flash"
# (path, module) pairs of the text stack, as ``named_modules`` gives them.
Modules = list[tuple[str, nn.Module]]

# Sub-trees of another modality inside a language model's base model (Phi-4-multimodal's
# image and audio encoders): their patch and frame convolutions run before the tokens exist.
_TOWER = re.compile(r"(^|_)(vision|visual|image|img|audio|speech|video)")


@dataclass(frozen=True)
class Bound:
    """The model is exact while ``length < bound``, where length is the forward's longest
    attention span (``span``: the sequence, or the longest packed document) or its whole
    row (``row``; ``packed_row``: a packed row's, dense rows unbounded)."""

    bound: int
    measure: str
    message: str  # formatted with {length}, {where}, {limit} (= bound - 1)


def in_tower(path: str) -> bool:
    """Whether the module at ``path`` belongs to another modality's encoder."""
    return any(_TOWER.search(part) for part in path.split("."))


def text_stack(model: nn.Module) -> nn.Module:
    """The modules that run along the language model's token sequence: the base model, or
    its ``language_model`` in a multimodal model (a vision tower's patch convolutions do
    not run along the token sequence)."""
    base = getattr(model, "base_model", model)
    language_model = getattr(base, "language_model", None)
    return language_model if isinstance(language_model, nn.Module) else base


def attention_modules(modules: Modules) -> Modules:
    """The text stack's attention modules: transformers' ``*Attention`` classes, torch's own
    (``nn.MultiheadAttention``) and the towers' left out."""
    return [
        (path, m) for path, m in modules
        if type(m).__name__.endswith("Attention") and not type(m).__module__.startswith("torch.")
        and not in_tower(path)
    ]


def listed(items: Sequence[str], most: int = 4) -> str:
    """The first ``most`` of ``items``, comma-separated, and how many more there are."""
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def layer_configs(config: Any, names: Sequence[str]) -> list[dict[str, Any]]:
    """``names`` read from the config: one dict, or one per layer where transformers 5's
    heterogeneous configs refuse to read a per-layer attribute globally (Gemma 4's
    ``head_dim``: an ``AmbiguousGlobalPerLayerAttributeError``, a RuntimeError)."""
    try:
        return [{name: getattr(config, name, None) for name in names}]
    except RuntimeError:
        layers = getattr(config, "per_layer_config", None) or []
        return [{name: getattr(layer, name, None) for name in names} for layer in layers]


def config_values(config: Any, name: str) -> list[Any]:
    """Every value ``name`` takes in the config (one, or one per layer, see above)."""
    return [layer[name] for layer in layer_configs(config, (name,))]


def smallest(config: Any, name: str) -> Optional[int]:
    """The smallest positive int ``name`` takes in the config, or None."""
    ints = [v for v in config_values(config, name) if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(ints, default=None)


def first(config: Any, name: str) -> Any:
    """The first value ``name`` takes in the config that is not None, or None."""
    return next((v for v in config_values(config, name) if v is not None), None)
