"""The tiny image-text models of the example, one per ``--model_type``, made on the spot.

Each is a family's own config class at toy sizes (a vision tower of 2 blocks of width 32,
a language model of ``--num_layers`` layers of ``--hidden_size`` with heads of 16), its
special tokens set to the word tokenizer's (examples/vlm_data.py), with the pixel layout its
data needs (Gemma 3: its image tokens between ``<vision_start>`` / ``<vision_end>``, standing for
its begin / end of image tokens, and ``token_type_ids`` 1 on them: each image one bidirectional span).
"""

from __future__ import annotations

from typing import Any, Callable

from vlm_data import Layout, WordTokenizer

IMAGE = 32  # canvas side in pixels: 8 x 8 patches of 4, merged 2 x 2 into 16 tokens (Qwen)
HEAD_DIM = 16


def _text(tok: WordTokenizer, hidden: int, layers: int, seq_len: int) -> dict[str, Any]:
    heads = max(2, hidden // HEAD_DIM)
    return dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=max(1, heads // 2), head_dim=HEAD_DIM, vocab_size=len(tok),
                max_position_embeddings=4 * seq_len, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, use_cache=False)


def _rope(section: list[int]) -> dict[str, Any]:
    # M-RoPE: the (temporal, height, width) sections of the rotary half-dimension (HEAD_DIM / 2).
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}}


def _qwen_tokens(tok: WordTokenizer) -> dict[str, int]:
    return dict(image_token_id=tok.image_token_id, video_token_id=tok.video_token_id,
                vision_start_token_id=tok.vision_start_token_id, vision_end_token_id=tok.vision_end_token_id)


_QWEN_VISION = dict(depth=2, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                    hidden_size=32, intermediate_size=64)


def qwen2_5_vl(tok: WordTokenizer, hidden: int, layers: int, seq_len: int) -> tuple[Any, Layout]:
    from transformers import Qwen2_5_VLConfig

    text = dict(_text(tok, hidden, layers, seq_len), **_rope([2, 3, 3]))
    # Window attention over 2 x 2 merged patches in block 0, full attention in block 1.
    vision = dict(_QWEN_VISION, out_hidden_size=hidden, window_size=16, fullatt_block_indexes=[1], tokens_per_second=2)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_qwen_tokens(tok))
    return config, Layout("qwen", IMAGE, video=True)


def qwen3_vl(tok: WordTokenizer, hidden: int, layers: int, seq_len: int) -> tuple[Any, Layout]:
    from transformers import Qwen3VLConfig

    text = dict(_text(tok, hidden, layers, seq_len), **_rope([4, 2, 2]))
    # Deepstack: the features of vision blocks 0 and 1 are added to the first decoder layers.
    vision = dict(_QWEN_VISION, out_hidden_size=hidden, num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
    return Qwen3VLConfig(text_config=text, vision_config=vision, **_qwen_tokens(tok)), Layout("qwen", IMAGE)


def llava(tok: WordTokenizer, hidden: int, layers: int, seq_len: int) -> tuple[Any, Layout]:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    # A CLIP tower on 32 x 32 images in patches of 8: 16 tokens (its class token dropped).
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE, patch_size=8, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**_text(tok, hidden, layers, seq_len)),
                         image_token_id=tok.image_token_id, image_seq_length=16)
    return config, Layout("llava", IMAGE, tokens=16)


def gemma3(tok: WordTokenizer, hidden: int, layers: int, seq_len: int) -> tuple[Any, Layout]:
    from transformers import Gemma3Config, SiglipVisionConfig

    # A SigLIP tower on 32 x 32 images in patches of 4 (8 x 8), pooled 2 x 2 to 16 tokens.
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=IMAGE, patch_size=4, vision_use_head=False)  # as Gemma 3 checkpoints
    # Sliding and full layers alternating; the window (12) is shorter than an image's 16 tokens,
    # so the sliding layers compute window AND (causal OR same image).
    text = dict(_text(tok, hidden, layers, seq_len), model_type="gemma3_text", sliding_window=12,
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                          image_token_index=tok.image_token_id, boi_token_index=tok.vision_start_token_id,
                          eoi_token_index=tok.vision_end_token_id)
    return config, Layout("gemma", IMAGE, tokens=16)


def init_untrained(model: Any) -> None:
    """Weights a family starts at zero for a checkpoint to fill, drawn like the others for a
    model trained from scratch: Gemma 3's image projection (zero, its image embeddings would be
    0, and the first RMSNorm's gradient there ~1 / sqrt(eps): a gradient norm of ~3e7)."""
    projector = getattr(getattr(model, "model", None), "multi_modal_projector", None)
    weight = getattr(projector, "mm_input_projection_weight", None)
    if weight is not None:
        weight.data.normal_(std=model.config.get_text_config().initializer_range)


# --model_type -> its tiny config and pixel layout
MODEL_TYPES: dict[str, Callable[[WordTokenizer, int, int, int], tuple[Any, Layout]]] = {
    "qwen2_5_vl": qwen2_5_vl,
    "qwen3_vl": qwen3_vl,
    "llava": llava,
    "gemma3": gemma3,
}
