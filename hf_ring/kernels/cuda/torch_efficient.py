"""PyTorch's memory-efficient attention op on CUDA (``aten::_efficient_attention_forward``
and ``_backward``): the CUDA backend that needs nothing beyond PyTorch.

It returns the lse and its backward takes an external ``out`` and ``lse``, but it is an
internal op: its positional schema is checked against the installed PyTorch before the
first call. It takes equal head counts only, so GQA blocks repeat K/V here, locally.
float32/fp16/bf16, sm50+ (bf16 sm80+), head_dim up to 512.
"""

from __future__ import annotations

import functools
import math

import torch

from hf_ring.kernels.base import HALF_FLOATS, AttentionBackend
from hf_ring.kernels.cuda.glue import check_block, check_op_schema, in_q_dtype, repeat_kv, sum_kv_groups

_EFF_FWD = torch.ops.aten._efficient_attention_forward.default
_EFF_BWD = torch.ops.aten._efficient_attention_backward.default
# Positional parameters in the order they are passed below; checked against the installed
# PyTorch's schema before the first call.
EFF_FWD_ARGS = ("query", "key", "value", "bias", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                "max_seqlen_k", "dropout_p", "custom_mask_type", "compute_log_sumexp")
EFF_BWD_ARGS = ("grad_out_", "query", "key", "value", "bias", "out", "cu_seqlens_q", "cu_seqlens_k",
                "max_seqlen_q", "max_seqlen_k", "logsumexp", "dropout_p", "philox_seed", "philox_offset",
                "custom_mask_type", "bias_requires_grad")
_LSE_ALIGN = 32  # the op's lse rows are padded to a multiple of 32 (with +inf)
_MASK_NONE, _MASK_CAUSAL_TOP_LEFT = 0, 1


@functools.lru_cache(maxsize=None)
def check_efficient_schema() -> None:
    """Raise NotImplementedError unless the installed PyTorch's op schemas take the
    positional arguments in the order the calls below pass them."""
    for op, expected in ((_EFF_FWD, EFF_FWD_ARGS), (_EFF_BWD, EFF_BWD_ARGS)):
        check_op_schema(op, expected, ("scale",), "backend='flash_attn' or 'reference'")


def efficient_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(b, sq, hq, d)``, k/v ``(b, sk, hk, d)`` f32/f16/bf16 -> out like q, lse ``(b, hq, sq)`` f32."""
    check_block(TORCH_EFFICIENT, q)
    group = q.shape[2] // k.shape[2]
    mask = _MASK_CAUSAL_TOP_LEFT if causal else _MASK_NONE
    out, lse = _EFF_FWD(q, repeat_kv(k, group), repeat_kv(v, group), None, None, None, None, None,
                        0.0, mask, True, scale=scale)[:2]
    return out, lse[:, :, : q.shape[1]]


def efficient_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block gradients given the final ``out`` ``(b, sq, hq, d)`` and ``lse`` ``(b, hq, sq)``;
    dq in q's dtype, dk/dv in float32 when K/V heads were repeated (summed over each
    group), else in their dtype."""
    check_block(TORCH_EFFICIENT, q)
    b, sq, hq, _ = q.shape
    hk, group = k.shape[2], hq // k.shape[2]
    padded = torch.full((b, hq, math.ceil(sq / _LSE_ALIGN) * _LSE_ALIGN), float("inf"),
                        dtype=torch.float32, device=q.device)
    padded[:, :, :sq] = lse
    # philox seed/offset: unused without dropout, where the op's own forward returns them as
    # CPU scalars (its backward takes them there: it skips the device check).
    empty = torch.empty((), dtype=torch.int64)
    mask = _MASK_CAUSAL_TOP_LEFT if causal else _MASK_NONE
    out, dout = in_q_dtype(q, out, dout)
    # The kernel assumes out's row stride is heads * head_dim, hence the contiguous copy.
    dq, dk, dv = _EFF_BWD(dout.contiguous(), q, repeat_kv(k, group), repeat_kv(v, group), None,
                          out.contiguous(), None, None, sq, k.shape[1], padded, 0.0,
                          empty, empty, mask, False, scale=scale)[:3]
    return dq, sum_kv_groups(dk, hk), sum_kv_groups(dv, hk)


def _probe(device: torch.device, dtype: torch.dtype) -> None:
    check_efficient_schema()


TORCH_EFFICIENT = AttentionBackend(
    name="torch_efficient",
    forward=efficient_forward,
    backward=efficient_backward,
    devices=("cuda",),
    dtypes=(torch.float32, *HALF_FLOATS),
    description="PyTorch's memory-efficient attention op (CUDA)",
    min_capability=(5, 0),
    max_head_dim=512,
    probe=_probe,
)
