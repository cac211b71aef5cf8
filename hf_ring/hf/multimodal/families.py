"""Which image-text models hf_ring has checked under context parallelism, and how each one's
language model takes its inputs.

Why a table: the sharding at the language model's entry is exact only where everything
the model computes along the sequence *before* that entry (the merge of image features
into the placeholder positions, the positions) runs on the full batch, and everything
after it is a text model the ring serves. That was read in each family's modeling code
(transformers 5.24) and tested (``tests/test_cp_vlm.py``); a family nobody read is
refused by name under CP rather than trusted.

What was read, for the families below:

- Qwen2-VL, Qwen2.5-VL (``Qwen2VLModel`` / ``Qwen2_5_VLModel.forward``): token embeddings,
  the vision tower (``get_image_features`` / ``get_video_features``), ``masked_scatter`` of
  the features into the image / video placeholders, then ``compute_3d_position_ids`` ->
  ``get_rope_index`` (3-D M-RoPE, ``(3, batch, seq)``, from the full ``input_ids``, the grids
  and ``mm_token_type_ids``; ``None`` without ``mm_token_type_ids``), all on the full
  sequence; then ``language_model(inputs_embeds, position_ids, attention_mask)``. The text
  model numbers ``arange(inputs_embeds.shape[1])`` only when ``position_ids`` is None, and
  expands 2-D positions to 3-D itself.
- Qwen3-VL, Qwen3-VL-MoE: the same, and ``visual_pos_masks`` ``(batch, seq)`` with
  ``deepstack_visual_embeds`` (one ``(n_visual_tokens, hidden)`` per early layer, rows in
  the order of the mask's True positions, added to those positions' hidden states); the
  text model expands 2-D positions to 4-D (text, t, h, w).
- LLaVA, LLaVA-OneVision, Mistral 3, InternVL: embeddings, tower, projector,
  ``masked_scatter``; no positions of their own: the language model (a stock decoder,
  e.g. ``LlamaModel``, ``Qwen2Model``) numbers ``arange(seq)`` when given none.
- The same, read for the multimodal sweep (``tests/vlm_sweep.py``, which checks each at
  cp=2): VipLLaVA (features of several tower layers), LLaVA-NeXT and LLaVA-NeXT-Video
  (anyres views with newlines; videos pooled), Video-LLaVA (an image tower and a video
  tower), Aya Vision (pixel shuffle; a Cohere 2 language model with sliding windows),
  Idefics3 and SmolVLM (``inputs_merger`` / ``masked_scatter`` into ``text_model``),
  LightOnOCR (Pixtral), DeepSeek-VL, Cohere2 Vision. None computes positions or a mask of
  its own; each passes ``attention_mask``, ``position_ids`` and ``inputs_embeds`` to its
  language model as given.
- GLM-4.1V, GLM-4.5V-MoE (``Glm4vModel`` / ``Glm4vMoeModel``): Qwen2-VL's forward, with GLM's
  own ``get_rope_index`` (3-D, from the full ``input_ids``, grids, ``mm_token_type_ids``).
- Qwen3.5, Qwen3.5-MoE (``Qwen3_5Model`` / ``Qwen3_5MoeModel``): Qwen2-VL's forward, Qwen3-VL's
  tower without deepstack (``visual``, each grid entry encoded on its own) and Qwen3-VL's
  ``get_rope_index`` (a video's frames split by timestamps); the text model expands 2-D
  positions to 4-D as Qwen3-VL's does. Its language model is hybrid: gated delta rule
  layers (``linear_attn``, routed to hf_ring's CP op like a text Qwen3.5's) and full
  attention; packed rows too (each document's mixer states kept apart). Checked in float64
  (``tests/test_cp_vlm_hybrid.py``): in float32 the decay
  parameters' gradients (``A_log``, ``dt_bias``: sums over every token that nearly cancel)
  are ~1e-3 to 2e-2 apart between any two orderings of the sums, one process included.
- Gemma 3 (``Gemma3Model.forward``): embeddings, tower, projector, ``masked_scatter``; no
  positions of its own; then it builds its language model's mask itself, a dict by layer
  type, from ``token_type_ids`` (``get_block_sequence_ids_for_mask``: each maximal run of
  image tokens, type 1, is one block; ``create_masks_for_vision_model``: full layers
  ``causal OR same block``, sliding layers ``window AND (causal OR same block)``, each AND
  the padding mask). Under CP, ``ring_flash``'s mask builder returns None, so the dict holds
  None for each type; hf_ring replaces it by the 2-D padding mask the base model got and
  hands the blocks down as bidirectional spans (``hf_ring.patterns.ring.spans``), which
  every attention layer's plan computes exactly. On a packed row (transformers' mask then
  ANDs each document's own) the runs are cut at the documents' boundaries, and the sliding
  layers' windows apply inside each document; with or without CP.
- PaliGemma (``PaliGemmaModel.forward``): the same merge; its own positions (``arange + 1``,
  passed to the language model); its mask has one bidirectional block, every token of type
  0 (the image and the prompt: the prefix), ``causal OR prefix`` (PaliGemma 2: by layer
  type, with Gemma 2's sliding layers): one span per row, which must be one run of real
  tokens (a prefix split by the suffix is refused). PaliGemma 2's sliding layers compute
  ``(causal AND window) OR prefix``, not Gemma 3's ``window AND (causal OR block)``: a
  PaliGemma with a sliding window is refused under CP. Its config sets the language model's
  ``use_bidirectional_attention``, so its attention layers are flagged non-causal and what
  they compute is the mask: with ``token_type_ids``, causal OR prefix, which the ring runs;
  without (refused under CP), SDPA attends both ways when no padding mask is built.

Refused by name: every family not listed.

Owns the table. Must not import: the Trainer, TRL, hf_ring's training or memory layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn

from hf_ring.patches.transformers import defects
from hf_ring.patterns.ring.spans import BidirectionalSpans

# The language model's inputs that run along the sequence in every family, with the
# dimension they run along (positions: the last, behind M-RoPE's leading axis).
SEQUENCE_INPUTS: dict[str, int] = {"input_ids": 1, "inputs_embeds": 1, "attention_mask": 1, "position_ids": -1}
# Attribute names under which a multimodal base model holds its language model.
LANGUAGE_MODEL_ATTRIBUTES = ("language_model", "text_model")


@dataclass(frozen=True)
class Family:
    """How one family's language model takes its inputs.

    Attributes:
        name: the family, for messages.
        sequence_inputs: inputs besides :data:`SEQUENCE_INPUTS` that run along the sequence,
            with their dimension (Qwen3-VL's ``visual_pos_masks``).
        visual_rows: inputs whose rows follow the True positions of a mask input, by name
            (Qwen3-VL's ``deepstack_visual_embeds`` -> ``visual_pos_masks``): a list of
            ``(n_true, hidden)`` tensors.
        spans: for a family whose base model builds its language model's mask itself with
            bidirectional blocks (Gemma 3, PaliGemma), the blocks from the full batch's
            ``token_type_ids`` ``(batch, seq)`` int and its real tokens (bool ``(batch, seq)``,
            the padding mask's ones): the spans the ring computes instead.
        window_cuts_spans: whether its sliding layers see ``window AND (causal OR block)``
            (what the ring computes); False (PaliGemma 2) refuses a model with a window.
        packs_spans: its blocks are found on a packed row as on a padded one (Gemma 3's: each
            run of image tokens, cut at the documents' boundaries); False (PaliGemma: one
            prefix a row) refuses packed rows.
        stock_packing: why transformers' own (SDPA / eager) mask does not keep a packed
            row's documents apart for this family (the defect's text from
            ``hf_ring.patches.transformers.defects``, naming the release it was read on), or
            None where it does.
        causal_by_mask: its language model's layers are flagged non-causal and its own mask
            makes them causal plus the spans (PaliGemma sets ``use_bidirectional_attention``):
            under CP it needs ``token_type_ids`` (without, that mask may be skipped and SDPA
            attends both ways, or not: refused).
        tower: the base model's attribute holding a vision tower called as
            ``tower(patches, grid_thw)`` that encodes each grid entry on its own, which hf_ring
            splits over the CP group (``tower.py``); None: the tower runs whole on every rank.
        mrope: the model numbers its tokens itself (``compute_3d_position_ids``: 3-D M-RoPE);
            packed, its positions are ``(4, 1, seq)``: row 0 the text positions restarting
            per document (what its text model reads packed documents from, transformers'
            convention), rows 1-3 each document's own M-RoPE. Otherwise the language model
            numbers ``arange`` and a packed row's positions are ``(1, seq)``, restarting per
            document.
    """

    name: str
    sequence_inputs: dict[str, int] = field(default_factory=dict)
    visual_rows: dict[str, str] = field(default_factory=dict)
    tower: Optional[str] = None
    mrope: bool = False
    spans: Optional[Callable[[torch.Tensor, torch.Tensor], BidirectionalSpans]] = None
    window_cuts_spans: bool = True
    packs_spans: bool = False
    stock_packing: Optional[str] = None
    causal_by_mask: bool = False


def image_runs(token_type_ids: torch.Tensor, real: torch.Tensor) -> BidirectionalSpans:
    """Gemma 3's blocks: each maximal run of image tokens (``token_type_ids == 1``)."""
    return BidirectionalSpans.from_runs(token_type_ids == 1)


def prefix_block(token_type_ids: torch.Tensor, real: torch.Tensor) -> BidirectionalSpans:
    """PaliGemma's block: the real tokens of type 0 (its mask hides padded keys, and a padded
    query's row is nobody's output), which must form one run."""
    return BidirectionalSpans.from_runs((token_type_ids == 0) & real, single=True)


_QWEN3 = dict(sequence_inputs={"visual_pos_masks": 1}, visual_rows={"deepstack_visual_embeds": "visual_pos_masks"},
              tower="visual", mrope=True)

# The base model's class name -> its family.
FAMILIES: dict[str, Family] = {
    "Qwen2VLModel": Family("Qwen2-VL", tower="visual", mrope=True),
    "Qwen2_5_VLModel": Family("Qwen2.5-VL", tower="visual", mrope=True),
    "Qwen3VLModel": Family("Qwen3-VL", **_QWEN3),
    "Qwen3VLMoeModel": Family("Qwen3-VL-MoE", **_QWEN3),
    "Qwen3_5Model": Family("Qwen3.5", tower="visual", mrope=True),
    "Qwen3_5MoeModel": Family("Qwen3.5-MoE", tower="visual", mrope=True),
    "LlavaModel": Family("LLaVA"),
    "LlavaOnevisionModel": Family("LLaVA-OneVision"),
    "Mistral3Model": Family("Mistral 3"),
    "InternVLModel": Family("InternVL"),
    "VipLlavaModel": Family("VipLLaVA"),
    "LlavaNextModel": Family("LLaVA-NeXT"),
    "LlavaNextVideoModel": Family("LLaVA-NeXT-Video"),
    "VideoLlavaModel": Family("Video-LLaVA"),
    "AyaVisionModel": Family("Aya Vision"),
    "Idefics3Model": Family("Idefics3"),
    "SmolVLMModel": Family("SmolVLM"),
    "LightOnOcrModel": Family("LightOnOCR"),
    "Cohere2VisionModel": Family("Cohere2 Vision"),
    "DeepseekVLModel": Family("DeepSeek-VL"),
    "Glm4vModel": Family("GLM-4.1V"),
    "Glm4vMoeModel": Family("GLM-4.5V (MoE)"),
    "Gemma3Model": Family("Gemma 3", spans=image_runs, packs_spans=True, stock_packing=defects.GEMMA3_PACKED_MASK.text()),
    "PaliGemmaModel": Family("PaliGemma", spans=prefix_block, window_cuts_spans=False, causal_by_mask=True),
}


def language_model_of(base: nn.Module) -> Optional[nn.Module]:
    """The language model inside a multimodal base model, or None for a text model."""
    for name in LANGUAGE_MODEL_ATTRIBUTES:
        module = getattr(base, name, None)
        if isinstance(module, nn.Module) and module is not base:
            return module
    return None


def family_refusal(base: nn.Module, where: str, packed: bool = False) -> Optional[str]:
    """Why ``base`` (a multimodal base model) cannot run ``where`` (``packed``: on packed
    image-text rows), or None if it can."""
    name = type(base).__name__
    if name in FAMILIES:
        family = FAMILIES[name]
        if packed and family.spans is not None and not family.packs_spans:
            return (
                f"{name} ({family.name}) is not supported {where}: its mask lets the tokens of one block per row "
                "(its prefix, from token_type_ids) attend to each other both ways, which hf_ring computes on "
                "padded rows; a packed row holds one prefix per document, which it does not read yet; pad the "
                "samples instead of packing them"
            )
        return None
    checked = ", ".join(f"{f.name} ({n})" for n, f in FAMILIES.items())
    return (
        f"{name} is an image-text model hf_ring has not checked {where}: how it merges image features "
        "into the sequence and computes positions was not read, so sharding its language model's "
        f"inputs could train a different model. Checked: {checked}. Run it without context parallelism, "
        "or report the model"
    )
