"""One variable-length kernel call per ring step for packed rows.

A packed row's schedule gives one block per document per step (see schedule.py; a sliding
window may drop a document's block, trim it, or mask it); with a per-block kernel that is
one launch per document, which for many short documents costs more in launches than in
attention. When the backend has a varlen kernel, a step's blocks
run in one call instead: their query rows and key rows are gathered into contiguous
tensors, the blocks' boundaries become ``cu_q``/``cu_k``, and the results are put back at
the rows they came from. The blocks of one step never share a query row nor a key row
(one block per document), so putting back is a plain assignment or add, and a step's blocks
may be split over several calls (by causal flag; masked blocks one by one) in any order.

Tensors here are the ring's ``(1, s, h, d)`` (a packed row is one batch row) and lse
``(1, h, s)``; the kernel sees ``(total, h, d)`` and lse ``(h, total)``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Union

import torch

from hf_ring.patterns.ring.merge import merge_block_

Rows = Union[slice, torch.Tensor]


@dataclass(frozen=True)
class StepBatch:
    """A step's blocks as one varlen call: which local rows, and the kernel's boundaries."""

    q_rows: Rows
    k_rows: Rows
    k_lens: list[int]
    cu_q: torch.Tensor  # int32 (n_blocks + 1,)
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool


def _rows(spans: list[tuple[int, int]], device: torch.device) -> Rows:
    """The rows of the spans, in order: a slice (a view, no copy) when they follow each
    other without gaps, else an index tensor."""
    if all(a_end == b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])):
        return slice(spans[0][0], spans[-1][1])
    return torch.cat([torch.arange(s, e) for s, e in spans]).to(device)


def _cu(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def step_batch(blocks, device: torch.device) -> Optional[StepBatch]:
    """The varlen call for ``blocks`` (None when the step has none)."""
    if not blocks:
        return None
    causal = {b.causal for b in blocks}
    if len(causal) != 1:
        # One call takes one mask flag; packed-row steps never mix them (schedule.py).
        raise ValueError(f"a varlen step needs blocks that all share the causal flag, got {blocks}")
    q_lens = [b.q_end - b.q_start for b in blocks]
    k_lens = [b.k_end - b.k_start for b in blocks]
    return StepBatch(
        _rows([(b.q_start, b.q_end) for b in blocks], device),
        _rows([(b.k_start, b.k_end) for b in blocks], device),
        k_lens, _cu(q_lens, device), _cu(k_lens, device), max(q_lens), max(k_lens), causal.pop(),
    )


def varlen_groups(blocks: list) -> tuple[list[list], list]:
    """A step's blocks split into varlen calls and the rest: the unmasked blocks grouped by
    their causal flag (one call each), and the masked ones (a sliding window's edge), which
    run one by one on the masked kernel. A window cuts some documents' blocks to full
    rectangles and leaves others causal, so a windowed step may need both calls."""
    plain = [b for b in blocks if b.mask is None]
    groups = [[b for b in plain if b.causal == causal] for causal in (True, False)]
    return [g for g in groups if g], [b for b in blocks if b.mask is not None]


def _check_one_row(q: torch.Tensor) -> None:
    if q.shape[0] != 1:
        raise ValueError(f"the varlen ring step takes one packed row (batch 1), got batch {q.shape[0]}")


def forward_varlen(plan, blocks, q, cur_k, cur_v, out, lse, first: bool) -> None:
    """As ``forward_blocks``' loop, in one call; ``first``: the blocks cover every query
    row once and their results initialise ``out`` ``(1, s, hq, d)`` / ``lse`` ``(1, hq, s)``."""
    _check_one_row(q)
    sb = plan.varlen_batch(blocks, q.device)
    if sb is None:
        return
    r, kr = sb.q_rows, sb.k_rows
    block_out, block_lse = plan.backend.varlen_forward(
        q[0, r], cur_k[0, kr], cur_v[0, kr], sb.cu_q, sb.cu_k, sb.max_q, sb.max_k, sb.causal, plan.scale
    )  # (n_q, hq, d), (hq, n_q)
    block_out, block_lse = block_out.unsqueeze(0), block_lse.unsqueeze(0)
    if first:
        out[:, r] = block_out
        lse[:, :, r] = block_lse
        return
    acc_out, acc_lse = out[:, r], lse[:, :, r]  # views for a slice, copies for an index
    merge_block_(acc_out, acc_lse, block_out, block_lse)
    if not isinstance(r, slice):
        out[:, r] = acc_out
        lse[:, :, r] = acc_lse


def backward_varlen(plan, blocks, dout, q, cur_k, cur_v, out, lse, dq, first: bool) -> list:
    """As ``backward_blocks``' loop, in one call: dq goes into ``dq`` (set when ``first``,
    else added); returns ``[(k_slice, dk, dv)]`` with ``(1, n, hk, d)`` views, as
    ``add_block_dkv`` takes them."""
    _check_one_row(q)
    sb = plan.varlen_batch(blocks, q.device)
    if sb is None:
        return []
    r, kr = sb.q_rows, sb.k_rows
    bdq, bdk, bdv = plan.backend.varlen_backward(
        dout[0, r], q[0, r], cur_k[0, kr], cur_v[0, kr], out[0, r], lse[0][:, r],
        sb.cu_q, sb.cu_k, sb.max_q, sb.max_k, sb.causal, plan.scale,
    )  # (n_q, hq, d), (n_k, hk, d), (n_k, hk, d)
    if first:
        dq[0, r] = bdq
    else:
        dq[0, r] += bdq  # rows are distinct, so gather-add-scatter is exact for an index
    if isinstance(kr, slice):
        return [(kr, bdk.unsqueeze(0), bdv.unsqueeze(0))]
    # Split back per block (views) so add_block_dkv keeps taking slices.
    bounds = [0, *itertools.accumulate(sb.k_lens)]
    return [
        (slice(blk.k_start, blk.k_end), bdk[None, a:b], bdv[None, a:b])
        for blk, a, b in zip(blocks, bounds[:-1], bounds[1:])
    ]
