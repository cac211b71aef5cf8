"""The vision tower split over a CP group: each rank encodes a contiguous share of the images
of one tower call, and the features are all-gathered in order.

Why: replicated, the tower's time and activation memory do not fall with ``cp_size`` while
the language model's do; at cp=8 it would take about half of a 128k-token step of
Qwen2.5-VL-7B (``benchmarks/vlm_tower_share.py``, modelled from FLOPs), a tenth when split.

Exact: a Qwen tower encodes every grid entry (an image, or a video) on its own (attention
within a frame or a window, rotary positions per entry), so a share of the entries gives
exactly those rows of the whole call's output. The all-gather's backward reduce-scatters:
each rank's features get the sum of every rank's gradient of them, which is the full
sequence's (each rank's language model reads only its shard's placeholders). The tower's
parameters then get the gradient of this rank's images only; the training paths sum
gradients over the dp x cp world, as for every parameter.

When: under a multimodal forward on CP (``shard.CURRENT``, set by the base model's
pre-hook) and for the families whose table entry names their tower (``Family.tower``: a
module called as ``tower(patches (n_patches, patch_dim), grid_thw (n_entries, 3))``).
A call with fewer entries than ranks runs whole on every rank (a rank without an image
would skip the tower, and under FSDP every rank must run each block): decided from the
grids alone, which every rank holds, so every rank decides alike. Before the gather the
ranks check (one 2-int all-gather) that they hold the same full batch: a split of
different grids would gather rows of different sizes.

The tower's output keeps what the base model reads, gathered: ``pooler_output`` (merged
features, ``(n_tokens, hidden)``) and Qwen3-VL's ``deepstack_features`` (a list of the
same shape); ``last_hidden_state`` (the pre-merge patches, 4 x larger) is left out (None)
rather than left a share; the tower's hidden states, when asked for, are gathered by patch;
its attention weights are refused.

Part of the transformers integration (multimodal). Must not import the Trainer, TRL, or
hf_ring's training and memory layers.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from hf_ring.distributed.collectives import GroupCollectives, all_gather
from hf_ring.hf.guard import bind_arguments
from hf_ring.hf.multimodal.shard import CURRENT, FullBatch
from hf_ring.hf.randomness.refusals import NoDraws
from hf_ring.patterns.validation import check_agreement

_SPLIT_FLAG = "_hf_ring_tower_split"
# Read by the output hook of the tower call the input hook split (None: ran whole).
_ACTIVE: ContextVar[Optional["TowerSplit"]] = ContextVar("hf_ring_tower_split", default=None)
# In force while a split call runs: a random draw on a rank's share matches no one-process draw.
_NO_DRAWS: ContextVar[Optional[NoDraws]] = ContextVar("hf_ring_tower_no_draws", default=None)


@dataclass(frozen=True)
class TowerSplit:
    """One tower call's split: rank ``r`` encodes grid entries ``entries[r]`` (a half-open
    range), which are patch rows ``patches[r]`` of the input and ``rows[r]`` of the output."""

    entries: tuple[tuple[int, int], ...]
    patches: tuple[tuple[int, int], ...]
    rows: tuple[tuple[int, int], ...]
    full: FullBatch

    def counts(self, per_patch: bool) -> list[int]:
        """Every rank's number of output rows (or of patches, ``per_patch``)."""
        return [hi - lo for lo, hi in (self.patches if per_patch else self.rows)]


def plan_split(grids: list[list[int]], cp_size: int, merge: int) -> Optional[tuple]:
    """Contiguous shares of the grid entries ``[(t, h, w), ...]`` for ``cp_size`` ranks,
    balanced by patch count: ``(entries, patches, rows)`` ranges per rank, or None when there
    are fewer entries than ranks."""
    n = len(grids)
    if n < cp_size:
        return None
    sizes = [t * h * w for t, h, w in grids]
    cum = [0]
    for s in sizes:
        cum.append(cum[-1] + s)
    cuts = [0]
    for r in range(1, cp_size):
        target = cum[-1] * r / cp_size
        lo, hi = cuts[-1] + 1, n - (cp_size - r)  # every rank keeps at least one entry
        cuts.append(min(range(lo, hi + 1), key=lambda i: abs(cum[i] - target)))
    cuts.append(n)
    entries = tuple(zip(cuts[:-1], cuts[1:]))
    patches = tuple((cum[a], cum[b]) for a, b in entries)
    rows = tuple((p // merge**2, q // merge**2) for p, q in patches)
    return entries, patches, rows


def split_tower(tower: nn.Module) -> None:
    """Put the split's hooks on ``tower`` (idempotent; copies of the model carry the flag)."""
    if tower.__dict__.get(_SPLIT_FLAG):
        return
    tower.register_forward_pre_hook(_take_share, with_kwargs=True)
    tower.register_forward_hook(_gather_features)
    tower.register_forward_hook(_end_share, always_call=True)
    tower.__dict__[_SPLIT_FLAG] = True


def _take_share(tower: nn.Module, args: tuple, kwargs: dict):
    _ACTIVE.set(None)
    full = CURRENT.get()
    # A packed row without CP (FullBatch.state None) is not cut: its tower runs whole.
    if full is None or full.state is None or full.state.cp_size == 1:
        return None
    state = full.state
    inputs = bind_arguments(tower, args, kwargs)
    patches, grid = inputs.get("hidden_states"), inputs.get("grid_thw")
    if not (isinstance(patches, torch.Tensor) and isinstance(grid, torch.Tensor)):
        raise NotImplementedError(
            f"{type(tower).__name__} under context parallelism was called without (hidden_states, grid_thw) "
            "tensors, the call hf_ring splits over the CP group; report the model"
        )
    plan = plan_split(grid.tolist(), state.cp_size, tower.config.spatial_merge_size)
    if plan is None:
        return None
    entries, patch_ranges, rows = plan
    if patch_ranges[-1][1] != patches.shape[0]:
        raise ValueError(
            f"{type(tower).__name__}: grid_thw {grid.tolist()} describes {patch_ranges[-1][1]} patches but "
            f"the pixel values hold {patches.shape[0]} rows; pass the processor's pixel values and grids together"
        )
    split = TowerSplit(entries, patch_ranges, rows, full)
    check_agreement(
        state.cp_group, [("full_batch_digest", 0), ("tower_rows", rows[-1][1])], full.digest.device,
        f"the images of {type(tower).__name__}'s call",
        "every rank of a CP group must hold the same full batch of an image-text model (the same "
        "input_ids, pixel values and grids), each rank's shard is cut by hf_ring at the language model",
        values=torch.stack([full.digest, full.digest.new_tensor(rows[-1][1])]),
    )
    (e0, e1), (p0, p1) = entries[state.cp_rank], patch_ranges[state.cp_rank]
    inputs["hidden_states"] = patches[p0:p1]
    inputs["grid_thw"] = grid[e0:e1]
    _ACTIVE.set(split)
    no_draws = NoDraws(f"{type(tower).__name__}, whose images hf_ring splits over the CP group")
    no_draws.__enter__()
    _NO_DRAWS.set(no_draws)
    return (), inputs


def _end_share(tower: nn.Module, args: tuple, output: Any) -> None:
    no_draws = _NO_DRAWS.get()
    if no_draws is not None:
        _NO_DRAWS.set(None)
        no_draws.__exit__(None, None, None)


def _gather(x: torch.Tensor, split: TowerSplit, per_patch: bool = False) -> torch.Tensor:
    """``x`` ``(local rows, hidden)`` -> ``(all rows, hidden)``: every rank's rows in rank
    order (rows of merged tokens, or of patches with ``per_patch``)."""
    counts = split.counts(per_patch)
    most = max(counts)
    padded = torch.cat([x, x.new_zeros(most - x.shape[0], *x.shape[1:])]) if x.shape[0] < most else x
    gathered = all_gather(padded, GroupCollectives(split.full.state.cp_group))  # (cp, most, hidden)
    return torch.cat([gathered[r, :n] for r, n in enumerate(counts)])


def _gather_features(tower: nn.Module, args: tuple, output: Any):
    split = _ACTIVE.get()
    _ACTIVE.set(None)
    if split is None:
        return None
    if getattr(output, "attentions", None) is not None:
        raise NotImplementedError(
            f"{type(tower).__name__}'s attention weights under context parallelism: the tower's images are split "
            "over the CP group, so each rank holds only its share of them; ask for them without context parallelism"
        )
    gathered = {"pooler_output": _gather(output.pooler_output, split)}
    if getattr(output, "deepstack_features", None) is not None:
        gathered["deepstack_features"] = [_gather(f, split) for f in output.deepstack_features]
    if getattr(output, "hidden_states", None) is not None:  # (n_patches, width) per block, asked for
        gathered["hidden_states"] = tuple(_gather(h, split, per_patch=True) for h in output.hidden_states)
    # A new output rather than fields set to None: a ModelOutput keeps a field set to None
    # in its dict, where output[0] would still read this rank's share.
    return type(output)(**gathered)
