"""The language model's entry under context parallelism: its full-sequence inputs, sharded.

A multimodal model's forward, on every rank of a CP group, computes on the same full batch
up to its language model: token embeddings, the vision tower, the merge of image features
into the placeholder positions, its own positions (Qwen's 3-D M-RoPE). A forward pre-hook
on the language model, run before its ring guard, cuts what it receives along the sequence
in the layout of the active context-parallel state, exactly as ``hf_ring.shard_sequence``
cuts a text model's tokens: ``inputs_embeds`` ``(batch, seq, hidden)``, ``position_ids``
``(batch, seq)`` or ``(3 or 4, batch, seq)`` (built as ``arange(seq)``, the language
model's own default, when the model passes none), a 2-D ``attention_mask``, and a family's
own per-token inputs (Qwen3-VL's deepstack features). A packed row, given with its global
document boundaries ``cu_seq_lens_q``, is cut document by document as
``hf_ring.sharding.shard_packed`` cuts it, and the boundaries are handed down uncut, as a text
model's packed rows carry them. The guard then sees a text model's shards, marked as
hf_ring's own (:class:`~hf_ring.hf.cp_inputs.FullBatchShards`).

The cut is an index select, so gradients flow back only from this rank's tokens: each
rank's vision tower gets the gradient of its own shard of the merged embeddings, and the
ranks' gradients sum to the full sequence's, as every other parameter's do.

Owns the hook. Must not import: the Trainer, TRL, hf_ring's training or memory layers.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from hf_ring.hf.forward_context import SHARDED_KWARG, FullBatchShards
from hf_ring.hf.guard import bind_arguments
from hf_ring.hf.multimodal.families import SEQUENCE_INPUTS, Family
from hf_ring.patterns.ring.spans import BidirectionalSpans
from hf_ring.patterns.state import ContextParallelState
from hf_ring.sharding.layouts import required_multiple, shard_sequence
from hf_ring.sharding.packed import packed_shard_indices

# A packed row's global document boundaries: handed down uncut, read by the guard and ring_flash.
DOCUMENT_INPUTS = ("cu_seq_lens_q", "cu_seq_lens_k")


@dataclass(frozen=True)
class FullBatch:
    """One multimodal forward under CP, seen by its outer model: the family, the state, the
    digest of its full batch (0-d int64) and, for a family that builds bidirectional blocks
    into its mask (Gemma 3), the full batch's spans and the 2-D padding mask the base model
    got (``(batch, seq)`` or None), which replace the mask the model built. A packed row
    without CP has no state and no digest: its spans only go down (the row is not cut, and
    the varlen ring ignores the mask the model built)."""

    family: Family
    state: Optional[ContextParallelState]
    digest: Optional[torch.Tensor]
    spans: Optional[BidirectionalSpans] = None
    padding_mask: Optional[torch.Tensor] = None


# Set by the outer model's pre-hook for the duration of its forward (setup.py): the language
# model inside it then takes full-sequence inputs to shard. Called on its own (a text model
# fed shards), the language model finds it unset and is left to its guard.
CURRENT: ContextVar[Optional[FullBatch]] = ContextVar("hf_ring_multimodal_forward", default=None)


def packed_without_cp() -> bool:
    """Inside a multimodal forward whose packed row runs without CP and carries spans (Gemma
    3's): its language model's attention takes the varlen ring (``cu_seq_lens_q`` is handed
    down), which computes the documents and the spans itself and reads no mask; the other
    modules of the base model run SDPA (``setup._run_outside_the_ring``)."""
    full = CURRENT.get()
    return full is not None and full.state is None


def _tokens(inputs: dict[str, Any]) -> torch.Tensor:
    """What the language model takes per token, ``(batch, seq[, hidden])``."""
    for name in ("inputs_embeds", "input_ids"):
        t = inputs.get(name)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return t
    raise ValueError("a multimodal model's language model got neither inputs_embeds nor input_ids")


def _sharder(state: ContextParallelState, seq: int, documents: Optional[torch.Tensor],
             where: str) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """How this rank cuts a ``(..., seq, ...)`` input: in the state's layout, or, for a packed
    row (``documents``: its global boundaries ``cu_seq_lens_q``), document by document."""
    if documents is not None:
        return _packed_sharder(state, seq, documents, where)
    multiple = required_multiple(state.cp_size, state.layout)
    if seq % multiple:
        raise ValueError(
            f"{where} got a sequence of {seq} tokens (image tokens included), which layout "
            f"{state.layout!r} cannot split over {state.cp_size} ranks: pad every row to a multiple of "
            f"{multiple} tokens (RingDataCollator pads to it)"
        )
    return lambda x, dim: shard_sequence(x, state.cp_size, state.cp_rank, dim=dim, layout=state.layout)


def _packed_sharder(state: ContextParallelState, seq: int, documents: torch.Tensor,
                    where: str) -> Callable[[torch.Tensor, int], torch.Tensor]:
    if state.layout != "zigzag":
        raise NotImplementedError(
            f"{where} got a packed row (cu_seq_lens_q) but the context-parallel layout is {state.layout!r}: "
            "packed rows are zigzag-sharded document by document; use layout='zigzag' with packing"
        )
    documents = torch.as_tensor(documents).reshape(-1).cpu()  # the one host sync of the cut
    if documents.numel() and int(documents[-1]) != seq:
        raise ValueError(
            f"{where}: cu_seq_lens_q ends at {int(documents[-1])} but the packed row holds {seq} tokens "
            "(image tokens included); give the boundaries of the full packed row"
        )
    # Raises for a document the ranks cannot split; computed once for every input of the forward.
    index = packed_shard_indices(documents, state.cp_size, state.cp_rank)
    return lambda x, dim: x.index_select(dim, index.to(x.device))


def _visual_rows(mask: torch.Tensor, rows: list[torch.Tensor], shard: Callable) -> list[torch.Tensor]:
    """The rows of ``rows`` (each ``(n_true, hidden)``, in the order of ``mask``'s True
    positions, row-major) that belong to this rank's shard, in the order of its shard's."""
    mask = mask.to(torch.bool)
    order = (mask.reshape(-1).cumsum(0) - 1).view_as(mask)  # (batch, seq): each True's row
    mine = shard(order, 1)[shard(mask, 1)]  # (n_true_local,)
    return [r.index_select(0, mine.to(r.device)) for r in rows]


def shard_language_model_inputs(model: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a multimodal model's language model (registered first, before its
    guard): under a multimodal forward on CP, its full-sequence inputs sharded."""
    full = CURRENT.get()
    if full is None:
        return None
    if full.state is None:
        # A packed row without CP: nothing is cut. The mask the model built holds the
        # documents and the blocks, which go down as cu_seq_lens and spans instead.
        inputs = bind_arguments(model, args, kwargs)
        inputs["attention_mask"] = full.padding_mask
        return (), {**inputs, SHARDED_KWARG: FullBatchShards(None, full.spans)}
    where = f"{type(model).__name__} under context parallelism (cp_size={full.state.cp_size})"
    inputs = bind_arguments(model, args, kwargs)
    tokens = _tokens(inputs)
    batch, seq = tokens.shape[:2]
    shard = _sharder(full.state, seq, inputs.get("cu_seq_lens_q"), where)
    along = {**SEQUENCE_INPUTS, **full.family.sequence_inputs}
    if full.family.spans is not None:
        inputs["attention_mask"] = _ring_mask(inputs.get("attention_mask"), full, where)
    mask = inputs.get("attention_mask")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        raise NotImplementedError(
            f"{where}: the model built its own attention mask ({type(mask).__name__}) before its "
            "language model; the ring computes causal attention over the global positions and takes a "
            "2-D right-padding mask or none"
        )
    if inputs.get("position_ids") is None:
        # What the language model numbers on its own, computed on the full row.
        inputs["position_ids"] = torch.arange(seq, device=tokens.device)[None].expand(batch, -1)
    out = {}
    for name, value in inputs.items():
        if value is None or name in DOCUMENT_INPUTS or not (isinstance(value, torch.Tensor) or _tensors(value)):
            out[name] = value  # the documents' boundaries stay global, as a text model's packed rows have them
        elif name in along and isinstance(value, torch.Tensor):
            if value.shape[along[name]] != seq:
                raise ValueError(f"{where}: {name} {tuple(value.shape)} does not run along the {seq} tokens")
            out[name] = shard(value, along[name] % value.dim())
        elif name in full.family.visual_rows:
            out[name] = _visual_rows(inputs[full.family.visual_rows[name]], list(value), shard)
        else:
            raise NotImplementedError(
                f"{where}: its language model got {name}= ({type(value).__name__}), an input hf_ring does "
                f"not know how to cut along the sequence for {full.family.name}; run without context "
                "parallelism, or report the model"
            )
    out[SHARDED_KWARG] = FullBatchShards(full.digest, full.spans, full.family.causal_by_mask and full.spans is not None)
    return (), out


def _ring_mask(built: Any, full: FullBatch, where: str) -> Optional[torch.Tensor]:
    """What replaces the mask a family built itself (Gemma 3's dict by layer type): the base
    model's 2-D padding mask, the spans going down apart. Under CP ``ring_flash``'s mask
    builder returns None for every layer type; anything else (a 4-D mask, a prepared dict
    passed in) is a mask hf_ring did not make, and is refused."""
    values = list(built.values()) if isinstance(built, dict) else [built]
    if all(v is None for v in values):
        return full.padding_mask
    raise NotImplementedError(
        f"{where}: {full.family.name}'s language model got a mask that is not the one ring_flash builds under "
        f"context parallelism ({type(built).__name__} with a prepared mask): hf_ring computes the causal mask, "
        "the sliding windows and the bidirectional image spans (from token_type_ids) in the ring; pass a 2-D "
        "right-padding attention_mask (or none) and token_type_ids"
    )


def _tensors(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)
