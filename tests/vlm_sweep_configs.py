"""Tiny configs for every image-text family of the installed transformers (the multimodal sweep).

Why: hf_ring's contract holds for whatever family a user loads, and the image-text families
are whatever transformers' auto mappings know (``family_names``): a family added by the next
release shows up here, and in the sweep, as unswept or refused, never missing.

``build_config(name)`` starts from the family's own config class and shrinks each sub-config:

- the text sub-config (``text_config``): the text sweep's tiny config of its model type
  (``tests/model_sweep_configs.py``: hidden 64, 2 layers, 4 query heads over 2 KV heads of
  16, vocabulary 128), where its model type is one transformers registers;
- every other sub-config (vision towers, audio towers, Q-formers, resamplers): ``VISION``
  where the sub-config has the attribute (width 32, one block, two heads);
- the top-level config: token ids beyond the tiny vocabulary moved into it (120 and up).

The families whose batches are written by hand (checked against one process) have their
config in ``tests/vlm_cases.py`` or ``tests/vlm_sweep_cases.py`` instead (``checked_cases``
in ``tests/vlm_sweep.py``); the ones built here only need to build and reach their base
model's forward, where hf_ring refuses them. Must not import hf_ring.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import sys
from typing import Any

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from model_sweep_configs import COMMON, WRITTEN_FOR, build_config as tiny_text_config

__all__ = ["WRITTEN_FOR", "build_config", "family_names", "model_class_name"]

VOCAB = 128
FIRST_SPECIAL = 120  # token ids the config names are moved to 120, 121, ... (under VOCAB)

# Applied to every non-text sub-config, where it has the attribute.
VISION: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    depth=1,
    num_layers=1,
    num_attention_heads=2,
    num_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    embed_dim=32,
    d_model=32,
    encoder_layers=1,
    encoder_attention_heads=2,
    encoder_ffn_dim=64,
    projection_dim=32,
    vision_output_dim=64,  # Llama 4's tower and adapter
    projector_input_dim=64,
    projector_output_dim=64,
    vocab_size=64,  # Ovis2's visual vocabulary
    mlp_ratio=2,
    out_hidden_size=64,  # the tiny text width, where a tower projects into it
    text_hidden_size=64,
)


def family_names() -> list[str]:
    """Every image-text(-to-text) model type of the installed transformers."""
    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def model_class_name(name: str) -> str:
    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[name]


def _shrunk(sub: PretrainedConfig, kwargs: dict[str, Any]) -> PretrainedConfig:
    sub = copy.deepcopy(sub)
    for key, value in kwargs.items():
        if hasattr(sub, key):
            old = getattr(sub, key)
            if isinstance(old, float) and isinstance(value, int):
                value = float(value)  # configs that validate their fields' types
            try:
                setattr(sub, key, value)
            except (AttributeError, TypeError, ValueError):
                pass  # a derived, read-only field
    return sub


def _text(sub: PretrainedConfig) -> PretrainedConfig:
    try:
        text = tiny_text_config(sub.model_type)
    except Exception:  # noqa: BLE001 - a text config the text sweep's tables do not build
        text = _shrunk(sub, COMMON)
    _shrink_mrope(text, sub)
    return text


def _uses_mrope(config: PretrainedConfig) -> bool:
    """Whether the family's modeling code reads M-RoPE sections (with a default of its own
    where the config has none)."""
    module = sys.modules.get(type(config).__module__.replace(".configuration_", ".modeling_"))
    if module is None:
        try:
            module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
        except Exception:  # noqa: BLE001 - no modeling module of that name
            return False
    return "mrope_section" in inspect.getsource(module)


def _shrink_mrope(text: PretrainedConfig, defaults: PretrainedConfig) -> None:
    """M-RoPE's sections (temporal, height, width) resized to the tiny head's rotary half,
    in the default's proportions (Qwen's 2 : 3 : 3 where the config has none)."""
    rope = dict(getattr(text, "rope_parameters", None) or {})
    section = rope.get("mrope_section") or (getattr(defaults, "rope_parameters", None) or {}).get("mrope_section")
    if not section and not _uses_mrope(defaults):
        return
    section = section or [2, 3, 3]
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    half = int(head_dim * rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))) // 2
    sizes = [max(1, round(half * s / sum(section))) for s in section]
    sizes[-1] += half - sum(sizes)
    text.rope_parameters = {**rope, "mrope_section": sizes}


def _special_tokens(config: PretrainedConfig) -> dict[str, int]:
    """Token ids of the config (image, video, boundaries) beyond the tiny vocabulary, renumbered."""
    moved, next_id = {}, FIRST_SPECIAL
    for key, value in sorted(vars(config).items()):
        if (key.endswith(("_token_id", "_token_index", "_token_idx"))) and isinstance(value, int) and value >= VOCAB:
            moved[key], next_id = min(next_id, VOCAB - 1), next_id + 1
    return moved


def build_config(name: str) -> PretrainedConfig:
    """The tiny config of image-text family ``name`` (a model type)."""
    config_class = CONFIG_MAPPING[name]
    defaults = config_class()
    subs = {}
    for key in getattr(config_class, "sub_configs", {}):
        sub = getattr(defaults, key, None)
        if not isinstance(sub, PretrainedConfig):
            continue
        subs[key] = _text(sub) if key in ("text_config", "decoder") else _shrunk(sub, VISION)
    kwargs = {**subs, **_special_tokens(defaults)}
    # Dropouts and router noise keep the family's defaults (issue 36), as in the text sweep.
    return config_class(**kwargs)
