"""Which decoder layers each pipeline stage holds: pure index math, checked.

Why its own module: the split is data that every rank must compute alike (a rank that
disagrees would send activations to a stage expecting others' shapes, or hang), and it is
tested without a world. Two ways: an explicit ``pp_layers`` (the number of decoder layers of
every stage, in stage order, as the user balances them) or an even split (transformers'
``layer_range_for_rank`` rule: the remainder goes to the first stages, one layer each). The
embedding always sits on the first stage, the final norm, LM head and loss on the last.

Stages are numbered as PyTorch's schedules number them: with ``stages_per_rank = V > 1``
(an interleaved schedule) pipeline rank ``r`` holds stages ``r, r + pp, r + 2 pp, ...``
(the "loop" placement of ``torch.distributed.pipelining``), or, for the V-shaped schedules
(``ZBVZeroBubble``, ``DualPipeV``: two stages a rank), ``r`` and ``2 pp - 1 - r``.

Must not import torch.distributed, transformers, accelerate, or hf_ring's other layers.
"""

from __future__ import annotations

from typing import Optional, Sequence


def stage_layer_ranges(num_layers: int, num_stages: int,
                       pp_layers: Optional[Sequence[int]] = None) -> list[tuple[int, int]]:
    """The ``[start, end)`` decoder layers of every stage, in stage order.

    Args:
        num_layers: the model's decoder layers.
        num_stages: pipeline stages in all (``pp_size x stages_per_rank``).
        pp_layers: layers per stage, in stage order (None: an even split).

    Raises:
        ValueError: a split that does not cover the layers exactly, or a stage left without
            a layer (it would only pass activations on: give the stages fewer layers each or
            use fewer stages).
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"the number of pipeline stages must be a positive int, got {num_stages!r}")
    if pp_layers is None:
        if num_layers < num_stages:
            raise ValueError(
                f"{num_stages} pipeline stages need at least one decoder layer each, but the model has {num_layers}; "
                "use fewer stages (pp_size x stages per rank)")
        per, extra = divmod(num_layers, num_stages)
        counts = [per + (s < extra) for s in range(num_stages)]
    else:
        counts = list(pp_layers)
        if len(counts) != num_stages or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
            raise ValueError(
                f"pp_layers={list(pp_layers)!r} must give a positive number of decoder layers for each of the "
                f"{num_stages} stages (pp_size x stages per rank), in stage order")
        if sum(counts) != num_layers:
            raise ValueError(f"pp_layers={counts!r} holds {sum(counts)} decoder layers, but the model has "
                             f"{num_layers}: the stages must hold every layer once")
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def stages_of_rank(pp_rank: int, pp_size: int, stages_per_rank: int, v_shape: bool = False) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` holds, ascending: the loop placement, or
    with ``v_shape`` (two stages a rank) ``pp_rank`` and ``2 pp - 1 - pp_rank``."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is outside pp_size={pp_size}")
    if v_shape:
        if stages_per_rank != 2:
            raise ValueError(f"a V-shaped schedule places two stages on every rank, not {stages_per_rank}")
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + v * pp_size for v in range(stages_per_rank)]


def parse_pp_layers(text: Optional[str]) -> Optional[list[int]]:
    """``"3,5"`` (a command line's ``--pp_layers``) as ``[3, 5]``; None or ``""`` as None."""
    if not text:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--pp_layers must be comma-separated layer counts, one per stage (e.g. 3,5), "
                         f"got {text!r}") from None


__all__ = ["parse_pp_layers", "stage_layer_ranges", "stages_of_rank"]
