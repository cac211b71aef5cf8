"""Masked blocks (a sliding window's edge) on kernels that take a window but no mask.

FlashAttention kernels take a window as two integers: query ``i`` of a ``(q_len, k_len)``
block sees key ``j`` iff ``i + k_len - q_len - left <= j <= i + k_len - q_len + right``
(bottom-right aligned, inclusive). The ring hands a masked kernel a boolean mask instead
(``hf_ring.patterns.ring.window``). Where the layout's positions are evenly spaced (stripe; a
single zigzag chunk) that mask is such a band; where a block's rows or columns span two
zigzag chunks it is two. :func:`bands` cuts a mask into row ranges whose masks are bands,
each trimmed to the columns it sees, and gives each its ``(left, right)``; rows that see
no key are in none (their out is 0, lse -inf, gradients 0). Every piece's left and right
are >= 0 (each piece's first and last rows see a key), so no value means "unbounded".

The cut is computed once per mask tensor and cached for as long as the mask lives (the ring
plan keeps each window mask on the device for the plan's life, and hands the CPU copy it
made it from, so no host sync is needed); it reads each row's first and last visible key
once, O(q_len * k_len) like building the mask itself.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional

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


def bands(mask: torch.Tensor, host_mask: Optional[torch.Tensor] = None) -> list[Band]:
    """The pieces of ``mask`` (bool ``(q_len, k_len)``, True = visible), rows in order.

    ``host_mask``: the same mask on the CPU, when the caller has it: then no device-to-host
    copy (a host sync) is needed. The ring plan passes it when it copies a window mask to
    the GPU, so the kernels' calls find the bands cached.
    """
    key = id(mask)
    if key not in _CACHE:
        _CACHE[key] = _cut((host_mask if host_mask is not None else mask).cpu())
        weakref.finalize(mask, _CACHE.pop, key, None)
    return _CACHE[key]


def _cut(m: torch.Tensor) -> list[Band]:
    """Every row's first and last visible key, read once (O(q_len * k_len)); then each run
    of rows that see a key cut into the fewest bands, each the longest run of rows that
    still is one (fewer rows of a band are a band, so a binary search finds it)."""
    nq, nk = m.shape
    as_bytes = m.contiguous().view(torch.uint8)
    seen = m.any(dim=1)
    first = as_bytes.argmax(dim=1)
    last = nk - 1 - as_bytes.flip(1).argmax(dim=1)
    if not bool((m.sum(dim=1) == last - first + 1)[seen].all()):
        raise ValueError("a masked block whose rows see more than one run of keys is not a sliding window's; "
                         "this kernel takes window masks only")
    pieces: list[Band] = []
    r0 = 0
    while r0 < nq:
        if not seen[r0]:
            r0 += 1
            continue
        end = r0 + 1  # rows r0:end form a band (one row always does); find the largest end
        hi = r0 + 1
        while hi < nq and seen[hi]:
            hi += 1
        while end < hi:
            mid = (end + hi + 1) // 2
            if _band(first, last, r0, mid) is None:
                hi = mid - 1
            else:
                end = mid
        pieces.append(_band(first, last, r0, end))
        r0 = end
    return pieces


def _band(first: torch.Tensor, last: torch.Tensor, r0: int, r1: int) -> Optional[Band]:
    """Rows ``r0:r1`` (each seeing one run of keys, ``first..last``) as one band trimmed
    to the columns they see, or None when they are not one."""
    c0, c1 = int(first[r0:r1].min()), int(last[r0:r1].max()) + 1
    i = torch.arange(r1 - r0)
    f, l = first[r0:r1] - c0, last[r0:r1] - c0
    lo, hi = int((f - i).min()), int((l - i).max())
    nq, nk = r1 - r0, c1 - c0
    if not bool(((f == (i + lo).clamp(min=0)) & (l == (i + hi).clamp(max=nk - 1))).all()):
        return None
    return Band(slice(r0, r1), slice(c0, c1), left=nk - nq - lo, right=hi - (nk - nq))


def window_kwargs(window: Optional[tuple[int, int]]) -> dict[str, int]:
    """``(left, right)`` as the FlashAttention entry points' ``window_size_left/right``
    keywords; None (no window) as no keywords."""
    return {} if window is None else {"window_size_left": window[0], "window_size_right": window[1]}


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
