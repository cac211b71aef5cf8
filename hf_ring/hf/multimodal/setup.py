"""Guarding an image-text model: where the hooks go, and what the outer model refuses.

A model that asks for ``ring_flash`` and holds a language model inside its base model
(``Qwen2_5_VLModel.language_model``, ``LlavaModel.language_model``) is set up so:

- the **base model** (the outer ``*VLModel``) gets a pre-hook that, under context
  parallelism, refuses a family hf_ring has not checked (``families.py``) and a cache, takes a
  digest of the full batch, reads the full batch's bidirectional spans (Gemma 3, PaliGemma:
  from ``token_type_ids``), and marks the forward (``shard.CURRENT``) so that its language
  model shards what it receives; on packed rows without CP it marks the forward with the
  spans only (nothing is cut); a forward hook (run on errors too) ends the mark;
- the **language model** gets the ring guard of a text model (``hf_ring.hf.guard``: its
  attention layers, the validated context, the check after the forward) and, before it, the
  sharding hook (``shard.py``);
- the **vision tower** (everything else in the base model) runs on the full images on every
  rank: its attention is set to ``"sdpa"`` (what ``ring_flash`` computes without context
  parallelism anyway) and the guard it got as a model of its own is lifted;
- the **head** (``*ForConditionalGeneration``: one logit per token) refuses ``labels`` under
  CP as a text model's head does (its loss would be a mean over this rank's shard).

Owns the setup and the outer model's refusals. Must not import: the Trainer, TRL, hf_ring's
training or memory layers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from transformers import PreTrainedModel

from hf_ring.hf.guard import bind_arguments, guard_head, guard_model, unguard
from hf_ring.hf.multimodal.families import FAMILIES, family_refusal, language_model_of
from hf_ring.hf.multimodal.shard import CURRENT, FullBatch, shard_language_model_inputs
from hf_ring.hf.support.tensor_parallel import check_image_text_beside_tp
from hf_ring.hf.multimodal.tower import split_tower
from hf_ring.hf.support import RING_FLASH, check_model_supported
from hf_ring.patches.transformers import attn_implementation
from hf_ring.patterns.state import get_context_parallel_state
from hf_ring.patterns.validation import inputs_digest

# Flags in the modules' own __dict__ (copies of the model carry them, as the guard's do).
_ENTRY = "_hf_ring_multimodal_entry"
_SHARDING = "_hf_ring_multimodal_sharding"
# What the digest of a full batch reads: inputs every rank of a CP group must share (the
# pixel values by their bits: ranks holding the same ids but other images would train on a
# mixture of both without a word).
_DIGESTED = ("input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw", "position_ids", "image_sizes",
             "pixel_values", "pixel_values_videos", "token_type_ids")


def guard_multimodal(model: nn.Module) -> bool:
    """Set ``model`` up as an image-text model if it is one (idempotent); False for a text model."""
    base = getattr(model, "base_model", model)
    language_model = language_model_of(base)
    if language_model is None:
        return False
    if base is not model:
        guard_head(model, per_token=type(model).__name__.endswith(("ForConditionalGeneration", "ForCausalLM")))
    unguard(base, subtree=False)  # the guard sits on the language model
    if not base.__dict__.get(_ENTRY):
        base.register_forward_pre_hook(_enter, with_kwargs=True)
        base.register_forward_hook(_leave, always_call=True)
        base.__dict__[_ENTRY] = True
    if type(base).__name__ not in FAMILIES:
        return True  # refused by name under CP (_enter); without CP it runs as transformers' own
    for child in base.children():
        if child is not language_model:
            _run_outside_the_ring(child)
    family = FAMILIES[type(base).__name__]
    if family.tower is not None:
        split_tower(getattr(base, family.tower))
    check_model_supported(language_model)
    guard_model(language_model)
    if not language_model.__dict__.get(_SHARDING):
        # Before the guard's own pre-hook: the guard must see the shards.
        language_model.register_forward_pre_hook(shard_language_model_inputs, with_kwargs=True, prepend=True)
        language_model.__dict__[_SHARDING] = True
    return True


def _run_outside_the_ring(tower: nn.Module) -> None:
    """A vision tower or projector: whole images on every rank, transformers' SDPA attention."""
    for m in tower.modules():
        if isinstance(m, PreTrainedModel):
            unguard(m)
            if attn_implementation(m.config) == RING_FLASH:
                m.config._attn_implementation = "sdpa"


def _refuse(inputs: dict[str, Any], where: str) -> None:
    cache = next((inputs[n] for n in ("cache", "past_key_values") if inputs.get(n) is not None), None)
    if cache is not None or inputs.get("use_cache") is True or inputs.get("cache_position") is not None:
        raise NotImplementedError(
            f"a KV cache / generate() is not supported {where}: each rank's language model holds a shard "
            "of the sequence, so a cache would hold a shard of K/V; pass no cache and use_cache=False, and "
            "generate without context parallelism: with hf_ring.context_parallel_suspended(): model.generate(...)"
        )


def _digest(inputs: dict[str, Any], device: torch.device) -> torch.Tensor:
    """0-d int64: the digest of the full batch's inputs (token ids, grids, the bits of the
    pixel values), equal on every rank that holds the same batch; no host sync."""
    return inputs_digest([inputs.get(name) for name in _DIGESTED], device)


def _enter(base: nn.Module, args: tuple, kwargs: dict):
    state = get_context_parallel_state()
    packed = kwargs.get("cu_seq_lens_q") is not None
    if state is None or state.cp_size == 1:
        if packed:
            _enter_packed_without_cp(base, args, kwargs)
        return None
    where = f"under context parallelism (cp_size={state.cp_size})"
    refusal = family_refusal(base, where + (" with packed rows (cu_seq_lens_q)" if packed else ""), packed=packed)
    if refusal is not None:
        raise NotImplementedError(refusal)
    check_image_text_beside_tp(base, language_model_of(base), state.tp_size)
    try:
        inputs = bind_arguments(base, args, kwargs)
    except TypeError:
        return None  # arguments the forward does not take: let it raise its own error
    _refuse(inputs, f"for {type(base).__name__} {where}")
    device = next((t.device for t in inputs.values() if isinstance(t, torch.Tensor)), torch.device("cpu"))
    family = FAMILIES[type(base).__name__]
    mask = inputs.get("attention_mask")
    spans = _spans(base, family, inputs, mask, f"{type(base).__name__} {where}")
    CURRENT.set(FullBatch(family, state, _digest(inputs, device), spans, mask if spans is not None else None))
    return None


def _enter_packed_without_cp(base: nn.Module, args: tuple, kwargs: dict) -> None:
    """Packed rows without CP run ring_flash's varlen ring, which computes causal attention
    per document: a family not in the table may need more (refused), and a family's
    bidirectional blocks (Gemma 3's) go down as spans, as under CP."""
    where = "with packed rows (cu_seq_lens_q)"
    refusal = family_refusal(base, where, packed=True)
    if refusal is not None:
        raise NotImplementedError(refusal)
    family = FAMILIES[type(base).__name__]
    if family.spans is None:
        return
    try:
        inputs = bind_arguments(base, args, kwargs)
    except TypeError:
        return  # arguments the forward does not take: let it raise its own error
    mask = inputs.get("attention_mask")
    spans = _spans(base, family, inputs, mask, f"{type(base).__name__} {where}")
    if spans is not None:
        CURRENT.set(FullBatch(family, None, None, spans, mask))


def family_window(base: nn.Module):
    """The language model's sliding window (None: none)."""
    text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    return getattr(text, "sliding_window", None)


def _spans(base: nn.Module, family, inputs: dict[str, Any], mask, where: str):
    """The full batch's bidirectional spans for a family whose model builds them into its
    mask (None: a family without, or no ``token_type_ids``: the model then builds a causal
    mask), cut at a packed row's documents' boundaries. One host sync. A span over padding
    is refused: the model's mask hides padded keys, the ring drops the right-padding mask (no
    real token sees a later one without spans)."""
    types = inputs.get("token_type_ids")
    if family.spans is not None and types is None and family.causal_by_mask:
        raise NotImplementedError(
            f"{where}: {family.name} needs token_type_ids under context parallelism (0 on the prefix: the image "
            "and the prompt, 1 on the suffix); without them its mask is not causal OR prefix (its layers are "
            "flagged bidirectional), which the ring does not compute"
        )
    if family.spans is None or types is None:
        return None
    if not family.window_cuts_spans and family_window(base) is not None:
        raise NotImplementedError(
            f"{where}: {family.name}'s sliding layers let a block's tokens see each other beyond the window "
            "(window-causal OR block), and the ring computes window AND (causal OR block) (Gemma 3's); run "
            f"{family.name} with a sliding window without context parallelism"
        )
    padded = isinstance(mask, torch.Tensor) and mask.dim() == 2
    real = mask.to(device=types.device, dtype=torch.bool) if padded else torch.ones(types.shape, dtype=torch.bool,
                                                                                   device=types.device)
    try:
        spans = family.spans(types, real)
        documents = inputs.get("cu_seq_lens_q")
        if documents is not None:  # one host sync, as the language model's cut makes anyway
            spans = spans.cut_at(torch.as_tensor(documents).reshape(-1).tolist())
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    if padded:
        real = real.tolist()
        for r, row in enumerate(spans.rows):
            if any(not all(real[r][a:b]) for a, b in row):
                raise ValueError(f"{where}: a bidirectional span of row {r} (a {family.name} block) covers "
                                 "padding (attention_mask 0); pad after the block's last token")
    return spans


def _leave(base: nn.Module, args: tuple, output: Any):
    CURRENT.set(None)
    return None
