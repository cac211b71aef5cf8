"""A step's batch as a schedule's micro-batches: equal shapes along dim 0, packed rows too.

Why: PyTorch's schedules cut every tensor argument of ``step`` along dim 0 into
``n_microbatches`` pieces, and each stage's receive buffers are sized once, so every
micro-batch must have the same shape. Padded rows already do (the collator pads the step's
batch to one length; the schedule splits the rows). A packed row holds all of a batch's
documents, so packed micro-batches are packed apart: the batch's examples are dealt into
``n`` groups in order, each packed into its own row by the same collator, and the shorter
rows get one filler document at their end (padding tokens, no label, positions from 0) up
to the longest; the document bounds, of different counts, travel as one int tensor
``(n, max_docs + 1)`` padded with -1 (``doc_bounds``), which each stage turns back into
``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``stages.StageModule``). A filler document adds no
token to the loss, and documents of a packed row attend only within themselves, so the
step's loss and gradients are those of the one packed row of one process.

Must not import accelerate, TRL, or hf_ring's training layer (the collator is passed in).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from hf_ring.sharding.labels import IGNORE_INDEX


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def deal(features: Sequence[Any], n: int) -> list[list[Any]]:
    """``features`` in ``n`` consecutive groups of equal size (ValueError unless ``n`` divides them)."""
    if n < 1 or len(features) % n:
        raise ValueError(f"a batch of {len(features)} examples does not split into {n} pipeline micro-batches of "
                         "equal size: make the batch size a multiple of pp_microbatches")
    size = len(features) // n
    return [list(features[i * size:(i + 1) * size]) for i in range(n)]


def packed_micro_batches(collate: Callable[[list], dict[str, Any]], features: Sequence[Mapping[str, Any]], n: int,
                         multiple: int, pad_token_id: int) -> dict[str, Any]:
    """The step's examples packed into ``n`` rows of one length, stacked: ``input_ids``,
    ``labels``, ``shift_labels``, ``position_ids`` ``(n, local_len)`` and ``doc_bounds``
    int32 ``(n, max_docs + 1)``.

    Args:
        collate: a packing ``RingDataCollator`` (this rank's shard of one packed row).
        features: the step's examples (``input_ids``, optionally ``labels``).
        n: micro-batches.
        multiple: the collator's document length multiple (``config.multiple``).
        pad_token_id: the filler document's token.
    """
    groups = deal(features, n)
    lengths = [sum(_round_up(len(f["input_ids"]), multiple) for f in g) for g in groups]
    rows = []
    for group, length in zip(groups, lengths):
        if length < max(lengths):
            filler = max(lengths) - length
            group = [*group, {"input_ids": [pad_token_id] * filler, "labels": [IGNORE_INDEX] * filler}]
        rows.append(collate(group))
    docs = max(len(r["cu_seq_lens_q"]) for r in rows)
    bounds = torch.full((n, docs), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        bounds[i, :len(r["cu_seq_lens_q"])] = r["cu_seq_lens_q"]
    out = {key: torch.cat([r[key] for r in rows]) for key in ("input_ids", "labels", "shift_labels", "position_ids")}
    out["doc_bounds"] = bounds
    return out


__all__ = ["deal", "packed_micro_batches"]
