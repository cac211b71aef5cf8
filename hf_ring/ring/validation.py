"""Checks run before any point-to-point transfer, so that a mistake is an error on every
rank instead of a hang.

Local checks need no communication. The cross-rank check gathers a few integers from
every rank of the group (one small all-gather per call) and raises the same error on all
ranks when their shapes, dtypes or settings disagree: mismatched ring messages would
otherwise block forever or corrupt memory.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from hf_ring.sharding.layouts import check_layout

_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_LAYOUT_CODES = {"zigzag": 0, "stripe": 1, "contiguous": 2}


def check_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, causal: bool) -> None:
    """Shapes, dtypes and layout of this rank's q ``(b, s, hq, d)``, k and v ``(b, s, hk, d)``."""
    check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be (batch, local_seq, heads, head_dim) (flash-attn layout), got "
                f"shape {tuple(t.shape)}; transformers' (batch, heads, seq, dim) tensors need "
                ".transpose(1, 2)"
            )
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; ring attention takes {[str(d) for d in _DTYPES]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, s, hq, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, local_seq and "
            "head_dim: every rank holds the same tokens of q, k and v"
        )
    if hq % k.shape[2] != 0:
        raise ValueError(
            f"n_heads={hq} is not a multiple of n_kv_heads={k.shape[2]}; grouped-query "
            "attention needs every KV head to serve the same number of query heads"
        )
    if s == 0:
        raise ValueError("local_seq is 0: every rank must hold at least one token")
    if causal and layout == "zigzag" and s % 2 != 0:
        raise ValueError(
            f"local_seq={s} is odd, but a zigzag shard is two equal chunks; pad the full "
            "sequence to a multiple of 2 * cp_size before sharding"
        )


def _shape_code(t: torch.Tensor) -> list[int]:
    """A fixed-length description of a tensor: its rank, shape (padded to 4), dtype."""
    shape = list(t.shape)[:4]
    code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1
    return [t.dim(), *shape, *([-1] * (4 - len(shape))), code]


def check_across_ranks(
    group: Optional[dist.ProcessGroup],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: str,
    causal: bool,
    extra: tuple[int, ...] = (),
) -> None:
    """All-gather this rank's signature and raise (on every rank) if any differs.

    Runs before the local checks: once every rank is known to hold the same shapes and
    settings, the local checks (pure functions of those) pass or fail on all ranks alike,
    so no rank is left waiting in a transfer that a failed rank never starts.
    """
    world = dist.get_world_size(group)
    sig = [
        *_shape_code(q), *_shape_code(k), *_shape_code(v),
        _LAYOUT_CODES.get(layout, -1), int(causal), *extra,
    ]
    mine = torch.tensor(sig, dtype=torch.int64, device=q.device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = [t.tolist() for t in gathered]
    if any(row != rows[0] for row in rows):
        names = ("q", "k", "v")
        desc = "; ".join(
            f"rank {r}: "
            + ", ".join(
                f"{n}={tuple(x for x in row[6 * i + 1 : 6 * i + 5] if x >= 0)}/"
                f"{_DTYPES[row[6 * i + 5]] if row[6 * i + 5] >= 0 else '?'}"
                for i, n in enumerate(names)
            )
            + f" layout={layout if row[18] >= 0 else '?'} causal={bool(row[19])}"
            + (f" documents={row[20:]}" if len(row) > 20 else "")
            for r, row in enumerate(rows)
        )
        raise ValueError(
            "ring attention inputs differ across the ranks of the context-parallel group; "
            "every rank must pass the same shapes, dtype and settings (shard the full, "
            f"padded sequence with shard_sequence / RingDataCollator): {desc}"
        )
