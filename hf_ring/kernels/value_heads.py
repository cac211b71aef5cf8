"""Value heads of another size than the query/key heads (multi-head latent attention:
DeepSeek-V3, Kimi K2: q/k heads of 192, v heads of 128), on kernels that take one size.

No block kernel here takes ``v`` with another head size than ``q`` and ``k``, so the call
is made on zero-padded heads, which is exact:

- ``v`` narrower than ``q``/``k``: ``v`` is padded with zero columns; the output's extra
  columns are then exactly zero and dropped. In the backward ``out`` and ``dout`` are
  padded alike (zero columns add nothing to ``rowsum(dout * out)``), and dV's extra
  columns are dropped.
- ``v`` wider: ``q`` and ``k`` are padded with zero columns, which leave every score
  ``q . k`` unchanged (the scale is passed explicitly, never read from the head size);
  dQ's and dK's extra columns are dropped.

The padding is made per block, on the kernel's side of the transfer: K and V still travel
in their own shapes. Must not import torch.distributed, transformers, or any other layer
of hf_ring.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from hf_ring.kernels.base import AttentionBackend


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` with zero columns appended to its last dimension up to ``width``."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _forward(fn, qk_dim: int, v_dim: int, q, k, v, *args, **kwargs):
    width = max(qk_dim, v_dim)
    out, lse = fn(_pad(q, width), _pad(k, width), _pad(v, width), *args, **kwargs)
    return out[..., :v_dim], lse


def _backward(fn, qk_dim: int, v_dim: int, dout, q, k, v, out, lse, *args, **kwargs):
    width = max(qk_dim, v_dim)
    dq, dk, dv = fn(_pad(dout, width), _pad(q, width), _pad(k, width), _pad(v, width), _pad(out, width), lse,
                    *args, **kwargs)
    return dq[..., :qk_dim], dk[..., :qk_dim], dv[..., :v_dim]


def with_value_head_dim(backend: AttentionBackend, qk_dim: int, v_dim: int) -> AttentionBackend:
    """``backend`` for calls whose q/k heads have ``qk_dim`` and v heads ``v_dim`` features
    (the record itself when they are equal): every kernel it has, forward, backward,
    varlen and masked, on zero-padded heads, with the same name and capabilities.

    Shapes as in :mod:`hf_ring.kernels.base`, but for v ``(..., v_dim)``, out and dout
    ``(..., v_dim)``, q and k ``(..., qk_dim)``.
    """
    if qk_dim == v_dim:
        return backend
    if max(qk_dim, v_dim) > (backend.max_head_dim or max(qk_dim, v_dim)):
        raise NotImplementedError(
            f"attention backend {backend.name!r} takes heads of at most {backend.max_head_dim}, and q/k heads of "
            f"{qk_dim} with v heads of {v_dim} run padded to {max(qk_dim, v_dim)}; use backend='auto'"
        )
    kernels = {}
    for name in ("forward", "backward", "varlen_forward", "varlen_backward", "masked_forward", "masked_backward"):
        fn = getattr(backend, name)
        if fn is not None:
            kernels[name] = functools.partial(_forward if name.endswith("forward") else _backward, fn, qk_dim, v_dim)
    return dataclasses.replace(backend, **kernels)


__all__ = ["with_value_head_dim"]
