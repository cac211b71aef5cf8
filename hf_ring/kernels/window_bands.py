"""Masked blocks (a sliding window's edge) on kernels that take a window but no mask.

FlashAttention kernels take a window as two integers: query ``i`` of a ``(q_len, k_len)``
block sees key ``j`` iff ``i + k_len - q_len - left <= j <= i + k_len - q_len + right``
(bottom-right aligned, inclusive). The ring hands a masked kernel a boolean mask instead
(``hf_ring.ring.window``). Where the layout's positions are evenly spaced (stripe; a
single zigzag chunk) that mask is such a band; where a block's rows or columns span two
zigzag chunks it is two. :func:`bands` cuts a mask into row ranges whose masks are bands,
each trimmed to the columns it sees, and gives each its ``(left, right)``; rows that see
no key are in none (their out is 0, lse -inf, gradients 0). Every piece's left and right
are >= 0 (each piece's first and last rows see a key), so no value means "unbounded".

The cut is computed once per mask tensor (one host sync on the first call) and cached for
as long as the mask lives: the ring plan keeps each window mask on the device for the
plan's life.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Band:
    """Rows ``rows`` against columns ``cols`` of a block, visible exactly within the window
    ``(left, right)`` of that sub-block (the kernel convention above)."""

    rows: slice
    cols: slice
    left: int
    right: int


# id(mask) -> its bands; an entry goes when its mask is freed (tensors compare elementwise,
# so they cannot be dictionary keys themselves).
_CACHE: dict[int, list[Band]] = {}


def bands(mask: torch.Tensor) -> list[Band]:
    """The pieces of ``mask`` (bool ``(q_len, k_len)``, True = visible), rows in order."""
    key = id(mask)
    if key not in _CACHE:
        m = mask.cpu()
        seen = m.any(dim=1).tolist()
        pieces: list[Band] = []
        start = None
        for i, s in enumerate([*seen, False]):  # maximal runs of rows that see a key
            if s and start is None:
                start = i
            elif not s and start is not None:
                _split(m, start, i, pieces)
                start = None
        _CACHE[key] = pieces
        weakref.finalize(mask, _CACHE.pop, key, None)
    return _CACHE[key]


def _band(m: torch.Tensor, r0: int, r1: int) -> "Band | None":
    """Rows ``r0:r1`` (each seeing a key) as one band, trimmed to the columns they see, or
    None when their mask is not one."""
    cols = m[r0:r1].any(dim=0).nonzero().flatten()
    c0, c1 = int(cols[0]), int(cols[-1]) + 1
    sub = m[r0:r1, c0:c1]
    nq, nk = sub.shape
    i, j = sub.nonzero(as_tuple=True)
    lo, hi = int((j - i).min()), int((j - i).max())
    diag = torch.arange(nk)[None, :] - torch.arange(nq)[:, None]  # j - i
    if not torch.equal(sub, (diag >= lo) & (diag <= hi)):
        return None
    return Band(slice(r0, r1), slice(c0, c1), left=nk - nq - lo, right=hi - (nk - nq))


def _split(m: torch.Tensor, r0: int, r1: int, out: list[Band]) -> None:
    """Cut rows ``r0:r1`` into the fewest bands, each the longest run of rows that still
    is one (fewer rows of a band are a band, so a binary search finds it; a single row
    always is one: its visible keys are one contiguous run, positions being sorted)."""
    while r0 < r1:
        lo, hi = r0 + 1, r1  # rows r0:lo form a band; find the largest such end
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _band(m, r0, mid) is None:
                hi = mid - 1
            else:
                lo = mid
        out.append(_band(m, r0, lo))
        r0 = lo


# (q, k, v, left, right, scale) -> (out, lse)
WindowForward = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]
# (dout, q, k, v, out, lse, left, right, scale) -> (dq, dk, dv)
WindowBackward = Callable[..., "tuple[torch.Tensor, torch.Tensor, torch.Tensor]"]


def banded_forward(fwd: WindowForward, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked-kernel forward from a windowed one: q ``(b, sq, hq, d)``, k/v ``(b, sk,
    hk, d)``, mask bool ``(sq, sk)`` -> out like q, lse ``(b, hq, sq)`` float32 (rows that
    see no key: 0 and -inf)."""
    b, sq, hq, _ = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
    for p in bands(mask):
        o, l = fwd(q[:, p.rows], k[:, p.cols], v[:, p.cols], p.left, p.right, scale)
        out[:, p.rows] = o
        lse[:, :, p.rows] = l
    return out, lse


def banded_backward(bwd: WindowBackward, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`banded_forward`'s block given the final out and lse (shapes as
    there); dq, dk, dv in float32, shaped like q, k, v (pieces sharing keys add up)."""
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    for p in bands(mask):
        g = bwd(dout[:, p.rows], q[:, p.rows], k[:, p.cols], v[:, p.cols], out[:, p.rows], lse[:, :, p.rows],
                p.left, p.right, scale)
        dq[:, p.rows] += g[0]
        dk[:, p.cols] += g[1]
        dv[:, p.cols] += g[2]
    return dq, dk, dv
