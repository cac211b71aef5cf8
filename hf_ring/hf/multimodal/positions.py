"""The positions of one document of a packed image-text row: the model's own, as if alone.

Why: packed, every document must be numbered as the model numbers it alone (text from 0,
Qwen's 3-D M-RoPE from that document's own ids and grids, each image's temporal / height /
width positions from the document's start): numbering the packed row as one sequence would
continue each document's positions from the previous one's. transformers' Qwen-VL text
models read packed documents from a text row put before the three M-RoPE rows
(``position_ids`` ``(4, batch, seq)``, row 0 restarting at 0 per document); the
LLaVA-style models' language models number ``arange`` and take 2-D positions.

The positions come from the model's own ``compute_3d_position_ids`` on the document alone
(``hf_ring.patches.transformers.positions``); nothing here computes M-RoPE itself.

Owns ``document_position_ids`` and the check of a stock model's packing. Must not import: the Trainer, TRL, hf_ring's training or
memory layers.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn

from hf_ring.hf.multimodal.families import FAMILIES, family_refusal, language_model_of
from hf_ring.hf.support import RING_FLASH
from hf_ring.patches.transformers import attn_implementation
from hf_ring.patches.transformers.positions import own_position_ids

_WHERE = "with packed image-text rows"


def packing_family(model: nn.Module):
    """The :class:`~hf_ring.hf.multimodal.families.Family` of ``model`` (an image-text model
    or its base model), or a ``NotImplementedError`` naming why it cannot be packed."""
    base = getattr(model, "base_model", model)
    if language_model_of(base) is None:
        raise ValueError(
            f"{type(model).__name__} is not an image-text model (no language model inside it); pack text "
            "documents with RingDataCollator(packing=True)"
        )
    refusal = family_refusal(base, _WHERE, packed=True)
    if refusal is not None:
        raise NotImplementedError(refusal)
    return FAMILIES[type(base).__name__]


def check_stock_packing(model: nn.Module) -> None:
    """A packed row for a model that is not ``ring_flash`` (transformers' own mask decides
    what its documents see): refused (ValueError) for a family whose mask does not keep them
    apart."""
    family = packing_family(model)
    if family.stock_packing is not None and attn_implementation(model.config) != RING_FLASH:
        raise ValueError(
            f"packed rows for {type(model).__name__} with attn_implementation="
            f"{attn_implementation(model.config)!r}: {family.stock_packing}. Pad the samples instead (the same "
            f"numbers: each sample alone), or pack them with attn_implementation={RING_FLASH!r}, which computes "
            "each document alone"
        )


def document_position_ids(model: nn.Module, document: Mapping[str, Any]) -> torch.Tensor:
    """One document's positions, as ``model`` numbers it alone.

    Args:
        model: an image-text model of a family in the table (or its base model).
        document: the document's inputs, padding included: ``input_ids`` int ``(1, n)``,
            and as the processor made them ``mm_token_type_ids`` int ``(1, n)`` (0 on
            padding), ``image_grid_thw`` / ``video_grid_thw`` int ``(k, 3)``,
            ``second_per_grid_ts`` ``(n_videos,)``.

    Returns:
        int64 ``(4, 1, n)`` for an M-RoPE family (row 0: ``arange(n)``; rows 1-3: the
        model's M-RoPE, or ``arange(n)`` where the model computes none), else ``(1, n)``
        ``arange(n)``.
    """
    family = packing_family(model)
    ids = document["input_ids"]
    text = torch.arange(ids.shape[-1], device=ids.device)[None]  # (1, n)
    if not family.mrope:
        return text
    own = own_position_ids(getattr(model, "base_model", model), document)
    rows = text[None].expand(3, 1, -1) if own is None else own.to(torch.int64)  # (3, 1, n)
    return torch.cat([text[None], rows], dim=0)
