"""PyTorch's CUDA flash-attention op (FlashAttention-2 built into PyTorch), dense and varlen.

Nothing to install beyond a CUDA build of PyTorch. Calls ``aten::_flash_attention_forward``
and ``aten::_flash_attention_backward``, the ops under ``_scaled_dot_product_flash_attention``
(PyTorch's own context parallelism calls that wrapper's backward with a merged out and lse;
the ops below it take the same arguments in flash-attn's ``(batch, seq, heads, head_dim)``
layout, so no transposes, plus ``cum_seq_q/k`` for many blocks in one launch). The forward
returns the lse; the backward takes any ``out`` and ``lse``, here the ring's final ones.

- GQA natively (the kernel reads query head h from KV head h // group); causal blocks are
  square, where the kernel's bottom-right alignment is top-left, except the all-gather's
  packed chunks (fewer queries than keys, ``varlen_causal_bottom_right``): PyTorch's own
  ``torch/nn/attention/bias.py`` (2.13) calls the same kernel with ``is_causal=True`` for
  its lower-right causal bias, and its varlen module writes causal as the window ``(-1, 0)``,
  flash-attn's bottom-right rule. ``benchmarks/gpu_check.py`` checks it on a GPU.
- ``rng_state`` / ``unused`` are the forward's dropout seed and offset; with dropout 0
  the kernel never reads them, so the backward passes tensors of the forward's shape,
  dtype and device (as the op's meta function declares them: on the query's device)
  without a value.
- sliding windows: the op's ``window_size_left/right`` give the masked kernel, each
  window-edge mask cut into bands (:mod:`hf_ring.kernels.cuda.window_bands`).
- sm80+, fp16/bf16, head_dim a multiple of 8 up to 256. No softcap (the op fixes it at
  0): refused.

The positional order is checked against the installed PyTorch's schemas before the first
call (:func:`check_flash_schema`).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from hf_ring.kernels.base import HALF_FLOATS, AttentionBackend
from hf_ring.kernels.cuda.glue import check_block, check_op_schema, in_q_dtype
from hf_ring.kernels.cuda.window_bands import banded_backward, banded_forward, window_kwargs

_FWD = torch.ops.aten._flash_attention_forward.default
_BWD = torch.ops.aten._flash_attention_backward.default
FLASH_FWD_ARGS = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                  "is_causal", "return_debug_mask")
FLASH_BWD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
                  "max_q", "max_k", "dropout_p", "is_causal", "rng_state", "unused")
_INSTEAD = "backend='torch_efficient' or 'flash_attn'"


@functools.lru_cache(maxsize=None)
def check_flash_schema() -> None:
    """Raise NotImplementedError unless this PyTorch's flash ops take the positional
    arguments in the order :func:`flash_forward` and :func:`flash_backward` pass them."""
    keywords = ("scale", "window_size_left", "window_size_right")
    check_op_schema(_FWD, FLASH_FWD_ARGS, keywords, _INSTEAD)
    check_op_schema(_BWD, FLASH_BWD_ARGS, keywords, _INSTEAD)


def _no_dropout_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """rng_state ``(2,)`` and offset ``()`` uint64 on ``device``: the forward's shapes, dtype and
    device (its meta function's). The kernel gets their pointer whatever the dropout, so they
    must be device memory; at dropout 0 it never reads them. Made per call (two tiny
    allocations, no copy): a cached tensor would outlive a fake mode or a CUDA graph capture."""
    return torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: Optional[torch.Tensor],
             cu_k: Optional[torch.Tensor], max_q: int, max_k: int, causal: bool, scale: float,
             window: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    check_block(TORCH_FLASH, q)
    out, lse = _FWD(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, **window_kwargs(window))[:2]
    return out, lse


def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, cu_q: Optional[torch.Tensor], cu_k: Optional[torch.Tensor], max_q: int,
              max_k: int, causal: bool, scale: float,
              window: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_block(TORCH_FLASH, q)
    rng_state, unused = _no_dropout_rng(q.device)
    out, dout = in_q_dtype(q, out, dout)
    # The kernel indexes lse as a dense array; the ring passes a column slice of a wider one.
    dq, dk, dv = _BWD(dout, q, k, v, out, lse.float().contiguous(), cu_q, cu_k, max_q, max_k,
                      0.0, causal, rng_state, unused, scale=scale, **window_kwargs(window))
    return dq, dk, dv


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(b, sq, hq, d)``, k/v ``(b, sk, hk, d)`` fp16/bf16 -> out like q, lse ``(b, hq, sq)`` f32."""
    return _forward(q, k, v, None, None, q.shape[1], k.shape[1], causal, scale)


def flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block gradients given the final ``out`` ``(b, sq, hq, d)`` (any float dtype) and
    ``lse`` ``(b, hq, sq)``; dq, dk, dv shaped like q, k, v in the input dtype."""
    return _backward(dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], causal, scale)


def flash_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                         cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(total_q, hq, d)``, k/v ``(total_k, hk, d)`` fp16/bf16, cu_q/cu_k int32 ``(n + 1,)``
    -> out like q, lse ``(hq, total_q)`` f32 (the op's varlen lse layout)."""
    return _forward(q, k, v, cu_q, cu_k, int(max_q), int(max_k), causal, scale)


def flash_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                          max_q: int, max_k: int, causal: bool,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`flash_varlen_forward`'s blocks given the final ``out``
    ``(total_q, hq, d)`` and ``lse`` ``(hq, total_q)``; dq, dk, dv shaped like q, k, v."""
    return _backward(dout, q, k, v, out, lse, cu_q, cu_k, int(max_q), int(max_k), causal, scale)


def flash_masked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flash_forward` with a bool ``mask`` ``(sq, sk)`` (True = visible, a sliding
    window's edge) instead of ``causal``: rows that see no key give out 0 and lse -inf."""
    return banded_forward(lambda q, k, v, left, right, scale: _forward(
        q, k, v, None, None, q.shape[1], k.shape[1], False, scale, (left, right)), q, k, v, mask, scale)


def flash_masked_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, mask: torch.Tensor,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`flash_masked_forward`'s block given the final out and lse;
    float32, shaped like q, k, v."""
    return banded_backward(lambda dout, q, k, v, out, lse, left, right, scale: _backward(
        dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], False, scale, (left, right)),
        dout, q, k, v, out, lse, mask, scale)


def _probe(device: torch.device, dtype: torch.dtype) -> None:
    if not torch.backends.cuda.is_flash_attention_available():
        raise ValueError("backend 'torch_flash' needs a PyTorch built with flash attention (this one is "
                         f"{torch.__version__}); install a CUDA build of PyTorch or pass {_INSTEAD}")
    check_flash_schema()


TORCH_FLASH = AttentionBackend(
    name="torch_flash",
    forward=flash_forward,
    backward=flash_backward,
    devices=("cuda",),
    dtypes=HALF_FLOATS,
    description="PyTorch's CUDA flash-attention op (FlashAttention-2 inside), sm80+",
    min_capability=(8, 0),
    max_head_dim=256,
    probe=_probe,
    varlen_forward=flash_varlen_forward,
    varlen_backward=flash_varlen_backward,
    varlen_causal_bottom_right=True,  # FlashAttention-2 inside: bottom-right since 2.1 (module docstring)
    masked_forward=flash_masked_forward,
    masked_backward=flash_masked_backward,
)
