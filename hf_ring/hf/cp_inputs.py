"""Checks, once per forward, that a model's inputs are ones the ring can serve.

Why here and not in every attention layer: these properties belong to the batch (padding,
positions, cache), so one check per forward is enough, and under context parallelism it
is done collectively, with one small all-gather over the CP group, so that a bad batch
raises the same error on every rank instead of leaving the others waiting in the ring.

Under CP every rank feeds its shard of the sequence (``hf_ring.shard_sequence``, or
``hf_ring.sharding.shard_packed`` for packed rows) with the *global* ``position_ids``:
RoPE runs in the model on those positions, and the ring's causal mask follows the layout
(held in the state, else zigzag). Right padding needs no mask at all under a causal mask
(no real token attends to a later one), so a 2-D right-padding ``attention_mask`` is
accepted and then dropped; every other mask is refused.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from hf_ring.ring.groups import ContextParallelState
from hf_ring.sharding.layouts import shard_indices, unshard_sequence
from hf_ring.sharding.packed import packed_shard_indices, unshard_packed


def _cache_argument(inputs: dict[str, Any]) -> Optional[Any]:
    # transformers 5 calls it `cache` (with `past_key_values` deprecated), 4.57 `past_key_values`.
    for name in ("cache", "past_key_values"):
        if inputs.get(name) is not None:
            return inputs[name]
    return None


def check_packed_inputs(inputs: dict[str, Any]) -> None:
    """Packed rows (``cu_seq_lens_q`` given): batch size 1 and no padding mask.

    The document boundaries are the whole mask: a padding mask next to them contradicts
    them (the collator pads documents instead), and is refused rather than ignored.
    """
    cu = inputs.get("cu_seq_lens_q")
    if cu is None:
        return
    ids = inputs.get("input_ids")
    if ids is None:
        ids = inputs.get("inputs_embeds")
    if ids is not None and ids.shape[0] != 1:
        raise ValueError(
            f"packed rows (cu_seq_lens_q given) must come with batch size 1, got {ids.shape[0]}; "
            "concatenate the documents of a batch into one row"
        )
    mask = inputs.get("attention_mask")
    if mask is not None and not (mask.dim() == 2 and bool(mask.all())):
        raise ValueError(
            "packed rows (cu_seq_lens_q given) take no padding attention_mask: the document "
            "boundaries define the mask; pad documents instead (RingDataCollator does) and pass "
            "attention_mask=None"
        )


def _expected_positions(
    seq_local: int, cu_seqlens: Optional[torch.Tensor], state: ContextParallelState, device
) -> torch.Tensor:
    """The global position of each of this rank's tokens, ``(seq_local,)`` int64."""
    if cu_seqlens is None:
        return shard_indices(seq_local * state.cp_size, state.cp_size, state.cp_rank, state.layout).to(device)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    idx = packed_shard_indices(cu.cpu(), state.cp_size, state.cp_rank).to(device)
    doc = torch.searchsorted(cu, idx, right=True) - 1
    # Positions restart at 0 in every document.
    return idx - cu[doc]


def _refuse_local(inputs: dict[str, Any], state: ContextParallelState) -> None:
    """Errors that every rank sees alike from its own inputs (no communication needed)."""
    if _cache_argument(inputs) is not None:
        raise NotImplementedError(
            "KV cache / generate() is not supported under context parallelism "
            f"(cp_size={state.cp_size}): each rank holds only a shard of the sequence, so a cache "
            "would hold a shard of K/V. Generate without CP (hf_ring.set_context_parallel_state(None)) "
            "on the full sequence"
        )
    if inputs.get("use_cache") is True:
        raise NotImplementedError(
            f"use_cache=True is not supported under context parallelism (cp_size={state.cp_size}): "
            "a cache would hold only this rank's shard of K/V; pass use_cache=False or leave it unset"
        )
    check_packed_inputs(inputs)
    mask = inputs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise ValueError(
            f"ring_flash under context parallelism takes no {mask.dim()}-D attention_mask: the ring "
            "computes causal attention over the global positions (and per document for packed rows "
            "with cu_seq_lens_q); pass a 2-D right-padding mask or none"
        )
    if inputs.get("position_ids") is None:
        raise ValueError(
            "ring_flash under context parallelism needs the global position_ids of this rank's "
            "shard (shard_sequence(arange(seq_len)[None], cp_size, cp_rank), as RingDataCollator "
            "emits): without them the model numbers the local tokens 0..local_len-1 and RoPE is wrong"
        )


def validate_cp_inputs(inputs: dict[str, Any], state: ContextParallelState) -> None:
    """Validate one forward's inputs under CP (``state.cp_size > 1``); collective.

    Args:
        inputs: the base model's forward arguments by name: ``position_ids``
            ``(batch or 1, seq_local)`` int, ``attention_mask`` ``(batch, seq_local)`` 0/1 or
            None, optionally ``cu_seq_lens_q`` int ``(n_docs + 1,)``, ``cache`` /
            ``past_key_values``, ``use_cache``.
        state: the active context-parallel state.

    Raises:
        NotImplementedError: a KV cache or ``use_cache=True``.
        ValueError: missing or non-global ``position_ids``, a mask other than right padding,
            packed rows with batch size > 1 or a padding mask. The collective checks raise on
            every rank of the CP group.
    """
    _refuse_local(inputs, state)
    positions = inputs["position_ids"]
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    mask = inputs.get("attention_mask")
    batch, seq_local = (mask.shape if mask is not None else positions.shape)
    keep = torch.ones(batch, seq_local, dtype=torch.int32, device=positions.device)
    if mask is not None:
        keep = mask.to(device=positions.device, dtype=torch.int32)
    cu = inputs.get("cu_seq_lens_q")
    expected = _expected_positions(positions.shape[-1], cu, state, positions.device)
    # Positions of padding tokens do not matter: nothing real attends to them.
    wrong = ((positions != expected) & (keep != 0)).any().to(torch.int32)
    payload = torch.cat([keep, wrong.expand(batch, 1)], dim=1)
    gathered = [torch.empty_like(payload) for _ in range(state.cp_size)]
    dist.all_gather(gathered, payload, group=state.cp_group)
    bad_ranks = [r for r, t in enumerate(gathered) if int(t[0, -1]) != 0]
    if bad_ranks:
        what = "per-document positions of the packed row" if cu is not None else f"layout {state.layout!r}"
        raise ValueError(
            f"position_ids on CP rank(s) {bad_ranks} are not the global positions of their shard "
            f"({what}, the layout of the active context-parallel state): shard position_ids exactly "
            "like input_ids, from arange(seq_len) over the full padded sequence (RingDataCollator "
            "does); a collator sharding in another layout than the state's is a mismatch"
        )
    shards = [t[:, :-1] for t in gathered]
    full = unshard_packed(shards, cu.cpu()) if cu is not None else unshard_sequence(shards, 1, state.layout)
    if bool((full[:, 1:] > full[:, :-1]).any()):
        raise ValueError(
            "ring_flash under context parallelism accepts only right padding (padding tokens at "
            "the end of each row, as RingDataCollator pads): this attention_mask has a padding "
            "token before a real one (left padding or holes); pad on the right instead"
        )
