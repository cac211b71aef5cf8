"""Data for the image-text example, made on the spot: shapes drawn with torch, captions that
say what is in them, a word-level tokenizer, and the pixel values in the layout each
family's processor makes (nothing is downloaded).

A sample is a sequence of (image, caption) items, e.g. ``<vision_start><image>x16<vision_end>
a red circle on the left .``, filled up to a length drawn between 3/4 of ``--seq_len`` and
``--seq_len`` (so batches need padding). The caption is learned (the placeholders are not),
and it can be read off the image only: the loss falls as the model learns to look. For
Qwen2.5-VL, every other sample opens with a short video of a moving shape (4 frames,
``a blue square moves right .``).

Pixel layouts: Qwen-VL, ``(patches, 3 * temporal * patch**2)`` rows in the order of
transformers' ``Qwen2VLImageProcessor.patchify`` (merge blocks together, each frame pair one
temporal patch), with ``image_grid_thw`` / ``video_grid_thw``; LLaVA, whole images
``(n, 3, H, W)``. ``tests/test_trainer_vlm.py`` checks the Qwen layout against
transformers' PIL processor.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

COLORS = {"red": (1.0, 0.1, 0.1), "green": (0.1, 0.8, 0.2), "blue": (0.1, 0.2, 1.0), "yellow": (1.0, 0.9, 0.1)}
SHAPES = ("square", "circle", "triangle")
PLACES = {"left": (0.3, 0.5), "right": (0.7, 0.5), "top": (0.5, 0.3), "bottom": (0.5, 0.7)}
MOVES = {"right": (1, 0), "left": (-1, 0), "up": (0, -1), "down": (0, 1)}
WORDS = ("a", "on", "the", "moves", ".", *COLORS, *SHAPES, *PLACES, "up", "down")
SPECIALS = ("<pad>", "<s>", "</s>", "<image>", "<video>", "<vision_start>", "<vision_end>")


class WordTokenizer:
    """Specials 0-6 (``<pad> <s> </s> <image> <video> <vision_start> <vision_end>``), then the
    captions' words; ``encode`` splits on spaces."""

    def __init__(self) -> None:
        self.vocab = {w: i for i, w in enumerate(dict.fromkeys(SPECIALS + WORDS))}
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self.image_token_id, self.video_token_id = self.vocab["<image>"], self.vocab["<video>"]
        self.vision_start_token_id, self.vision_end_token_id = self.vocab["<vision_start>"], self.vocab["<vision_end>"]

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return [self.vocab[w] for w in text.split()]


def draw(shape: str, color: str, center: tuple[float, float], size: int) -> torch.Tensor:
    """A float32 ``(3, size, size)`` image in [0, 1]: ``shape`` in ``color`` on a grey canvas."""
    y, x = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    cx, cy, r = center[0] * size, center[1] * size, size / 5
    if shape == "square":
        inside = ((x - cx).abs() <= r) & ((y - cy).abs() <= r)
    elif shape == "circle":
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= r**2
    else:  # a triangle pointing up: below its apex, inside the two slanted sides
        inside = (y <= cy + r) & (y >= cy - r) & ((x - cx).abs() <= (y - (cy - r)) / 2)
    image = torch.full((3, size, size), 0.5)
    rgb = torch.tensor(COLORS[color])[:, None, None].expand(3, size, size)
    return torch.where(inside, rgb, image)


def qwen_patches(frames: torch.Tensor, patch: int, merge: int, temporal: int) -> tuple[torch.Tensor, list[int]]:
    """``frames`` float ``(T, 3, H, W)`` (an image is one frame, repeated to ``temporal``) as
    Qwen-VL's processors lay them out: ``(grid_t * grid_h * grid_w, 3 * temporal * patch**2)``
    float32 and the grid ``[grid_t, grid_h, grid_w]``."""
    if frames.shape[0] % temporal:
        frames = torch.cat([frames, frames[-1:].expand(temporal - frames.shape[0] % temporal, -1, -1, -1)])
    t, c, h, w = frames.shape
    gt, gh, gw = t // temporal, h // patch, w // patch
    x = frames.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (gt, gh/m, gw/m, m, m, c, temporal, p, p)
    return x.reshape(gt * gh * gw, c * temporal * patch * patch).float(), [gt, gh, gw]


@dataclass(frozen=True)
class Layout:
    """How a family's model takes pixels: ``kind`` ``"qwen"`` (patch rows and grids),
    ``"llava"`` (whole images, ``tokens`` placeholders each) or ``"gemma"`` (whole images, their
    ``tokens`` placeholders between begin / end of image, marked in ``token_type_ids``);
    ``image`` the canvas side."""

    kind: str
    image: int
    patch: int = 4
    merge: int = 2
    temporal: int = 2
    tokens: int = 0
    video: bool = False


def _item(layout: Layout, rng: random.Random, video: bool) -> dict[str, Any]:
    """One drawn item: ``frames`` float ``(T, 3, H, W)`` (T = 1 for an image) and its caption."""
    shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
    if video:
        move = rng.choice(list(MOVES))
        dx, dy = MOVES[move]
        frames = torch.stack([draw(shape, color, (0.5 + 0.08 * k * dx, 0.5 + 0.08 * k * dy), layout.image)
                              for k in range(-2, 2)])
        return {"frames": frames, "caption": f"a {color} {shape} moves {move} .", "video": True}
    place = rng.choice(list(PLACES))
    return {"frames": draw(shape, color, PLACES[place], layout.image)[None],
            "caption": f"a {color} {shape} on the {place} .", "video": False}


def _placeholders(tok: WordTokenizer, layout: Layout, item: dict[str, Any]) -> list[int]:
    if layout.kind == "gemma":  # <start_of_image> image tokens <end_of_image>, in the tiny vocabulary
        return [tok.vision_start_token_id, *[tok.image_token_id] * layout.tokens, tok.vision_end_token_id]
    if layout.kind != "qwen":
        return [tok.image_token_id] * layout.tokens
    token = tok.video_token_id if item["video"] else tok.image_token_id
    return [tok.vision_start_token_id, *[token] * _qwen_visual_tokens(layout, item), tok.vision_end_token_id]


def _qwen_visual_tokens(layout: Layout, item: dict[str, Any]) -> int:
    """A Qwen-VL item's placeholders: its temporal patches x merged patches per frame."""
    t = item["frames"].shape[0]
    return -(-t // layout.temporal) * (layout.image // layout.patch) ** 2 // layout.merge**2


def drawn_sample(layout: Layout, rng: random.Random, max_tokens: int, video: bool,
                 count: Callable[[dict[str, Any]], int], overhead: int) -> list[dict[str, Any]]:
    """The items of one sample of at most ``max_tokens`` tokens, a video first when ``video``:
    ``count(item)`` is an item's tokens, ``overhead`` the row's own (e.g. ``<s>`` and ``</s>``)."""
    target = rng.randint(3 * max_tokens // 4, max_tokens)
    items, used = [], overhead
    while True:
        item = _item(layout, rng, video=video and not items)
        n = count(item)
        if used + n > target:
            break
        items.append(item)
        used += n
    if not items:
        raise ValueError(f"--seq_len {max_tokens} is too short for one image and its caption")
    return items


def feature(tok: WordTokenizer, layout: Layout, items: list[dict[str, Any]]) -> dict[str, Any]:
    """The tiny model's feature for ``RingVisionDataCollator``: ids with placeholders,
    ``mm_token_type_ids`` (Qwen) or ``token_type_ids`` (Gemma 3), pixel values and grids."""
    ids, kinds, pixels, grids, videos, video_grids = [tok.bos_token_id], [0], [], [], [], []
    for item in items:
        marks = _placeholders(tok, layout, item)
        ids += marks + tok.encode(item["caption"])
        kind = 2 if item["video"] else 1
        kinds += [kind if t in (tok.image_token_id, tok.video_token_id) else 0 for t in marks]
        kinds += [0] * len(tok.encode(item["caption"]))
        if layout.kind == "qwen":
            rows, grid = qwen_patches(item["frames"], layout.patch, layout.merge, layout.temporal)
            (videos if item["video"] else pixels).append(rows)
            (video_grids if item["video"] else grids).append(grid)
        else:
            pixels.append(item["frames"])
    ids.append(tok.eos_token_id)
    kinds.append(0)
    out: dict[str, Any] = {"input_ids": ids, "pixel_values": torch.cat(pixels)}
    if layout.kind == "gemma":  # Gemma 3's image marks: each run of them attends to itself both ways
        out["token_type_ids"] = [int(t == tok.image_token_id) for t in ids]
    if layout.kind == "qwen":
        out.update(mm_token_type_ids=kinds, image_grid_thw=torch.tensor(grids))
        if videos:
            out.update(pixel_values_videos=torch.cat(videos), video_grid_thw=torch.tensor(video_grids),
                       second_per_grid_ts=torch.ones(len(videos)))
    return out


def shapes_dataset(tok: WordTokenizer, layout: Layout, num_examples: int, max_tokens: int, seed: int,
                   processor: Optional[Any] = None) -> list[dict[str, Any]]:
    """``num_examples`` samples (every other one opening with a video when ``layout.video``);
    with a real ``processor``, the same images and captions made into features by it, each
    sample sized in its tokenizer's tokens."""
    rng = random.Random(seed)
    if processor is None:
        def count(item: dict[str, Any]) -> int:
            return len(_placeholders(tok, layout, item)) + len(tok.encode(item["caption"]))

        overhead = 2  # <s> and </s>
    else:
        count, overhead = _processor_count(processor, layout), len(processor.tokenizer("")["input_ids"])
    samples = [drawn_sample(layout, rng, max_tokens, layout.video and i % 2 == 1, count, overhead)
               for i in range(num_examples)]
    if processor is None:
        return [feature(tok, layout, items) for items in samples]
    rows = [processed(items, processor) for items in samples]
    for row in rows:
        if len(row["input_ids"]) > max_tokens:
            # The layout counted fewer placeholders than the processor made: it resized the images.
            raise ValueError(f"the processor made a sample of {len(row['input_ids'])} tokens, more than --seq_len "
                             f"{max_tokens}: its image processor does not keep {layout.image} x {layout.image} "
                             "images at their size (check its resizing settings)")
    return rows


def _processor_text(item: dict[str, Any], processor: Any) -> str:
    """An item as text for ``processor``: its caption after the processor's own image (video)
    token, wrapped in ``<|vision_start|>`` / ``<|vision_end|>`` where its tokenizer has them (Qwen-VL)."""
    wrapped = "<|vision_start|>" in processor.tokenizer.get_vocab()
    start, end = ("<|vision_start|>", "<|vision_end|>") if wrapped else ("", "")
    token = processor.video_token if item["video"] else processor.image_token
    return f"{start}{token}{end}{item['caption']} "


def _processor_count(processor: Any, layout: Layout) -> Callable[[dict[str, Any]], int]:
    """An item's tokens once ``processor`` has expanded its placeholder: every item's text opens
    with a special token, which the tokenizer never merges with its neighbours, so a row's tokens
    are its items' tokens added up."""
    if layout.kind != "qwen":
        raise NotImplementedError(f"samples for a {layout.kind!r} checkpoint's processor are not sized yet: only "
                                  "Qwen-VL's patch arithmetic is (a layout of kind 'qwen')")
    tok = processor.tokenizer

    def count(item: dict[str, Any]) -> int:
        text = tok(_processor_text(item, processor), add_special_tokens=False)["input_ids"]
        return len(text) - 1 + _qwen_visual_tokens(layout, item)  # its one placeholder, expanded

    return count


def processed(items: list[dict[str, Any]], processor: Any) -> dict[str, Any]:
    """A sample made into a feature by a real checkpoint's processor (:func:`_processor_text`
    for each item): the processor expands the placeholders and makes the pixel values (resized
    and normalised as the checkpoint expects; the drawn pixels are already in [0, 1])."""
    text, images, videos = "", [], []
    for item in items:
        text += _processor_text(item, processor)
        (videos if item["video"] else images).append(item["frames"] if item["video"] else item["frames"][0])
    out = processor(text=[text], images=images or None, videos=videos or None, return_tensors="pt",
                    return_mm_token_type_ids=True, do_rescale=False)
    row = {k: (v[0] if k in ("input_ids", "mm_token_type_ids") else v) for k, v in out.items() if k != "attention_mask"}
    row["input_ids"] = row["input_ids"].tolist()
    return row
