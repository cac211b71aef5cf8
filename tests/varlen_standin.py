"""A CPU stand-in for a variable-length attention kernel: hf_ring's reference block kernel
looped over the ``cu_seqlens`` segments, with the varlen contract of
``hf_ring.kernels.base`` (rows concatenated, lse ``(heads, total_q)`` float32).

Under ``FakeTensorMode`` (the device tests) the boundaries have no values to loop over:
then the results are of the contract's shapes, dtypes and device only."""

from __future__ import annotations

import torch

from hf_ring.kernels.reference import reference_backward, reference_forward
from kernel_checks import is_fake


def counted(calls: dict, kind: str, fn):
    """``fn`` that adds one to ``calls[kind]`` at each call (tests count which kernels ran)."""
    def call(*args, **kwargs):
        calls[kind] += 1
        return fn(*args, **kwargs)
    return call


def _accum(dtype: torch.dtype) -> torch.dtype:
    """The lse's dtype for hf_ring's reference backward (float64 inputs keep float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def segments(cu: torch.Tensor) -> list[tuple[int, int]]:
    assert cu.dtype == torch.int32 and cu.dim() == 1, "varlen kernels take int32 boundaries"
    b = cu.tolist()
    return list(zip(b[:-1], b[1:]))


def _block_mask(q_len: int, k_len: int, causal: bool, bottom_right: bool):
    """``(causal, mask)`` for the reference kernel: a causal block of fewer queries than keys,
    aligned to the bottom right (flash-attn's rule), as a mask; else the flag alone. Without
    ``bottom_right`` such a block is refused: the varlen contract gives it no meaning then."""
    if not causal or q_len == k_len:
        return causal, None
    assert bottom_right and q_len < k_len, "a causal varlen block of unequal lengths needs bottom_right"
    return False, torch.arange(k_len)[None, :] <= torch.arange(q_len)[:, None] + (k_len - q_len)


def looped_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, *, bottom_right: bool = False):
    """q ``(total_q, hq, d)``, k/v ``(total_k, hk, d)`` -> out like q, lse ``(hq, total_q)`` f32.
    ``bottom_right``: causal blocks may have fewer queries than keys (bound with functools.partial)."""
    if is_fake(cu_q):
        return torch.empty_like(q), torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    outs, lses = [], []
    for (qa, qb), (ka, kb) in zip(segments(cu_q), segments(cu_k), strict=True):
        assert qb - qa <= max_q and kb - ka <= max_k
        flag, mask = _block_mask(qb - qa, kb - ka, causal, bottom_right)
        o, l = reference_forward(q[None, qa:qb], k[None, ka:kb], v[None, ka:kb], flag, scale, mask)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=1).float()


def looped_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, *,
                           bottom_right: bool = False):
    """dq, dk, dv shaped like q, k, v, given the final out and lse ``(hq, total_q)``."""
    assert lse.shape == (q.shape[1], q.shape[0])
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if is_fake(cu_q):
        return dq, dk, dv
    for (qa, qb), (ka, kb) in zip(segments(cu_q), segments(cu_k), strict=True):
        flag, mask = _block_mask(qb - qa, kb - ka, causal, bottom_right)
        g = reference_backward(dout[None, qa:qb], q[None, qa:qb], k[None, ka:kb], v[None, ka:kb],
                               out[None, qa:qb], lse[None, :, qa:qb].to(_accum(q.dtype)), flag, scale, mask)
        dq[qa:qb], dk[ka:kb], dv[ka:kb] = (t[0] for t in g)
    return dq, dk, dv
