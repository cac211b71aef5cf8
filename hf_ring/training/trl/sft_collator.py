"""TRL's language-modeling batches, built by :class:`RingDataCollator` for context parallelism.

``SFTTrainer`` prepares its dataset itself (chat templates, completion-only and
assistant-only masks folded into ``labels``, packing into rows of ``max_length`` with the
documents' lengths in ``seq_lengths``) and then collates with
``trl.trainer.sft_trainer.DataCollatorForLanguageModeling``. That collator pads rows, or,
padding-free (``padding_free=True``, or packing with a best-fit strategy), concatenates
every document of the batch into one row that flash-attention splits by ``position_ids``.
Under context parallelism neither shape is usable as is: labels must be shifted on the
full sequence and each rank keeps only its shard.

:class:`RingSFTCollator` reads TRL's collator's settings and hands the same rows to
:class:`RingDataCollator`: padded rows stay rows (dense mode); padding-free batches are
split back into their documents (by ``seq_lengths``, or one document per example) and
packed by hf_ring, each document zigzag-sharded on its own, so no document attends to
another on any rank.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from hf_ring.training.collator import RingDataCollator
from hf_ring.patterns.state import ContextParallelState

# The batch's token count before padding (TRL logs it as ``num_tokens``); popped before the forward.
NUM_TOKENS_KEY = "hf_ring_num_tokens"


def _documents(feature: Mapping[str, Any]) -> list[dict[str, list[int]]]:
    """One TRL example split into its documents (a packed row holds several)."""
    ids = list(feature["input_ids"])
    labels = list(feature["labels"]) if feature.get("labels") is not None else list(ids)
    lengths = feature.get("seq_lengths")
    if lengths is None:
        return [{"input_ids": ids, "labels": labels}]
    lengths = [int(n) for n in lengths]
    if sum(lengths) != len(ids):
        raise ValueError(
            f"a packed example's seq_lengths add up to {sum(lengths)} but it has {len(ids)} tokens; "
            "seq_lengths must describe the row (as TRL's pack_dataset writes it)"
        )
    docs, start = [], 0
    for n in lengths:
        if n > 0:
            docs.append({"input_ids": ids[start : start + n], "labels": labels[start : start + n]})
        start += n
    return docs


class RingSFTCollator:
    """Collate TRL SFT examples into this rank's shard (see the module docstring).

    Examples are mappings with ``input_ids`` (list of ints), optionally ``labels`` (same
    length, ``-100`` where nothing is learned) and ``seq_lengths`` (packed rows). The
    output is :class:`RingDataCollator`'s (``input_ids``, ``labels``, ``shift_labels``,
    ``position_ids``, and for padding-free batches ``cu_seq_lens_q/k``,
    ``max_length_q/k``), plus ``NUM_TOKENS_KEY``: the batch's tokens before padding.

    Args:
        ring: the collator that pads, shifts and shards; ``ring.config.packing`` says
            whether batches are padding-free (documents packed into one row).
    """

    def __init__(self, ring: RingDataCollator):
        self.ring = ring

    @classmethod
    def for_trl(
        cls,
        state: ContextParallelState,
        pad_token_id: int,
        padding_free: bool,
        pad_to_multiple_of: int | None = None,
    ) -> "RingSFTCollator":
        """The collator for TRL's settings (``SFTConfig.padding_free`` / packing strategy and
        ``pad_to_multiple_of``) on the ranks ``state`` describes."""
        ring = RingDataCollator.for_state(state, pad_token_id, packing=padding_free)
        if pad_to_multiple_of:
            # TRL's multiple and the layout's: padding more is exact (padding learns nothing).
            multiple = math.lcm(int(pad_to_multiple_of), ring.config.base_multiple)
            ring = RingDataCollator.for_state(state, pad_token_id, packing=padding_free, pad_to_multiple_of=multiple)
        return cls(ring)

    @property
    def padding_free(self) -> bool:
        return self.ring.config.packing

    def matches(self, state: ContextParallelState) -> bool:
        return self.ring.matches(state)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(features) == 0:
            raise ValueError("RingSFTCollator got an empty batch")
        if self.padding_free:
            examples = [doc for feature in features for doc in _documents(feature)]
        else:
            examples = [{"input_ids": f["input_ids"], "labels": f.get("labels")} for f in features]
        batch = self.ring(examples)
        batch[NUM_TOKENS_KEY] = sum(len(f["input_ids"]) for f in features)
        return batch
