"""PyTorch's CPU flash-attention op (``aten::_scaled_dot_product_flash_attention_for_cpu``).

It tiles the computation (no ``q_len x k_len`` matrix is built), returns the log-sum-exp
the ring needs, takes GQA natively, and its backward accepts an externally given ``out``
and ``lse``, which is what lets the ring use the final, merged ones.

Both also take an ``attn_mask``, which gives the masked kernel (blocks on a sliding
window's edge). The op wants it additive, in the query's dtype (a bool mask is refused),
and gives a query row with no visible key ``out = 0`` but ``lse = 0``, not ``-inf``: such
rows' lse is set to ``-inf`` here, so that merging them changes nothing. In the backward
such a row's probabilities ``exp(-inf - lse)`` are 0 whatever its lse, so its gradients are 0.
"""

from __future__ import annotations

import torch

from hf_ring.kernels.base import ALL_FLOATS, AttentionBackend

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def cpu_flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(b, sq, hq, d)``, k/v ``(b, sk, hk, d)``, one floating dtype -> out ``(b, sq, hq, d)``
    in that dtype, lse ``(b, hq, sq)`` float32 (float64 for float64 inputs)."""
    out, lse = _FWD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale)
    return out.transpose(1, 2), lse


def cpu_flash_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the final ``out`` ``(b, sq, hq, d)`` (any floating dtype)
    and ``lse`` ``(b, hq, sq)`` (float32 or float64); dout ``(b, sq, hq, d)``, q, k, v as in
    :func:`cpu_flash_forward`. Returns dq, dk, dv shaped like q, k, v in the input dtype."""
    # The op wants a float32 lse for reduced-precision inputs and one of the input dtype
    # for float32/float64 inputs.
    lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    dq, dk, dv = _BWD(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        out.to(q.dtype).transpose(1, 2),
        lse.contiguous(),
        0.0,
        causal,
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool ``(q_len, k_len)`` (True = visible) -> 0 / -inf in ``dtype``, as the op takes it."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def cpu_flash_masked_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cpu_flash_forward` with a bool ``mask`` ``(q_len, k_len)``, True = visible,
    instead of the causal flag; rows with no visible key give out 0 and lse -inf."""
    out, lse = _FWD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, False,
                    attn_mask=_additive(mask, q.dtype), scale=scale)  # (b, hq, sq, d), (b, hq, sq)
    lse = lse.masked_fill(~mask.any(dim=1), float("-inf"))  # the op gives such rows lse 0
    return out.transpose(1, 2), lse


def cpu_flash_masked_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cpu_flash_backward` with a bool ``mask`` ``(q_len, k_len)`` instead of the
    causal flag."""
    lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    # A row with no key at all has lse -inf, and the op's exp(-inf - -inf) would be nan; any
    # finite lse gives its masked scores probability 0, hence zero gradients.
    lse = lse.masked_fill(lse == float("-inf"), 0.0)
    dq, dk, dv = _BWD(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.to(q.dtype).transpose(1, 2), lse.contiguous(), 0.0, False,
        attn_mask=_additive(mask, q.dtype), scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


TORCH_CPU_FLASH = AttentionBackend(
    name="torch_cpu_flash",
    forward=cpu_flash_forward,
    backward=cpu_flash_backward,
    devices=("cpu",),
    dtypes=ALL_FLOATS,
    description="PyTorch's tiled CPU flash-attention op",
    masked_forward=cpu_flash_masked_forward,
    masked_backward=cpu_flash_masked_backward,
    batched_views=True,
)
