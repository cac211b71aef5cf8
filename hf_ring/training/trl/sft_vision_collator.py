"""TRL's vision-language SFT batches, handed to :class:`RingVisionDataCollator` for context parallelism.

For a dataset with images ``SFTTrainer`` prepares nothing up front: its
``DataCollatorForVisionLanguageModeling`` runs the processor on each batch (the chat template,
or prompt and completion; the images into pixel values and placeholder tokens; right padding;
``max_length`` truncation) and builds ``labels``: the ids, ``-100`` on padding and on what its
completion-only or assistant-only mask leaves out. No mask hides the image placeholders
themselves: without one TRL learns them, and so must a run that computes what TRL computes.

Under context parallelism every rank of a CP group needs that full batch (the vision tower, the
merge of image features and Qwen's M-RoPE run on it) and its own shard of the labels, shifted
on the full row: what :class:`RingVisionDataCollator` makes from unpadded per-sample features.
:class:`RingSFTVisionCollator` runs TRL's collator unchanged, cuts its padded batch back into
one feature per example (:func:`split_batch`: the example's tokens, and its images' pixel
values and grids by the example's count of images) and hands them to a
``RingVisionDataCollator`` with ``mask_placeholders=False``, so the tokens learned are TRL's.

Must not import TRL: it is handed TRL's collator (``hf_ring.training.trl.sft`` checks its class).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import torch

from hf_ring.patterns.state import ContextParallelState
from hf_ring.sharding import required_multiple
from hf_ring.training.trl.sft_collator import NUM_TOKENS_KEY
from hf_ring.training.vision.collator import IMAGE_INPUTS, PER_TOKEN, RingVisionDataCollator

# Per token of the batch, (B, L); per image, dim 0 over the batch's images in example order.
_TOKEN_KEYS = ("input_ids", "attention_mask", "labels", *PER_TOKEN)


def images_per_example(examples: Sequence[Mapping[str, Any]]) -> list[int]:
    """How many images each raw example holds (TRL's ``"images"`` list, or one ``"image"``)."""
    counts = []
    for i, example in enumerate(examples):
        if "images" in example:
            counts.append(len(example["images"] or []))
        elif "image" in example:
            counts.append(0 if example["image"] is None else 1)
        else:
            raise ValueError(f"example {i} has neither 'images' nor 'image' (keys: {sorted(example)}); a vision "
                             "dataset gives every example its images")
    return counts


def _image_entries(batch: Mapping[str, Any], n_images: int) -> list[int]:
    """Entries of ``pixel_values`` (dim 0) per image: Qwen-VL's patch rows (``t * h * w`` of its
    ``image_grid_thw`` row), or one (a whole image, LLaVA's and Gemma 3's layout)."""
    pixels = batch.get("pixel_values")
    if pixels is None:
        if n_images:
            raise ValueError(f"the examples hold {n_images} images but the processor made no pixel_values")
        return []
    grid = batch.get("image_grid_thw")
    entries = [int(n) for n in grid.prod(-1)] if grid is not None else [1] * int(pixels.shape[0])
    if len(entries) != n_images or sum(entries) != pixels.shape[0]:
        raise ValueError(
            f"the processor made pixel_values {tuple(pixels.shape)} for {len(entries)} images (image_grid_thw: "
            f"{None if grid is None else grid.tolist()}) but the examples hold {n_images}; hf_ring cannot tell which "
            "pixels belong to which example"
        )
    return entries


def split_batch(batch: Mapping[str, Any], images: Sequence[int]) -> list[dict[str, Any]]:
    """TRL's padded batch as one unpadded feature per example.

    Args:
        batch: TRL's vision collator's output: ``input_ids``, ``attention_mask``, ``labels``
            int64 ``(B, L)``, right-padded (each mask row ones, then zeros);
            ``mm_token_type_ids`` / ``token_type_ids`` ``(B, L)`` where the processor makes them;
            ``pixel_values`` (dim 0 over the images in example order: Qwen-VL's patch rows,
            ``image_grid_thw`` int ``(n_images, 3)`` saying how many each, or one whole image
            each), ``image_sizes`` ``(n_images, 2)``.
        images: each example's count of images (:func:`images_per_example`).

    Returns:
        ``B`` features: the per-token keys ``(n_b,)`` cut to the example's ``n_b`` tokens, and
        its images' entries of each per-image key.
    """
    unknown = sorted(set(batch) - set(_TOKEN_KEYS) - set(IMAGE_INPUTS))
    if unknown:
        raise NotImplementedError(
            f"the processor's batch holds {unknown}, which hf_ring does not split per example under context "
            f"parallelism (per token: {list(_TOKEN_KEYS)}; per image: {list(IMAGE_INPUTS)}); use a processor of a "
            "family hf_ring supports (docs/multimodal.md)"
        )
    mask = batch["attention_mask"].bool()
    if mask.shape[0] != len(images):
        raise ValueError(f"the batch has {mask.shape[0]} rows for {len(images)} examples")
    lengths = mask.sum(dim=1)
    if not torch.equal(mask, torch.arange(mask.shape[1]) < lengths[:, None]):
        raise ValueError("TRL's vision collator returned rows that are not right-padded (attention_mask ones, then "
                         "zeros); hf_ring pads each row at its end: keep TRL's collator")
    entries = _image_entries(batch, sum(images))
    features, image, entry = [], 0, 0
    for row, (n, k) in enumerate(zip(lengths.tolist(), images)):
        feature = {name: batch[name][row, :n] for name in _TOKEN_KEYS if name in batch}
        rows = sum(entries[image:image + k])
        for name in IMAGE_INPUTS:
            if name in batch and k:
                per_entry = name == "pixel_values"  # the others have one row per image
                feature[name] = batch[name][entry:entry + rows] if per_entry else batch[name][image:image + k]
        features.append(feature)
        image, entry = image + k, entry + rows
    return features


def _config_token(config: Any, kind: str) -> Optional[int]:
    for name in (f"{kind}_token_id", f"{kind}_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


class RingSFTVisionCollator:
    """TRL's vision-language batches, as every rank of a CP group needs them (see the module docstring).

    Called with raw examples (``images`` or ``image``, and ``messages`` or ``prompt`` /
    ``completion``). Returns :class:`RingVisionDataCollator`'s batch: the full rows
    (``input_ids``, ``attention_mask``, ``mm_token_type_ids`` / ``token_type_ids`` int64
    ``(B, L)``, ``L`` the longest example rounded up to the layout's multiple), the pixel values
    and grids, ``shift_labels`` int64 ``(B, L / cp)``: TRL's labels shifted on the full row, this
    rank's shard; plus ``NUM_TOKENS_KEY``: the batch's tokens before padding (TRL's ``num_tokens``).

    Args:
        trl: TRL's ``DataCollatorForVisionLanguageModeling`` (its processor, masks and
            ``max_length`` make the rows and labels).
        ring: the collator that pads, shifts and shards (``mask_placeholders=False``).
    """

    def __init__(self, trl: Any, ring: RingVisionDataCollator):
        if ring.config.mask_placeholders:
            raise ValueError("RingSFTVisionCollator keeps TRL's labels: give it a RingVisionDataCollator with "
                             "mask_placeholders=False")
        self.trl, self.ring = trl, ring

    @classmethod
    def for_trl(cls, state: ContextParallelState, trl: Any, model_config: Any) -> "RingSFTVisionCollator":
        """The collator for TRL's ``trl`` collator and the image-text model of ``model_config``
        on the ranks ``state`` describes."""
        image = _config_token(model_config, "image")
        if image is None:
            raise ValueError(f"{type(model_config).__name__} names no image_token_id / image_token_index: hf_ring "
                             "needs the image placeholder token of an image-text model")
        vision = getattr(model_config, "vision_config", None)
        multiple = required_multiple(state.cp_size, state.layout)
        if trl.pad_to_multiple_of:  # TRL's multiple and the layout's: padding more is exact (it learns nothing)
            multiple = math.lcm(int(trl.pad_to_multiple_of), multiple)
        ring = RingVisionDataCollator.for_state(
            state, trl.processor.tokenizer.pad_token_id, image, video_token_id=_config_token(model_config, "video"),
            spatial_merge_size=getattr(vision, "spatial_merge_size", None), pad_to_multiple_of=multiple,
            mask_placeholders=False,
        )
        return cls(trl, ring)

    def matches(self, state: ContextParallelState) -> bool:
        return self.ring.matches(state)

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        if len(examples) == 0:
            raise ValueError("RingSFTVisionCollator got an empty batch")
        images = images_per_example(examples)  # before TRL's collator, which rewrites "image" as "images"
        features = split_batch(self.trl(list(examples)), images)
        try:
            batch = self.ring(features)
        except ValueError as e:
            longest = max(len(f["input_ids"]) for f in features)
            if self.trl.max_length is not None and longest >= self.trl.max_length:
                raise ValueError(
                    f"max_length={self.trl.max_length} cut an example's image placeholder tokens, while its pixel "
                    f"values stay whole ({e}); raise max_length in the SFTConfig, or set it to None"
                ) from e
            raise
        batch[NUM_TOKENS_KEY] = sum(len(f["input_ids"]) for f in features)
        return batch
