"""Where a forward's tokens sit in the full row: its size, a packed row's documents (read
from ``cu_seq_lens_q``), where a row placed by length put them, and which global token each
of this rank's local ones is, with the position it must have.

Split from the guard's input check (cp_inputs.py), which calls these once per forward; pure
reads of the inputs and the state, no collective. Must not import: Trainer, TRL, hf_ring's
training or memory layers.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import torch

from hf_ring.hf.forward_context import FullBatchShards
from hf_ring.patterns.state import ContextParallelState
from hf_ring.sharding.layouts import shard_indices
from hf_ring.sharding.packed import check_cu_seqlens, packed_shard_indices
from hf_ring.sharding.placement import DocumentPlacement, places_documents
from hf_ring.sharding.placement_auto import plan_placement


def rows_and_length(inputs: dict[str, Any]) -> tuple[int, int]:
    """``(batch, local_seq)`` of a forward's inputs (``-1, -1`` when none says)."""
    for name in ("input_ids", "inputs_embeds", "position_ids"):
        t = inputs.get(name)
        if t is not None and t.dim() >= 2:
            return t.shape[0], t.shape[1]
    return -1, -1


def packed_document_lengths(inputs: dict[str, Any], cp_size: int) -> Optional[tuple[int, ...]]:
    """A packed batch's global document lengths (``cu_seq_lens_q`` given), or None.

    Checks what a rank can check alone: batch size 1, no padding mask (the document
    boundaries are the whole mask: a padding mask next to them contradicts them, and is
    refused rather than ignored), ``cu_seq_lens_k`` equal to ``cu_seq_lens_q``, and
    boundaries that shard over ``cp_size`` ranks. One host sync (the boundaries).
    """
    cu = inputs.get("cu_seq_lens_q")
    if cu is None:
        return None
    batch, _ = rows_and_length(inputs)
    if batch not in (-1, 1):
        raise ValueError(
            f"packed rows (cu_seq_lens_q given) must come with batch size 1, got {batch}; "
            "concatenate the documents of a batch into one row"
        )
    mask = inputs.get("attention_mask")
    if mask is not None and not (mask.dim() == 2 and bool(mask.all())):
        raise ValueError(
            "packed rows (cu_seq_lens_q given) take no padding attention_mask: the document "
            "boundaries define the mask; pad documents instead (RingDataCollator does) and pass "
            "attention_mask=None"
        )
    bounds = torch.as_tensor(cu).reshape(-1).tolist()
    cu_k = inputs.get("cu_seq_lens_k")
    if cu_k is not None and torch.as_tensor(cu_k).reshape(-1).tolist() != bounds:
        raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q: ring_flash computes self-attention")
    return tuple(check_cu_seqlens(torch.tensor(bounds), cp_size))


def placed_documents(
    doc_lens: Optional[tuple[int, ...]], seq_local: int, state: ContextParallelState,
    shards: Optional[FullBatchShards],
) -> Optional[DocumentPlacement]:
    """Under ``placement="by_length"`` or ``"auto"``, where the packed row's documents went
    (the plan the collator cut the row by, computed again from the same lengths); None
    otherwise."""
    if not places_documents(state.placement):
        return None
    if doc_lens is None or shards is not None:
        what = "an image-text model's full batch, sharded by hf_ring" if shards is not None else "dense rows"
        raise NotImplementedError(
            f"placement={state.placement!r} places the documents of packed rows (cu_seq_lens_q given); this forward has "
            f"{what}, which are not placed by length yet. Pack the batch (RingDataCollator(packing=True), "
            "plugin.make_collator(..., packing=True)) or use placement='sharded'"
        )
    placement = plan_placement(state.placement, doc_lens, state.cp_size, state.max_tokens_per_rank)
    expected = placement.local_len(state.cp_rank)
    if seq_local != expected:
        raise ValueError(
            f"CP rank {state.cp_rank} holds {seq_local} tokens of this packed row, but the by-length placement of "
            f"its documents ({placement.describe()}) gives it {expected}: the batch was not placed as the state "
            "says. Build the collator from the state (plugin.make_collator(..., packing=True) or "
            "RingDataCollator.for_state(state, ...)), which places the documents alike"
        )
    return placement


def document_bounds(doc_lens: tuple[int, ...]) -> list[int]:
    """Document boundaries ``[0, end_0, end_1, ...]`` from their lengths."""
    return [0, *itertools.accumulate(doc_lens)]


def global_indices(seq_local: int, doc_lens: Optional[tuple[int, ...]], state: ContextParallelState,
                    placement: Optional[DocumentPlacement]) -> torch.Tensor:
    """Which global token each local one is, ``(seq_local,)`` int64 on the CPU."""
    if placement is not None:
        return placement.local_indices(state.cp_rank)
    if doc_lens is None:
        return shard_indices(seq_local * state.cp_size, state.cp_size, state.cp_rank, state.layout)
    return packed_shard_indices(torch.tensor(document_bounds(doc_lens)), state.cp_size, state.cp_rank)


def expected_positions(index: torch.Tensor, doc_lens: Optional[tuple[int, ...]]) -> torch.Tensor:
    """Global position ids of the tokens at ``index``: restarting at 0 in every document."""
    if doc_lens is None:
        return index
    starts = torch.tensor(document_bounds(doc_lens))
    return index - starts[torch.searchsorted(starts, index, right=True) - 1]


__all__ = ["document_bounds", "expected_positions", "global_indices", "packed_document_lengths", "placed_documents",
           "rows_and_length"]
