"""Collate image-text rows for context parallelism: the full batch, and this rank's labels.

An image-text model under CP (``hf_ring.hf.multimodal``) computes on the **full** batch on
every rank of a CP group up to its language model: the vision tower needs every image, the
merge needs every placeholder, Qwen's M-RoPE needs the full ids and grids. Its language
model's inputs are cut at its entry, in the state's layout. So this collator hands every
rank the same full batch (ids with the placeholders, pixel values, grids, ``mm_token_type_ids``,
a right-padding ``attention_mask``), rows padded at their end to the layout's multiple, and
cuts only the labels: shifted on the full row (placeholders, padding and each row's last
token ``-100``), then sharded with ``shard_sequence`` exactly as the model's hook shards the
sequence, so that each rank's labels line up with its sharded logits. No ``position_ids``:
the model computes its own.

Rows are built by one function per mode, chosen by :func:`row_builder`: :func:`dense_rows`
(one padded row per sample) or :func:`packed_rows` (``packing=True``: the batch's samples in
one row, each a document with its own images, padding, zigzag and positions, built by
``hf_ring.training.vision.packing.packed_row``). Packed positions are the model's own for
each document alone (Qwen's M-RoPE from its own code), so the packing collator is handed the
model (``model=``); the labels are then cut with ``shard_packed``, as the model's hook cuts
the packed row.

Imports no transformers itself: features are mappings of lists and tensors, as a processor
makes them, and the packing mode's model is handed in.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from hf_ring.patterns.state import ContextParallelState
from hf_ring.sharding import required_multiple, shard_packed, shard_sequence
from hf_ring.sharding.labels import IGNORE_INDEX
from hf_ring.training.collator import (
    RingCollatorConfig, _as_ids, _round_up, _shift, check_coordinates, shards_as,
)
from hf_ring.training.vision.packing import TYPE_KEYS, check_no_cache, check_packing_model, packed_row

# Per-sample visual inputs, concatenated over the batch along dim 0 (as the processors do),
# with the placeholder kind they belong to.
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "image_sizes")
VIDEO_INPUTS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
# Per-token ints besides the ids, padded with 0 (Qwen's modality of each token; Gemma 3's
# image-token marks).
PER_TOKEN = TYPE_KEYS
TEXT_INPUTS = ("input_ids", "labels", "attention_mask", *PER_TOKEN)


@dataclass(frozen=True)
class RingVisionCollatorConfig:
    """Settings of :class:`RingVisionDataCollator`, validated on creation.

    Attributes:
        pad_token_id: id written into padding positions of ``input_ids``.
        image_token_id: the image placeholder token (its labels are ``-100``).
        video_token_id: the video placeholder token, or None for a model without videos.
        cp_size, cp_rank, layout: how the labels are sharded; must be the model's state's.
        pad_to_multiple_of: pad rows to a multiple of this (a multiple of what the layout
            needs; default: exactly that).
        spatial_merge_size: Qwen-VL's merge of ``m x m`` patches into one token: when given,
            each example's placeholders are checked against its grids (``t * h * w / m**2``
            tokens per image or video).
        model_labels: emit ``labels`` (full rows, unshifted, ``-100`` on placeholders and
            padding: what a stock model's own loss takes) instead of ``shift_labels``, for the
            stock ``Trainer`` at ``cp_size=1``; refused under CP (the model's loss would be a
            mean over one rank's shard). With ``packing``, each document's first label is -100,
            so that the model's shift over the whole row shifts within each document.
        packing: pack a batch's samples into one row, each a document (zigzag layout only;
            the collator must be given the model: :class:`RingVisionDataCollator`).
        mask_placeholders: set the placeholders' labels to -100 (default). False keeps the
            labels as given (TRL's vision collator learns the placeholders unless its
            completion / assistant mask leaves them out: ``hf_ring.training.trl``).
    """

    pad_token_id: int
    image_token_id: int
    video_token_id: Optional[int] = None
    cp_size: int = 1
    cp_rank: int = 0
    layout: str = "zigzag"
    pad_to_multiple_of: Optional[int] = None
    spatial_merge_size: Optional[int] = None
    model_labels: bool = False
    packing: bool = False
    mask_placeholders: bool = True

    def __post_init__(self) -> None:
        for name in ("pad_token_id", "image_token_id", "video_token_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.image_token_id == self.video_token_id:
            raise ValueError(f"image_token_id and video_token_id are both {self.image_token_id}; give each its own")
        check_coordinates(self)
        if self.pad_to_multiple_of is not None and (
            not isinstance(self.pad_to_multiple_of, int) or self.pad_to_multiple_of < 1
            or self.pad_to_multiple_of % required_multiple(self.cp_size, self.layout)
        ):
            raise ValueError(
                f"pad_to_multiple_of={self.pad_to_multiple_of!r} must be a positive multiple of "
                f"{required_multiple(self.cp_size, self.layout)}, which layout {self.layout!r} needs at "
                f"cp_size={self.cp_size}"
            )
        if self.spatial_merge_size is not None and (not isinstance(self.spatial_merge_size, int)
                                                    or self.spatial_merge_size < 1):
            raise ValueError(f"spatial_merge_size must be a positive int, got {self.spatial_merge_size!r}")
        if self.model_labels and self.cp_size > 1:
            raise ValueError(
                f"model_labels=True hands the model its labels, whose loss under context parallelism "
                f"(cp_size={self.cp_size}) would be a mean over one rank's shard; use model_labels=False with "
                "RingTrainer (it computes the loss from shift_labels)"
            )
        if self.packing:
            self.packing_config  # noqa: B018  the text collator's packing checks (zigzag only)

    @property
    def multiple(self) -> int:
        """The length multiple rows (dense) or documents (packing) are padded to."""
        return self.pad_to_multiple_of or required_multiple(self.cp_size, self.layout)

    @property
    def packing_config(self) -> RingCollatorConfig:
        """What ``packed_row`` takes: these settings as a packing text collator's (validated
        there: a layout other than zigzag is refused)."""
        return RingCollatorConfig(pad_token_id=self.pad_token_id, cp_size=self.cp_size, cp_rank=self.cp_rank,
                                  layout=self.layout, pad_to_multiple_of=self.pad_to_multiple_of, packing=True)


@dataclass(frozen=True)
class VisionExample:
    """One sample, read and checked: int64 ``input_ids`` and ``labels`` ``(n,)`` (placeholders
    ``-100`` unless ``mask_placeholders`` is False), its per-token ints by name (:data:`PER_TOKEN`,
    int64 ``(n,)``), and its visual inputs by name (each a tensor whose dim 0 runs over its
    images, videos or patches)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    per_token: dict[str, torch.Tensor]
    visual: dict[str, torch.Tensor]


def _placeholders(ids: torch.Tensor, token: Optional[int]) -> int:
    return 0 if token is None else int(ids.eq(token).sum())


def _check_visual(index: int, kind: str, count: int, token: Optional[int], visual: dict[str, torch.Tensor],
                  names: tuple[str, ...], merge: Optional[int]) -> None:
    """Placeholders of one kind (image or video) against the inputs that fill them."""
    pixels, grid = visual.get(names[0]), visual.get(names[1])
    if count and pixels is None:
        raise ValueError(
            f"example {index} has {count} {kind} placeholder tokens (id {token}) but no {names[0]}; give the "
            f"{kind}s the processor made for it, or drop the placeholders"
        )
    if not count and pixels is not None:
        raise ValueError(
            f"example {index} has {names[0]} but no {kind} placeholder token (id {token}) in its input_ids: its "
            f"{kind} features would have nowhere to go; tokenize it with the processor that made the pixels"
        )
    if grid is not None:
        if grid.dim() != 2 or grid.shape[1] != 3:
            raise ValueError(f"example {index}: {names[1]} must be (n_{kind}s, 3) (t, h, w), got {tuple(grid.shape)}")
        if pixels is not None and pixels.shape[0] != int(grid.prod(-1).sum()):
            raise ValueError(
                f"example {index}: {names[0]} has {pixels.shape[0]} patches but {names[1]} {grid.tolist()} "
                f"says {int(grid.prod(-1).sum())}"
            )
        if merge is not None and count != int(grid.prod(-1).sum()) // merge**2:
            raise ValueError(
                f"example {index} has {count} {kind} placeholder tokens but its {names[1]} {grid.tolist()} make "
                f"{int(grid.prod(-1).sum()) // merge**2} tokens (t * h * w / {merge}**2); each {kind} needs "
                "exactly its tokens in input_ids"
            )


def read_example(feature: Mapping[str, Any], index: int, config: RingVisionCollatorConfig) -> VisionExample:
    """One feature (a processor's output for one sample) checked and read."""
    if "input_ids" not in feature:
        raise ValueError(f"example {index} has no 'input_ids' (keys: {sorted(feature)})")
    unknown = sorted(set(feature) - set(TEXT_INPUTS) - set(IMAGE_INPUTS) - set(VIDEO_INPUTS))
    if unknown:
        raise ValueError(
            f"example {index} has inputs RingVisionDataCollator does not know how to batch: {unknown}; known: "
            f"{[*TEXT_INPUTS, *IMAGE_INPUTS, *VIDEO_INPUTS]}"
        )
    ids = _as_ids(feature["input_ids"], "input_ids", index)
    labels = _as_ids(feature["labels"], "labels", index) if feature.get("labels") is not None else ids.clone()
    if labels.shape != ids.shape:
        raise ValueError(f"example {index}: labels has {labels.numel()} entries but input_ids has {ids.numel()}")
    mask = feature.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).all()):
        raise ValueError(
            f"example {index} is already padded (its attention_mask has zeros); give unpadded rows: the collator "
            "pads at the end itself"
        )
    per_token = {name: _as_ids(feature[name], name, index) for name in PER_TOKEN if feature.get(name) is not None}
    for name, value in per_token.items():
        if value.shape != ids.shape:
            raise ValueError(f"example {index}: {name} has {value.numel()} entries but input_ids {ids.numel()}")
    visual = {k: torch.as_tensor(v) for k, v in feature.items() if k in IMAGE_INPUTS + VIDEO_INPUTS and v is not None}
    cfg = config
    for kind, token, names in (("image", cfg.image_token_id, IMAGE_INPUTS), ("video", cfg.video_token_id, VIDEO_INPUTS)):
        if token is None and any(n in visual for n in names):
            raise ValueError(f"example {index} has {kind} inputs but the collator has no {kind}_token_id")
        _check_visual(index, kind, _placeholders(ids, token), token, visual, names, cfg.spatial_merge_size)
    for token in (cfg.image_token_id, cfg.video_token_id) if cfg.mask_placeholders else ():
        if token is not None:
            labels = labels.masked_fill(ids.eq(token), IGNORE_INDEX)
    return VisionExample(ids, labels, per_token, visual)


def dense_rows(examples: Sequence[VisionExample], config: RingVisionCollatorConfig) -> dict[str, Any]:
    """The full batch of padded rows: ``input_ids``, ``attention_mask``, ``labels`` int64
    ``(B, L)`` (L the longest row rounded up to ``config.multiple``), the per-token ints
    (``mm_token_type_ids``, ``token_type_ids``) ``(B, L)`` the examples have, and the visual
    inputs concatenated along dim 0."""
    length = _round_up(max(e.input_ids.numel() for e in examples), config.multiple)
    batch = len(examples)
    out = {
        "input_ids": torch.full((batch, length), config.pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros((batch, length), dtype=torch.long),
        "labels": torch.full((batch, length), IGNORE_INDEX, dtype=torch.long),
    }
    for name in PER_TOKEN:
        given = [name in e.per_token for e in examples]
        if any(given) and not all(given):
            raise ValueError(f"some examples have {name} and others not; give them to every example or none")
        if all(given):
            out[name] = torch.zeros((batch, length), dtype=torch.long)
    for row, e in enumerate(examples):
        n = e.input_ids.numel()
        out["input_ids"][row, :n], out["attention_mask"][row, :n], out["labels"][row, :n] = e.input_ids, 1, e.labels
        for name, value in e.per_token.items():
            out[name][row, :n] = value
    for name in IMAGE_INPUTS + VIDEO_INPUTS:
        parts = [e.visual[name] for e in examples if name in e.visual]
        if parts:
            out[name] = torch.cat(parts, dim=0)
    return out


def packed_rows(examples: Sequence[VisionExample], config: RingVisionCollatorConfig, model: nn.Module) -> dict[str, Any]:
    """The full batch as one packed row (``hf_ring.training.vision.packing.packed_row``):
    ``input_ids``, ``labels`` int64 ``(1, L)`` (L the sum of the documents, each padded to
    ``config.multiple``; each document's first label -100), ``position_ids`` (``(4, 1, L)``
    M-RoPE or ``(1, L)``: ``model``'s own per document), ``mm_token_type_ids`` ``(1, L)`` where
    given, the visual inputs concatenated along dim 0 in document order, ``cu_seq_lens_q`` /
    ``cu_seq_lens_k`` int32 ``(n_docs + 1,)`` and ``max_length_q`` / ``max_length_k`` (ints).
    No ``attention_mask``: the documents' boundaries and causal attention keep padding out."""
    samples = [{"input_ids": e.input_ids, "labels": e.labels, **e.per_token, **e.visual} for e in examples]
    return packed_row(samples, model, config.packing_config)


def row_builder(config: RingVisionCollatorConfig, model: Optional[nn.Module] = None,
                ) -> Callable[[Sequence[VisionExample], RingVisionCollatorConfig], dict]:
    """The function that builds the full batch's tensors (``labels`` unshifted) for
    ``config``'s mode; ``model`` numbers the packed documents (``packing=True`` only)."""
    return functools.partial(packed_rows, model=model) if config.packing else dense_rows


class RingVisionDataCollator:
    """Image-text rows for context parallelism: the full batch on every rank, labels sharded.

    Call it with a list of features (what a processor makes for one sample): ``input_ids``
    (``n`` ints, with the image / video placeholder tokens), optionally ``labels`` (``n``
    ints; default: the ids), ``mm_token_type_ids`` (``n`` ints: 0 text, 1 image, 2 video)
    and ``token_type_ids`` (``n`` ints, Gemma 3's image marks), and the sample's
    ``pixel_values`` / ``image_grid_thw`` / ``image_sizes`` / ``pixel_values_videos`` /
    ``video_grid_thw`` / ``second_per_grid_ts`` (tensors whose
    dim 0 runs over its patches, images or videos). Returned, with ``L`` the padded length
    and ``cp`` the cp_size:

    - ``input_ids``, ``attention_mask`` (right padding), ``mm_token_type_ids`` and
      ``token_type_ids`` (if given; 0 on padding) int64 ``(B, L)``: full rows, the same on
      every rank of a CP group;
    - the visual inputs concatenated along dim 0 (their dtype kept);
    - ``shift_labels`` int64 ``(B, L / cp)``: labels shifted on the full row (placeholders,
      padding and each row's last token ``-100``), this rank's shard in the layout; or, with
      ``model_labels`` (cp_size 1), ``labels`` int64 ``(B, L)``, unshifted.

    With ``packing=True`` the batch is **one** row (:func:`packed_rows`: ``B = 1``, ``L`` the
    sum of the documents, each padded to the layout's multiple): ``input_ids``,
    ``position_ids`` (the model's own per document), ``mm_token_type_ids``, the visual inputs,
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k``, and
    ``shift_labels`` shifted within each document and cut with ``shard_packed``; or
    ``labels`` with each document's first label -100 (``model_labels``: the stock model's own
    loss then is the per-document one, given ``use_cache=False``, which is checked).

    Args: the fields of :class:`RingVisionCollatorConfig`, or ``config=`` one; ``model``:
    the image-text model, required with ``packing=True`` (it numbers each document), refused
    without.
    """

    def __init__(self, pad_token_id: Optional[int] = None, image_token_id: Optional[int] = None, *,
                 config: Optional[RingVisionCollatorConfig] = None, model: Optional[nn.Module] = None,
                 **kwargs: Any):
        if config is not None:
            if pad_token_id is not None or image_token_id is not None or kwargs:
                raise ValueError("pass either config= or the settings as keyword arguments, not both")
            self.config = config
        else:
            if pad_token_id is None or image_token_id is None:
                raise ValueError("RingVisionDataCollator needs pad_token_id and image_token_id")
            self.config = RingVisionCollatorConfig(pad_token_id=pad_token_id, image_token_id=image_token_id, **kwargs)
        if self.config.packing:
            check_packing_model(model, self.config.image_token_id)
        elif model is not None:
            raise ValueError("model= numbers packed documents; it is used only with packing=True (padded rows are "
                             "numbered by the model itself): drop it or set packing=True")
        self.model = model

    @classmethod
    def for_state(cls, state: ContextParallelState, pad_token_id: int, image_token_id: int,
                  **kwargs: Any) -> "RingVisionDataCollator":
        """A collator that shards the labels as ``state`` says (its CP size, rank and layout)."""
        return cls(pad_token_id, image_token_id, cp_size=state.cp_size, cp_rank=state.cp_rank, layout=state.layout,
                   **kwargs)

    def matches(self, state: ContextParallelState) -> bool:
        """Whether this collator shards as ``state`` says."""
        return shards_as(self.config, state)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(features) == 0:
            raise ValueError("RingVisionDataCollator got an empty batch")
        cfg = self.config
        full = row_builder(cfg, self.model)([read_example(f, i, cfg) for i, f in enumerate(features)], cfg)
        labels = full.pop("labels")
        if cfg.model_labels:
            if cfg.packing:
                check_no_cache(self.model)  # checked per batch: the config may change after the collator is made
            return {**full, "labels": labels}
        shifted = _shift(labels)  # packed: within each document, as its first label is -100
        if cfg.packing:
            return {**full, "shift_labels": shard_packed(shifted, full["cu_seq_lens_q"], cfg.cp_size, cfg.cp_rank, dim=1)}
        return {**full, "shift_labels": shard_sequence(shifted, cfg.cp_size, cfg.cp_rank, dim=1, layout=cfg.layout)}
