"""PyTorch's CPU flash-attention op (``aten::_scaled_dot_product_flash_attention_for_cpu``).

It tiles the computation (no ``q_len x k_len`` matrix is built), returns the log-sum-exp
the ring needs, takes GQA natively, and its backward accepts an externally given ``out``
and ``lse``, which is what lets the ring use the final, merged ones.
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


TORCH_CPU_FLASH = AttentionBackend(
    name="torch_cpu_flash",
    forward=cpu_flash_forward,
    backward=cpu_flash_backward,
    devices=("cpu",),
    dtypes=ALL_FLOATS,
    description="PyTorch's tiled CPU flash-attention op",
)
