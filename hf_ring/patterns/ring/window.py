"""Sliding windows and attention chunks inside the ring: which parts of each step's blocks
they keep.

transformers' ``sliding_window`` (Mistral, Gemma 2/3, Qwen2, GPT-OSS, ...) lets query ``i``
see key ``j`` iff ``0 <= i - j < window`` (global positions), on top of causal; Llama 4's
``attention_chunk_size`` iff ``i // chunk == j // chunk`` (the same chunk of the row), on
top of causal. The causal schedule (schedule.py) gives each step's blocks; with a window
or chunks, each block's visible pairs are read from the global positions the layout gives
its rows and columns (``hf_ring.sharding.shard_indices``) and the block becomes one of:

- nothing: no pair visible. The block is dropped, so its kernel call never happens: with
  a window (or chunks) much shorter than the sequence most steps of a long ring compute
  nothing.
- a smaller block: the rectangle is trimmed to the rows and columns that see anything,
  which then is either wholly visible (non-causal) or a causal square; it runs on the
  ordinary kernel, as without a window.
- a masked block (on the window's edge, or across a chunk boundary): the trimmed
  rectangle with its exact mask, run on the backend's masked kernel.

Computed once per plan and step (the plan caches it) from Python-side index tensors: no
device work, no host sync on the hot path.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from hf_ring.patterns.ring.schedule import Block


def window_block(
    blk: Block, q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int], chunk: Optional[int] = None
) -> list[Block]:
    """``blk`` cut to a window of ``window`` tokens and to chunks of ``chunk`` tokens.

    Args:
        blk: a causal-schedule block (its pairs are exactly the causally visible ones).
        q_pos: int64 ``(local_len,)``, global position of each local query row.
        k_pos: int64 ``(local_len,)``, global position of each received key row.
        window: the window in tokens (>= 1), or None: none.
        chunk: the chunk in tokens (>= 1), or None: none.

    Returns:
        ``[]`` when no pair is visible, else one block as described in the module docstring.
    """
    qp = q_pos[blk.q_start:blk.q_end]
    kp = k_pos[blk.k_start:blk.k_end]
    dist = qp[:, None] - kp[None, :]  # (nq, nk)
    visible = dist >= 0
    if window is not None:
        visible &= dist < window
    if chunk is not None:
        visible &= (qp[:, None] // chunk) == (kp[None, :] // chunk)
    if blk.causal:  # the schedule's own mask, kept so a window can only remove pairs
        visible &= torch.ones(visible.shape, dtype=torch.bool).tril()
    rows = visible.any(dim=1).nonzero().flatten()
    cols = visible.any(dim=0).nonzero().flatten()
    if rows.numel() == 0:
        return []
    r0, r1 = int(rows[0]), int(rows[-1]) + 1
    c0, c1 = int(cols[0]), int(cols[-1]) + 1
    sub = visible[r0:r1, c0:c1]
    qs, ks = blk.q_start + r0, blk.k_start + c0
    if bool(sub.all()):
        return [Block(qs, blk.q_start + r1, ks, blk.k_start + c1, False)]
    nq, nk = sub.shape
    if nq == nk and torch.equal(sub, torch.ones(nq, nk, dtype=torch.bool).tril()):
        return [Block(qs, blk.q_start + r1, ks, blk.k_start + c1, True)]
    return [Block(qs, blk.q_start + r1, ks, blk.k_start + c1, False, sub.contiguous())]


def window_blocks(
    blocks: Sequence[Block], q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int],
    chunk: Optional[int] = None,
) -> list[Block]:
    """Every block of a step cut to the window and the chunks (see :func:`window_block`)."""
    return [w for blk in blocks for w in window_block(blk, q_pos, k_pos, window, chunk)]
