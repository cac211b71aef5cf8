"""The collator of a pipeline-parallel run: packed rows formed per micro-batch.

Why: PyTorch's schedules cut a step's batch along dim 0 into ``pp_microbatches`` pieces of
one shape, but a packed batch is ONE row. So under ``pp_size > 1`` the step's examples are
dealt into ``pp_microbatches`` groups, each packed into its own row of one length
(``hf_ring.pipeline.microbatches.packed_micro_batches``: the shorter rows filled with a
document of padding, no label; the document bounds as ``doc_bounds``). A batch whose
example count the micro-batches do not divide (an evaluation batch of one example, an
epoch's last batch) gets filler documents of padding first: they add no token to the loss,
and documents of a packed row attend only within themselves, so the batch's loss and
gradients are those of one packed row on one process. Padded rows are collated as
without PP (the trainer fills their micro-batches: ``hf_ring.training.pp.trainer``).

Must not import TRL or ``hf_ring.training.trainer``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from hf_ring.pipeline.microbatches import packed_micro_batches
from hf_ring.sharding.labels import IGNORE_INDEX
from hf_ring.training.collator import RingDataCollator


class PipelineDataCollator(RingDataCollator):
    """:class:`RingDataCollator` whose packed batches are ``micro_batches`` packed rows of one
    length: ``input_ids``, ``labels``, ``shift_labels``, ``position_ids`` int64
    ``(micro_batches, local_len)`` and ``doc_bounds`` int32 ``(micro_batches, max_docs + 1)``
    (global document bounds, -1 after the last). Padded rows: as :class:`RingDataCollator`.

    Args: ``micro_batches`` (the plugin's ``pp_microbatches``) and :class:`RingDataCollator`'s.
    """

    def __init__(self, pad_token_id: Any = None, *, micro_batches: int = 1, **kwargs: Any):
        super().__init__(pad_token_id, **kwargs)
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        self.micro_batches = micro_batches

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not self.config.packing:
            return super().__call__(features)
        if len(features) == 0:
            raise ValueError("PipelineDataCollator got an empty batch")
        features, n = list(features), self.micro_batches
        filler = {"input_ids": [self.config.pad_token_id] * self.config.multiple,
                  "labels": [IGNORE_INDEX] * self.config.multiple}
        features += [filler] * (-len(features) % n)
        return packed_micro_batches(super().__call__, features, n, self.config.multiple, self.config.pad_token_id)


__all__ = ["PipelineDataCollator"]
