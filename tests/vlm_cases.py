"""Tiny image-text models and synthetic batches for the multimodal CP tests (tests/test_cp_vlm.py).

Nothing is downloaded: each config is made by hand, small enough to run forward and backward
in well under a second on a CPU (vision towers of 1 to 3 blocks of width 32, patches of 2
or 4 pixels; language models of 2 layers, hidden 64, 4 query heads over 2 KV heads of 16,
a vocabulary of 128). A batch holds 2 rows of 32 tokens with synthetic images (random
``pixel_values``, grids and sizes consistent with them, and exactly the placeholder tokens
their features fill) placed so that images straddle the ranks' shards at cp=2 (zigzag
chunks of 8 tokens); the Qwen families' second row holds a video (except Qwen2-VL's).
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any, Callable

import torch
from transformers import (
    AutoModelForImageTextToText, CLIPVisionConfig, InternVLConfig, LlamaConfig, LlavaConfig, LlavaOnevisionConfig,
    Mistral3Config, MistralConfig, PixtralVisionConfig, Qwen2_5_VLConfig, Qwen2Config, Qwen2VLConfig, Qwen3VLConfig,
    Qwen3VLMoeConfig, SiglipVisionConfig,
)

from closeness import rel_err

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from vlm_models import init_untrained  # noqa: E402

ROWS, SEQ, VOCAB = 2, 32, 128
IMAGE, VIDEO, START, END = 120, 121, 122, 123
PATCH, MERGE, TEMPORAL = 4, 2, 2
_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
_QWEN_VISION = dict(depth=2, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL,
                    in_channels=3)


def qwen2_vl() -> Qwen2VLConfig:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = dict(_QWEN_VISION, embed_dim=32, mlp_ratio=2, hidden_size=64)
    return Qwen2VLConfig(text_config=dict(_TEXT, rope_parameters=rope), vision_config=vision, **_TOKENS)


def qwen2_5_vl() -> Qwen2_5_VLConfig:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    # Window attention over 2 x 2 merged patches in block 0, full attention in block 1.
    vision = dict(_QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=16,
                  fullatt_block_indexes=[1], tokens_per_second=2)
    return Qwen2_5_VLConfig(text_config=dict(_TEXT, rope_parameters=rope), vision_config=vision, **_TOKENS)


def qwen3_vl(moe: bool = False) -> Qwen3VLConfig:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
    # Deepstack features from blocks 0 and 1 are added to the first two decoder layers.
    vision = dict(_QWEN_VISION, depth=3, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    text = dict(_TEXT, head_dim=16, rope_parameters=rope)
    if moe:  # 4 experts of 32, 2 per token, in every layer
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
        return Qwen3VLMoeConfig(text_config=text, vision_config=vision, **_TOKENS)
    return Qwen3VLConfig(text_config=text, vision_config=vision, **_TOKENS)


def llava() -> LlavaConfig:
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=8, patch_size=PATCH, projection_dim=32)
    text = LlamaConfig(**_TEXT, head_dim=16)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE, image_seq_length=4)


def llava_onevision() -> LlavaOnevisionConfig:
    # anyres: an 8 x 16 image is a base view and a 1 x 2 grid of 8 x 8 crops (14 tokens with newlines).
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=8, patch_size=PATCH)
    return LlavaOnevisionConfig(vision_config=vision, text_config=Qwen2Config(**_TEXT), image_token_index=IMAGE,
                                video_token_index=VIDEO, image_grid_pinpoints=[[8, 8], [8, 16]])


def mistral3() -> Mistral3Config:
    # Pixtral: a 16 x 16 image is 4 x 4 patches, merged 2 x 2 into 4 tokens.
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 head_dim=16, image_size=16, patch_size=PATCH)
    text = MistralConfig(**_TEXT, head_dim=16, sliding_window=None)
    return Mistral3Config(vision_config=vision, text_config=text, image_token_index=IMAGE, spatial_merge_size=MERGE)


def internvl() -> InternVLConfig:
    # An 8 x 8 image is 4 x 4 patches of 2, pixel-shuffled (ratio 0.5) into 4 tokens.
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=[8, 8],
                  patch_size=[2, 2])
    return InternVLConfig(vision_config=vision, text_config=Qwen2Config(**_TEXT), image_token_id=IMAGE,
                          image_seq_length=4, downsample_ratio=0.5)


def _qwen_batch(seed: int, video: bool = True, frames_apart: bool = False) -> dict[str, Any]:
    """Row 0: images of 4 x 8 and 4 x 4 patches (8 and 4 tokens); row 1: a video of 2 x 4 x 4
    patches (8 tokens; with ``frames_apart`` two frames of 4 with a timestamp token between,
    as Qwen3-VL's positions read them), or a third image of 4 x 8 without ``video``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 110, (ROWS, SEQ), generator=g)
    kinds = torch.zeros(ROWS, SEQ, dtype=torch.int32)

    def place(row: int, start: int, n: int, token: int, kind: int) -> None:
        ids[row, start - 1], ids[row, start + n] = START, END
        ids[row, start:start + n], kinds[row, start:start + n] = token, kind

    place(0, 3, 8, IMAGE, 1)
    place(0, 17, 4, IMAGE, 1)
    images = [[1, 4, 8], [1, 4, 4]]
    batch: dict[str, Any] = {}
    if video:
        if frames_apart:
            place(1, 5, 4, VIDEO, 2)
            place(1, 12, 4, VIDEO, 2)
        else:
            place(1, 5, 8, VIDEO, 2)
        grid = torch.tensor([[2, 4, 4]])
        batch.update(video_grid_thw=grid,
                     pixel_values_videos=torch.randn(int(grid.prod(-1).sum()), 3 * TEMPORAL * PATCH**2, generator=g))
    else:
        place(1, 5, 8, IMAGE, 1)
        images.append([1, 4, 8])
    grid = torch.tensor(images)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * TEMPORAL * PATCH**2, generator=g)
    return dict(batch, input_ids=ids, mm_token_type_ids=kinds, image_grid_thw=grid, pixel_values=pixels)


def _placeholder_batch(seed: int, places: tuple[tuple[int, int], ...], n: int, pixels: tuple[int, ...],
                       **extra: Any) -> dict[str, Any]:
    """Random text with ``n`` image placeholders at each ``(row, start)`` of ``places``, and
    random ``pixel_values`` of shape ``pixels`` (one image per place)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 110, (ROWS, SEQ), generator=g)
    for row, start in places:
        ids[row, start:start + n] = IMAGE
    return dict(extra, input_ids=ids, pixel_values=torch.randn(*pixels, generator=g))


_THREE = ((0, 5), (0, 14), (1, 6))


# name -> (config, batch(seed))
FAMILIES: dict[str, tuple[Callable[[], Any], Callable[[int], dict]]] = {
    "qwen2_5_vl": (qwen2_5_vl, _qwen_batch),
    "qwen2_vl": (qwen2_vl, lambda seed: _qwen_batch(seed, video=False)),
    "qwen3_vl": (qwen3_vl, lambda seed: _qwen_batch(seed, frames_apart=True)),
    "qwen3_vl_moe": (lambda: qwen3_vl(moe=True), lambda seed: _qwen_batch(seed, frames_apart=True)),
    # Three 8 x 8 images of 4 tokens (2 x 2 patches, CLIP's class token dropped).
    "llava": (llava, lambda seed: _placeholder_batch(seed, _THREE, 4, (3, 3, 8, 8))),
    # One 8 x 16 image a row: 3 views of 8 x 8.
    "llava_onevision": (llava_onevision, lambda seed: _placeholder_batch(
        seed, ((0, 4), (1, 10)), 14, (2, 3, 3, 8, 8), image_sizes=torch.tensor([[8, 16], [8, 16]]))),
    "mistral3": (mistral3, lambda seed: _placeholder_batch(
        seed, _THREE, 4, (3, 3, 16, 16), image_sizes=torch.tensor([[16, 16]] * 3))),
    "internvl": (internvl, lambda seed: _placeholder_batch(seed, _THREE, 4, (3, 3, 8, 8))),
}


def tiny_gemma(kind: str, attn_implementation: str = "ring_flash"):
    """A tiny Gemma 3 (``kind="gemma3"``: bidirectional image spans) or PaliGemma model
    (refused on packed rows, tests/test_cp_vlm_packed.py; padded under CP:
    tests/test_cp_vlm_gemma.py)."""
    from transformers import Gemma3Config, PaliGemmaConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=8, patch_size=4)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=VOCAB, pad_token_id=0)
    if kind == "gemma3":
        config = Gemma3Config(text_config=dict(text, model_type="gemma3_text", sliding_window=8), vision_config=vision,
                              mm_tokens_per_image=4, image_token_index=120, boi_token_index=121, eoi_token_index=122)
    else:
        config = PaliGemmaConfig(text_config=dict(text, model_type="gemma"), vision_config=vision, image_token_index=120)
    return build(config, attn_implementation)


def assert_refused_on_every_rank(ranks: list[dict], what: str, expected: str) -> None:
    """Each rank's result holds, under ``"refusals"``, the error ``what`` raised there: it must say ``expected``."""
    for r in ranks:
        assert expected in r["refusals"][what], r["refusals"][what]


def assert_tower_gradient_split(rank_grads: list[dict], reference: dict,
                                name: str = "model.visual.patch_embed.proj.weight") -> None:
    """The images straddle the shards: no rank's tower gradient alone is the full one."""
    for grads in rank_grads:
        assert rel_err(grads[name], reference[name]) > 0.05


def build(config, attn_implementation: str, state_dict=None):
    """A float32 model of ``config`` in train mode (no dropout in these configs), with the
    weights a family starts at zero drawn (``examples/vlm_models.init_untrained``)."""
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(copy.deepcopy(config), attn_implementation=attn_implementation)
    # Gemma 3's image projection starts at zero: its images would be zero vectors and its tower
    # would get no gradient, so the tower's checks would hold nothing.
    init_untrained(model)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.float().train()


def gemma3(window: int = 3):
    """Gemma 3: a SigLIP tower on 8 x 8 images (2 x 2 patches of 4, pooled to 4 tokens), a
    sliding layer (``window`` tokens: shorter than an image's 4 tokens by default) and a full one."""
    from transformers import Gemma3Config

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=8, patch_size=PATCH)
    text = dict(_TEXT, model_type="gemma3_text", head_dim=16, sliding_window=window,
                layer_types=["sliding_attention", "full_attention"])
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMAGE,
                        boi_token_index=START, eoi_token_index=END)


# Row 0: images across the zigzag chunk boundaries at 8 and 16 (cp=2); row 1: one inside
# the first chunk (rank 0 only) and one across 24.
GEMMA_IMAGES = ((0, 6), (0, 14), (1, 0), (1, 22))


def gemma3_batch(seed: int) -> dict[str, Any]:
    """Four images of 4 tokens at :data:`GEMMA_IMAGES`, with Gemma 3's ``token_type_ids`` (1
    on image tokens: each run of them is one bidirectional block)."""
    batch = _placeholder_batch(seed, GEMMA_IMAGES, 4, (4, 3, 8, 8))
    batch["token_type_ids"] = (batch["input_ids"] == IMAGE).long()
    return batch


def paligemma():
    """PaliGemma: the same SigLIP tower (4 tokens an image), a Gemma language model."""
    from transformers import PaliGemmaConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=8, patch_size=PATCH, projection_dim=64)
    text = dict(_TEXT, model_type="gemma", head_dim=16)
    return PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE, projection_dim=64)


def paligemma_batch(seed: int) -> dict[str, Any]:
    """One image a row at the start, then the prompt: a prefix (type 0) of 12 tokens in row
    0 (across the zigzag boundary at 8, cp=2) and of 20 in row 1 (across 8 and 16), then
    the suffix (type 1)."""
    batch = _placeholder_batch(seed, ((0, 0), (1, 0)), 4, (2, 3, 8, 8))
    types = torch.ones(ROWS, SEQ, dtype=torch.long)
    types[0, :12], types[1, :20] = 0, 0
    batch["token_type_ids"] = types
    return batch


# Packed rows (tests/test_cp_vlm_packed.py): per-sample processor outputs, one document each,
# of uneven lengths (padded to 24, 20 and 8 tokens at cp=2, zigzag chunks of 6, 5 and 2), so
# that images straddle the chunks; the last sample is text alone.
TEXT_ONLY = 5


def _text(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(3, 110, (1, n), generator=g)


def _qwen_sample(g: torch.Generator, n: int, images: tuple[tuple[int, list[int]], ...] = (),
                 video: tuple[int, list[int]] | None = None, frames_apart: bool = False,
                 second_per_grid_ts: float | None = None) -> dict[str, Any]:
    """One Qwen-VL sample of ``n`` tokens: images ``(start, grid)`` (merged 2 x 2, so a grid
    ``[1, h, w]`` is ``h * w / 4`` tokens), and a ``video`` ``(start, [t, h, w])``, its frames
    one after the other or, ``frames_apart``, with a timestamp token between them."""
    ids, kinds, sample = _text(g, n), torch.zeros(1, n, dtype=torch.int32), {}

    def place(start: int, count: int, token: int, kind: int) -> None:
        ids[0, start - 1], ids[0, start + count] = START, END
        ids[0, start:start + count], kinds[0, start:start + count] = token, kind

    for start, grid in images:
        place(start, grid[1] * grid[2] // MERGE**2, IMAGE, 1)
    if images:
        grid = torch.tensor([grid for _, grid in images])
        sample.update(image_grid_thw=grid,
                      pixel_values=torch.randn(int(grid.prod(-1).sum()), 3 * TEMPORAL * PATCH**2, generator=g))
    if video is not None:
        start, thw = video
        frame = thw[1] * thw[2] // MERGE**2
        if frames_apart:
            for f in range(thw[0]):
                place(start + f * (frame + 3), frame, VIDEO, 2)
        else:
            place(start, thw[0] * frame, VIDEO, 2)
        grid = torch.tensor([thw])
        sample.update(video_grid_thw=grid,
                      pixel_values_videos=torch.randn(int(grid.prod()), 3 * TEMPORAL * PATCH**2, generator=g))
        if second_per_grid_ts is not None:
            sample["second_per_grid_ts"] = torch.tensor([second_per_grid_ts])
    return dict(sample, input_ids=ids, mm_token_type_ids=kinds)


def _qwen_samples(seed: int, video: bool = True, frames_apart: bool = False) -> list[dict[str, Any]]:
    """Two images (8 and 4 tokens); a video of 2 x 4 x 4 patches (8 tokens; Qwen2.5-VL's frames
    2 s apart, ``second_per_grid_ts``: temporal positions 0 and 4), or a third image without
    ``video``; text alone."""
    g = torch.Generator().manual_seed(seed)
    first = _qwen_sample(g, 23, images=((3, [1, 4, 8]), (15, [1, 4, 4])))
    if video:
        second = _qwen_sample(g, 19, video=(5, [2, 4, 4]), frames_apart=frames_apart,
                              second_per_grid_ts=None if frames_apart else 2.0)
    else:
        second = _qwen_sample(g, 19, images=((5, [1, 4, 8]),))
    return [first, second, {"input_ids": _text(g, TEXT_ONLY)}]


def _placeholder_samples(seed: int, n: int, pixels: tuple[int, ...], **per_image: torch.Tensor) -> list[dict]:
    """Samples of 23 and 17 tokens with ``n`` image placeholders at each start of (3, 12) and
    (6,), ``pixel_values`` of ``(k, *pixels)`` (one image per start), ``per_image`` inputs
    repeated per image; text alone."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for length, starts in ((23, (3, 12)), (17, (6,))):
        ids = _text(g, length)
        for start in starts:
            ids[0, start:start + n] = IMAGE
        extra = {k: v.expand(len(starts), *v.shape[1:]) for k, v in per_image.items()}
        samples.append(dict(extra, input_ids=ids, pixel_values=torch.randn(len(starts), *pixels, generator=g)))
    return [*samples, {"input_ids": _text(g, TEXT_ONLY)}]


def _onevision_samples(seed: int) -> list[dict]:
    """One anyres 8 x 16 image (14 tokens) in each of two samples; text alone."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for length, start in ((23, 4), (19, 2)):
        ids = _text(g, length)
        ids[0, start:start + 14] = IMAGE
        samples.append({"input_ids": ids, "pixel_values": torch.randn(1, 3, 3, 8, 8, generator=g),
                        "image_sizes": torch.tensor([[8, 16]])})
    return [*samples, {"input_ids": _text(g, TEXT_ONLY)}]


def _gemma3_samples(seed: int) -> list[dict]:
    """Gemma 3's ``token_type_ids`` (1 on image tokens) with each sample: one of 24 tokens
    whose second image ends it (24 is a multiple of 4, so no padding follows at cp=2) and
    one of 17 that starts with an image, so that on the packed row one run of image tokens
    spans the boundary between them (two blocks, one per document); text alone."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for length, starts in ((24, (3, 20)), (17, (0, 9))):
        ids = _text(g, length)
        for start in starts:
            ids[0, start:start + 4] = IMAGE
        samples.append({"input_ids": ids, "token_type_ids": (ids == IMAGE).long(),
                        "pixel_values": torch.randn(len(starts), 3, 8, 8, generator=g)})
    return [*samples, {"input_ids": _text(g, TEXT_ONLY)}]


# name -> samples(seed), for the families of FAMILIES and Gemma 3.
PACKED_SAMPLES: dict[str, Callable[[int], list[dict]]] = {
    "qwen2_5_vl": _qwen_samples,
    "qwen2_vl": lambda seed: _qwen_samples(seed, video=False),
    "qwen3_vl": lambda seed: _qwen_samples(seed, frames_apart=True),
    "qwen3_vl_moe": lambda seed: _qwen_samples(seed, frames_apart=True),
    "llava": lambda seed: _placeholder_samples(seed, 4, (3, 8, 8)),
    "llava_onevision": _onevision_samples,
    "mistral3": lambda seed: _placeholder_samples(seed, 4, (3, 16, 16), image_sizes=torch.tensor([[16, 16]])),
    "internvl": lambda seed: _placeholder_samples(seed, 4, (3, 8, 8)),
    "gemma3": _gemma3_samples,
}
# name -> config, for the packed tests: FAMILIES' and Gemma 3's (a window of 3 tokens,
# shorter than its images and documents, on its sliding layer).
PACKED_CONFIGS: dict[str, Callable[[], Any]] = {
    **{name: config for name, (config, _) in FAMILIES.items()}, "gemma3": lambda: gemma3(window=3),
}
