"""Hand-written cases of the image-text families the multimodal sweep checks beyond those of
tests/vlm_cases.py: a tiny config and a batch in the family's own input format.

Each placeholder count is the number of features the family's own code makes for the image
(the model itself checks it: ``get_placeholder_mask`` raises when the counts differ), read
in transformers 5.24's modeling code:

- VipLLaVA: CLIP, the class token dropped, features of several layers concatenated: an
  8 x 8 image in patches of 4 is 4 tokens;
- LLaVA-NeXT(-Video): anyres, an 8 x 16 image is a base view of 2 x 2 features and a 1 x 2
  grid of 8 x 8 crops (2 x 4 features and a newline after each row): 4 + 10 = 14 tokens;
- LLaVA-NeXT-Video's videos: each frame's 2 x 2 features pooled by 2 into one token;
- Video-LLaVA: CLIP with the class token dropped, 4 tokens per 8 x 8 image; a video's frames
  keep it, 5 tokens per frame;
- Aya Vision: SigLIP, 4 x 4 patches of 2 pixel-shuffled by 2 into 4 tokens;
- SmolVLM, Idefics3: their own vision tower on 8 x 8 images in patches of 2 (16), pixel
  shuffled by a scale factor of 2 into 4 tokens; ``pixel_values`` is
  ``(rows, images per row, 3, 8, 8)``;
- LightOnOCR: Pixtral as in Mistral 3, a 16 x 16 image is 4 x 4 patches merged 2 x 2 into 4.

Same sizes as tests/vlm_cases.py: 2 rows of 32 tokens, images straddling the zigzag chunks
of 8 tokens at cp=2, language models of 2 layers, hidden 64.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import (
    AyaVisionConfig, CLIPVisionConfig, Cohere2VisionConfig, DeepseekVLConfig, Idefics3Config, LightOnOcrConfig,
    LlamaConfig, LlavaNextConfig, LlavaNextVideoConfig, PixtralVisionConfig, Qwen3_5Config, Qwen3_5MoeConfig,
    Qwen3Config, SiglipVisionConfig, SmolVLMConfig, VideoLlavaConfig, VipLlavaConfig,
)

from model_sweep_configs import build_config as tiny_text_config
from vlm_cases import _QWEN_VISION, _TEXT, _THREE, _TOKENS, IMAGE, PATCH, VIDEO, _placeholder_batch, _qwen_batch

_CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=8,
             patch_size=PATCH, projection_dim=32)
_SHUFFLED = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=8,
                 patch_size=2)


def vipllava() -> VipLlavaConfig:
    return VipLlavaConfig(vision_config=CLIPVisionConfig(**_CLIP), text_config=LlamaConfig(**_TEXT, head_dim=16),
                          image_token_index=IMAGE, vision_feature_layer=[-1, -2], image_seq_length=4)


def llava_next(video: bool = False):
    config = LlavaNextVideoConfig if video else LlavaNextConfig
    tokens = dict(image_token_index=IMAGE, video_token_index=VIDEO) if video else dict(image_token_index=IMAGE)
    return config(vision_config=CLIPVisionConfig(**_CLIP), text_config=LlamaConfig(**_TEXT, head_dim=16),
                  image_grid_pinpoints=[[8, 8], [8, 16]], image_seq_length=4, **tokens)


def video_llava() -> VideoLlavaConfig:
    return VideoLlavaConfig(vision_config=CLIPVisionConfig(**_CLIP), text_config=LlamaConfig(**_TEXT, head_dim=16),
                            image_token_index=IMAGE, video_token_index=VIDEO, image_seq_length=4)


def aya_vision() -> AyaVisionConfig:
    # The text model is Cohere 2 with its sliding window of 8 tokens (the text sweep's tiny config).
    return AyaVisionConfig(vision_config=SiglipVisionConfig(**_SHUFFLED), text_config=tiny_text_config("cohere2"),
                           image_token_index=IMAGE, downsample_factor=2, vision_feature_layer=-1)


def idefics3(smol: bool = False):
    config = SmolVLMConfig if smol else Idefics3Config
    vision = dict(_SHUFFLED, model_type="smolvlm_vision" if smol else "idefics3_vision")
    # use_cache=False: the family's default (True) makes its forward build a cache, which hf_ring
    # refuses under CP (named); training runs without one.
    return config(vision_config=vision, text_config=LlamaConfig(**_TEXT, head_dim=16), image_token_id=IMAGE,
                  scale_factor=2, use_cache=False)


def lighton_ocr() -> LightOnOcrConfig:
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 head_dim=16, image_size=16, patch_size=PATCH)
    return LightOnOcrConfig(vision_config=vision, text_config=Qwen3Config(**_TEXT, head_dim=16), image_token_id=IMAGE,
                            spatial_merge_size=2)


def cohere2_vision() -> Cohere2VisionConfig:
    return Cohere2VisionConfig(vision_config=SiglipVisionConfig(**_SHUFFLED), text_config=tiny_text_config("cohere2"),
                               image_token_id=IMAGE, downsample_factor=2, alignment_intermediate_size=64)


def deepseek_vl() -> DeepseekVLConfig:
    vision = SiglipVisionConfig(**dict(_SHUFFLED, patch_size=PATCH))
    return DeepseekVLConfig(vision_config=vision, text_config=LlamaConfig(**_TEXT, head_dim=16), image_token_id=IMAGE)


def qwen3_5(moe: bool = False):
    """Qwen3.5: a Qwen3-VL-like tower and 3-D M-RoPE (interleaved sections over a quarter
    of the head in the released models, half here) over a hybrid language model: the text
    sweep's tiny Qwen3.5 text config, a gated delta rule layer and a full attention layer."""
    text = tiny_text_config("qwen3_5_moe_text" if moe else "qwen3_5_text")
    text.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    vision = dict(_QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_position_embeddings=16)
    return (Qwen3_5MoeConfig if moe else Qwen3_5Config)(text_config=text, vision_config=vision, **_TOKENS)


def glm4v(moe: bool = False):
    """GLM-4.1V / GLM-4V-MoE: Qwen2-VL's merge and 3-D M-RoPE from its own ``get_rope_index``;
    the tower of the generic tiny config (tests/vlm_sweep_configs.py) in patches of 4."""
    from vlm_sweep_configs import build_config

    config = build_config("glm4v_moe" if moe else "glm4v")
    config.vision_config.patch_size, config.vision_config.image_size = PATCH, 16
    config.vision_config.depth = 2
    for key, value in dict(image_token_id=IMAGE, video_token_id=VIDEO, image_start_token_id=_TOKENS["vision_start_token_id"],
                           image_end_token_id=_TOKENS["vision_end_token_id"], video_start_token_id=110,
                           video_end_token_id=111).items():
        setattr(config, key, value)
    return config


def _anyres_batch(seed: int) -> dict[str, Any]:
    """One 8 x 16 image a row: 3 views of 8 x 8, 14 tokens."""
    return _placeholder_batch(seed, ((0, 4), (1, 10)), 14, (2, 3, 3, 8, 8), image_sizes=torch.tensor([[8, 16]] * 2))


def _one_image_a_row(seed: int) -> dict[str, Any]:
    """Idefics3's format: ``pixel_values`` ``(rows, 1, 3, 8, 8)``, 4 tokens each."""
    batch = _placeholder_batch(seed, ((0, 5), (1, 6)), 4, (2, 1, 3, 8, 8))
    return {**batch, "pixel_attention_mask": torch.ones(2, 1, 8, 8, dtype=torch.bool)}


def _with_video(batch: dict[str, Any], start: int, n: int, seed: int) -> dict[str, Any]:
    """``batch`` with a video of 2 frames of 8 x 8 in row 1 at ``start`` (``n`` tokens)."""
    ids = batch["input_ids"].clone()
    ids[1, start:start + n] = VIDEO
    videos = torch.randn(1, 2, 3, 8, 8, generator=torch.Generator().manual_seed(seed + 1))
    return {**batch, "input_ids": ids, "pixel_values_videos": videos}


def _next_video_batch(seed: int) -> dict[str, Any]:
    """The anyres images, and in row 1 a video pooled by 2 into one token per frame."""
    return _with_video(_anyres_batch(seed), 26, 2, seed)


def _video_llava_batch(seed: int) -> dict[str, Any]:
    """Three images, and in row 1 a video whose frames keep the class token: 2 x 5 tokens."""
    batch = _placeholder_batch(seed, _THREE, 4, (3, 3, 8, 8))
    batch = {"input_ids": batch["input_ids"], "pixel_values_images": batch["pixel_values"]}
    return _with_video(batch, 20, 10, seed)  # across the ranks (zigzag chunk 2 on rank 1, chunk 3 on rank 0)


# name (model type) -> (config(), batch(seed))
CASES: dict[str, tuple[Callable[[], Any], Callable[[int], dict]]] = {
    "vipllava": (vipllava, lambda seed: _placeholder_batch(seed, _THREE, 4, (3, 3, 8, 8))),
    "llava_next": (llava_next, _anyres_batch),
    "llava_next_video": (lambda: llava_next(video=True), _next_video_batch),
    "video_llava": (video_llava, _video_llava_batch),
    "aya_vision": (aya_vision, lambda seed: _placeholder_batch(seed, _THREE, 4, (3, 3, 8, 8))),
    "idefics3": (idefics3, _one_image_a_row),
    "smolvlm": (lambda: idefics3(smol=True), _one_image_a_row),
    "cohere2_vision": (cohere2_vision, lambda seed: _placeholder_batch(seed, _THREE, 4, (3, 3, 8, 8))),
    "deepseek_vl": (deepseek_vl, lambda seed: _placeholder_batch(seed, _THREE, 4, (3, 3, 8, 8))),
    "qwen3_5": (qwen3_5, lambda seed: _qwen_batch(seed, frames_apart=True)),
    "qwen3_5_moe": (lambda: qwen3_5(moe=True), lambda seed: _qwen_batch(seed, frames_apart=True)),
    "glm4v": (glm4v, lambda seed: _qwen_batch(seed, video=False)),
    "glm4v_moe": (lambda: glm4v(moe=True), lambda seed: _qwen_batch(seed, video=False)),
    "lighton_ocr": (lighton_ocr, lambda seed: _placeholder_batch(
        seed, _THREE, 4, (3, 3, 16, 16), image_sizes=torch.tensor([[16, 16]] * 3))),
}
