"""Packing image-text samples into one row for context parallelism (issue 21).

Why a function of its own: a packed image-text row is more than concatenated tokens. Each
sample is a document: padded on its own to the layout's multiple (zigzag per document,
``hf_ring.sharding.shard_packed``), numbered as the model numbers it alone (text from 0, Qwen's
M-RoPE from the document's own ids and grids: ``hf_ring.hf.multimodal.positions``), its labels
shifted inside it; its images go to the vision tower in document order, so that the model's
merge (features scattered into the placeholders in row order) puts each image's features into
its own document's placeholders. Every rank of a CP group gets the same full batch: the model
runs its tower and merge on it, and hf_ring cuts the merged row document by document at the
language model's entry; only ``shift_labels`` is this rank's.

Owns ``packed_row`` (the full row, labels unshifted: what ``RingVisionDataCollator``'s packing
mode builds each batch with), ``pack_image_text`` (the same, this rank's ``shift_labels``), and
the checks of the model such a collator is handed.
Must not import the Trainer or TRL (it is handed the model).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from hf_ring.sharding import shard_packed
from hf_ring.sharding.labels import IGNORE_INDEX
from hf_ring.training.collator import RingCollatorConfig, _round_up, _shift


def _positions():
    """``hf_ring.hf.multimodal.positions``, imported when a packed row is built: it needs
    transformers, and ``import hf_ring`` (which imports the collators) must not."""
    from hf_ring.hf.multimodal import positions as module

    return module


# Per token of a sample, ``(n,)`` or ``(1, n)``.
TOKEN_KEYS = ("input_ids", "labels", "attention_mask", "mm_token_type_ids", "token_type_ids")
# Token kinds (Qwen's mm_token_type_ids, Gemma 3's token_type_ids): 0 on padding and text.
TYPE_KEYS = ("mm_token_type_ids", "token_type_ids")
# Per image or video of a sample, concatenated along dim 0 in document order.
IMAGE_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "second_per_grid_ts",
              "image_sizes")
# Where configs name their placeholder tokens (default labels leave them unlearned).
_PLACEHOLDER_ATTRIBUTES = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")


def _tokens(sample: Mapping[str, Any], name: str, index: int) -> torch.Tensor:
    t = torch.as_tensor(sample[name])
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or t.numel() == 0 or t.dtype.is_floating_point:
        raise ValueError(
            f"sample {index}: {name} must be one non-empty row of integers ((n,) or (1, n): one sample's "
            f"processor output), got {t.dtype} {tuple(t.shape)}"
        )
    return t


def _placeholders(model: nn.Module) -> list[int]:
    config = model.config
    return [v for a in _PLACEHOLDER_ATTRIBUTES if isinstance(v := getattr(config, a, None), int)]


def _document(sample: Mapping[str, Any], index: int, length: int, pad_token_id: int,
              placeholders: list[int]) -> dict[str, torch.Tensor]:
    """One sample padded to ``length``: ``input_ids``, ``labels`` and, if given, its token
    types (:data:`TYPE_KEYS`), int64 ``(1, length)`` (padding: ``pad_token_id``, -100, 0), and
    its image inputs as given."""
    unknown = sorted(set(sample) - set(TOKEN_KEYS) - set(IMAGE_KEYS))
    if unknown:
        raise ValueError(
            f"sample {index} has {', '.join(unknown)}, which pack_image_text does not know how to pack "
            f"(per token: {', '.join(TOKEN_KEYS)}; per image: {', '.join(IMAGE_KEYS)}); drop them or report the model"
        )
    ids = _tokens(sample, "input_ids", index).to(torch.int64)
    n = ids.numel()
    present = {name: _tokens(sample, name, index) for name in TOKEN_KEYS if sample.get(name) is not None}
    for name, t in present.items():
        if t.numel() != n:
            raise ValueError(f"sample {index}: {name} has {t.numel()} entries but input_ids has {n}")
    if "attention_mask" in present and not bool(present["attention_mask"].all()):
        raise ValueError(
            f"sample {index} is already padded (its attention_mask has zeros); pack unpadded samples: each "
            "document is padded at its end here"
        )
    labels = present.get("labels")
    if labels is None:  # the ids, with the image / video placeholders left unlearned
        labels = ids.masked_fill(torch.isin(ids, torch.tensor(placeholders, dtype=ids.dtype)), IGNORE_INDEX)
    rows = {"input_ids": (ids, pad_token_id), "labels": (labels, IGNORE_INDEX)}
    for name in TYPE_KEYS:  # only as given: without it a Qwen model numbers text positions
        if name in present:
            rows[name] = (present[name], 0)
    doc = {}
    for name, (row, fill) in rows.items():
        padded = torch.full((1, length), fill, dtype=torch.int64)
        padded[0, :n] = row
        doc[name] = padded
    doc.update({name: torch.as_tensor(sample[name]) for name in IMAGE_KEYS if sample.get(name) is not None})
    return doc


def _concatenated(docs: list[dict[str, torch.Tensor]], name: str) -> torch.Tensor:
    parts = [d[name] for d in docs if name in d]
    if len({tuple(p.shape[1:]) for p in parts}) > 1:
        raise ValueError(
            f"the samples' {name} differ in shape past their first dimension ({[tuple(p.shape) for p in parts]}), "
            "so they cannot be concatenated for the vision tower; process the samples' images to one size"
        )
    return torch.cat(parts, dim=0)


def check_packing_model(model: Optional[nn.Module], image_token_id: int) -> None:
    """The model a packing collator is handed: given, of a family hf_ring packs, with the
    collator's image token (ValueError / NotImplementedError naming what to do)."""
    if model is None:
        raise ValueError(
            "packing=True needs model= (the image-text model being trained): each document's positions are the "
            "model's own for it alone (Qwen's M-RoPE from its own code), computed per batch by the collator"
        )
    _positions().packing_family(model)  # a family hf_ring has not checked with packed rows is refused here, by name
    own = next((v for a in ("image_token_id", "image_token_index")
                if isinstance(v := getattr(model.config, a, None), int)), None)
    if own is not None and own != image_token_id:
        raise ValueError(f"image_token_id={image_token_id} but {type(model).__name__}'s config says {own}; give the "
                         "collator the model's image token")


def check_no_cache(model: nn.Module) -> None:
    """Packed rows for the stock model's own loss: its forward must build no cache, and its
    family's own mask must keep the documents apart (ValueError)."""
    _positions().check_stock_packing(model)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(text, "use_cache", False):
        raise ValueError(
            f"packing=True with model_labels=True (the stock Trainer): {type(model).__name__}'s text config has "
            "use_cache=True, and with a cache transformers' SDPA / eager mask does not keep the packed documents "
            "apart (each would attend to those before it); set model.config.get_text_config().use_cache = False"
        )


def packed_row(samples: Sequence[Mapping[str, Any]], model: nn.Module, config: RingCollatorConfig) -> dict[str, Any]:
    """The full packed row of image-text samples, labels unshifted and uncut: what
    :func:`pack_image_text` builds before it shifts and shards the labels, and what an
    image-text collator's packing mode builds on.

    Args: as :func:`pack_image_text`.

    Returns:
        :func:`pack_image_text`'s keys, with ``labels`` int64 ``(1, L)`` in place of
        ``shift_labels``: each document's labels (padding -100) with its **first** token -100,
        transformers' convention for packed rows (``DataCollatorWithFlattening``): shifting the
        whole row then shifts within each document (a document's last token would learn the
        next one's first), so a stock model's own loss on ``labels`` is the per-document loss.
    """
    if not config.packing:
        raise ValueError("pack_image_text packs documents per document in the zigzag layout: give it a "
                         "RingCollatorConfig with packing=True")
    if len(samples) == 0:
        raise ValueError("pack_image_text got no samples")
    _positions().packing_family(model)  # refuses a family hf_ring has not checked, before any work
    placeholders = _placeholders(model)
    docs, bounds = [], [0]
    for i, sample in enumerate(samples):
        if "input_ids" not in sample:
            raise ValueError(f"sample {i} has no input_ids (keys: {sorted(sample)})")
        length = _round_up(_tokens(sample, "input_ids", i).numel(), config.multiple)
        docs.append(_document(sample, i, length, config.pad_token_id, placeholders))
        bounds.append(bounds[-1] + length)
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    out: dict[str, Any] = {
        "input_ids": torch.cat([d["input_ids"] for d in docs], dim=1),
        "position_ids": torch.cat([_positions().document_position_ids(model, d) for d in docs], dim=-1),
    }
    for name in TYPE_KEYS:
        if any(name in d for d in docs):
            out[name] = torch.cat([d.get(name, torch.zeros_like(d["input_ids"])) for d in docs], dim=1)
    out.update({name: _concatenated(docs, name) for name in IMAGE_KEYS if any(name in d for d in docs)})
    timed = out.get("second_per_grid_ts")
    if timed is not None and timed.numel() != out["video_grid_thw"].shape[0]:
        raise ValueError(
            f"{timed.numel()} second_per_grid_ts for {out['video_grid_thw'].shape[0]} videos: give it for the "
            "videos of every sample or of none (the processor's default is 1 s a grid)"
        )
    labels = torch.cat([d["labels"] for d in docs], dim=1)  # (1, L)
    labels[0, cu[:-1].long()] = IGNORE_INDEX  # no document's first token is a target: see Returns
    out.update(labels=labels, cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=longest,
               max_length_k=longest)
    return out


def pack_image_text(samples: Sequence[Mapping[str, Any]], model: nn.Module,
                    config: RingCollatorConfig) -> dict[str, Any]:
    """Pack image-text samples into one row: the full batch every rank of a CP group feeds to
    the model, and this rank's labels.

    Args:
        samples: one mapping per sample (a document), as the model's processor makes it for
            that sample alone: ``input_ids`` int ``(n,)`` or ``(1, n)``; optionally ``labels``
            (same shape, -100 where nothing is learned; default: the ids with the image /
            video placeholder tokens -100), ``attention_mask`` (all ones), ``mm_token_type_ids``
            (Qwen: 0 text, 1 image, 2 video) or ``token_type_ids`` (Gemma 3: 1 image); per
            image or video, in the sample's order:
            ``pixel_values``, ``pixel_values_videos``, ``image_grid_thw`` / ``video_grid_thw`` int
            ``(k, 3)``, ``second_per_grid_ts`` ``(n_videos,)``, ``image_sizes`` int ``(k, 2)``.
        model: the image-text model (its family decides the positions, computed by its own code
            per document; a family hf_ring has not checked is refused by name).
        config: ``packing=True``; its ``cp_size``, ``cp_rank``, ``pad_token_id`` and
            document multiple (``2 * cp_size``, or ``pad_to_multiple_of``) are used.

    Returns:
        With ``L`` the sum of the padded document lengths and ``cp`` the cp_size:

        - ``input_ids`` int64 ``(1, L)``, each document padded at its end with ``pad_token_id``;
        - ``position_ids`` int64 ``(4, 1, L)`` for the M-RoPE families (row 0 the text positions,
          restarting at 0 per document; rows 1-3 each document's own M-RoPE), else ``(1, L)``
          restarting per document;
        - ``mm_token_type_ids`` / ``token_type_ids`` int64 ``(1, L)`` if a sample gave it (0 on
          padding and in the samples that did not);
        - each image key the samples gave, concatenated along dim 0 in document order;
        - ``cu_seq_lens_q``, ``cu_seq_lens_k`` int32 ``(n_docs + 1,)``: the padded documents'
          global boundaries; ``max_length_q``, ``max_length_k``: the longest, an int;
        - ``shift_labels`` int64 ``(1, L / cp)``: labels shifted within each document (a
          document's last token and padding -100), cut with ``shard_packed`` for this rank.

        Everything but ``shift_labels`` is the same on every rank of the CP group.

    Raises:
        ValueError: ``config.packing`` False, no samples, a sample that is not one row of token
            ids, padded already, or holds a key it cannot pack; image inputs of other shapes;
            ``second_per_grid_ts`` for some videos only.
        NotImplementedError: a family hf_ring has not checked, or does not pack (PaliGemma).
    """
    out = packed_row(samples, model, config)
    shifted = _shift(out.pop("labels"))  # (1, L): within each document, its first tokens being -100
    out["shift_labels"] = shard_packed(shifted, out["cu_seq_lens_q"], config.cp_size, config.cp_rank, dim=1)
    return out
