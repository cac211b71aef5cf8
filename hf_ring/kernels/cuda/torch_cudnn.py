"""PyTorch's cuDNN attention op on CUDA (``aten::_scaled_dot_product_cudnn_attention`` and
``_backward``): cuDNN 9's fused attention, shipped with every CUDA build of PyTorch.

Called as PyTorch's own context parallelism calls it: the forward with
``compute_log_sumexp=True`` returns the lse, and the backward takes an externally merged
``out`` and ``lse`` (here the ring's final ones). Layout and arguments, as the installed
PyTorch declares them (schema and meta function):

- q, k, v, out, dout are ``(batch, heads, seq, head_dim)``: hf_ring's ``(batch, seq,
  heads, head_dim)`` tensors transposed, a view; the output comes back in the query's
  memory layout, so transposing it back is a view too.
- the lse is ``(batch, heads, q_len, 1)`` float32, in the forward and in the backward.
- equal head counts only (the op's dense path reads one head count), so GQA blocks
  repeat K/V here, on the received block, and dK/dV are summed back over each group.
- ``philox_seed`` / ``philox_offset`` are the forward's dropout state; with dropout 0 the
  kernel does not read them, so the backward passes int64 scalars on the tensors' device,
  the forward's type. ``attn_bias`` and ``cum_seq_q/k`` are None (no bias, dense rows),
  ``max_q`` / ``max_k`` the block's lengths.

sm80+ (``backend="auto"`` takes it on sm90+ only, where PyTorch 2.5 made it the SDPA default),
fp16/bf16, head_dim a multiple of 8 up to 128, cuDNN >= 9. No softcap and no
sliding-window kernel (refused). The positional order is checked against the installed
PyTorch's schemas before the first call.
"""

from __future__ import annotations

import functools

import torch

from hf_ring.kernels.base import HALF_FLOATS, AttentionBackend
from hf_ring.kernels.cuda.glue import check_block, check_op_schema, repeat_kv, sum_kv_groups

_FWD = torch.ops.aten._scaled_dot_product_cudnn_attention.default
_BWD = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
CUDNN_FWD_ARGS = ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
                  "return_debug_mask")
CUDNN_BWD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset",
                  "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal")
CUDNN_MIN_VERSION = 90000  # torch.backends.cudnn.version() of cuDNN 9.0.0
_INSTEAD = "backend='torch_flash' or 'torch_efficient'"


@functools.lru_cache(maxsize=None)
def check_cudnn_schema() -> None:
    """Raise NotImplementedError unless this PyTorch's cuDNN attention ops take the
    positional arguments in the order :func:`cudnn_forward` and :func:`cudnn_backward` pass them."""
    check_op_schema(_FWD, CUDNN_FWD_ARGS, ("scale",), _INSTEAD)
    check_op_schema(_BWD, CUDNN_BWD_ARGS, ("scale",), _INSTEAD)


@functools.lru_cache(maxsize=None)  # one pair per device, never written or read by the kernel
def _no_dropout_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros((), dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    """``(b, s, h, d)`` -> the op's ``(b, h, s, d)``, a view."""
    return t.transpose(1, 2)


def cudnn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(b, sq, hq, d)``, k/v ``(b, sk, hk, d)`` fp16/bf16 -> out like q, lse ``(b, hq, sq)`` f32."""
    check_block(TORCH_CUDNN, q)
    group = q.shape[2] // k.shape[2]
    out, lse = _FWD(_bhsd(q), _bhsd(repeat_kv(k, group)), _bhsd(repeat_kv(v, group)), None, True, 0.0, causal,
                    False, scale=scale)[:2]
    return _bhsd(out), lse.squeeze(-1)  # (b, hq, sq, 1) -> (b, hq, sq)


def cudnn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block gradients given the final ``out`` ``(b, sq, hq, d)`` (any float dtype) and ``lse``
    ``(b, hq, sq)``; dq in q's dtype, dk/dv in float32 when K/V heads were repeated (summed
    over each group), else in their dtype."""
    check_block(TORCH_CUDNN, q)
    hk, group = k.shape[2], q.shape[2] // k.shape[2]
    seed, offset = _no_dropout_state(q.device)
    # out and dout in q's own layout (the ring's may be row slices of wider tensors), and
    # the lse dense with the trailing unit dimension the forward returned it with.
    dq, dk, dv = _BWD(_bhsd(dout.contiguous()), _bhsd(q), _bhsd(repeat_kv(k, group)), _bhsd(repeat_kv(v, group)),
                      _bhsd(out.to(q.dtype).contiguous()), lse.float().contiguous().unsqueeze(-1), seed, offset,
                      None, None, None, q.shape[1], k.shape[1], 0.0, causal, scale=scale)
    return _bhsd(dq), sum_kv_groups(_bhsd(dk), hk), sum_kv_groups(_bhsd(dv), hk)


def _probe(device: torch.device, dtype: torch.dtype) -> None:
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if version is None or version < CUDNN_MIN_VERSION:
        raise ValueError(f"backend 'torch_cudnn' needs cuDNN >= 9 in PyTorch, found {version}; install a CUDA "
                         f"build of PyTorch with cuDNN 9 or pass {_INSTEAD}")
    check_cudnn_schema()


TORCH_CUDNN = AttentionBackend(
    name="torch_cudnn",
    forward=cudnn_forward,
    backward=cudnn_backward,
    devices=("cuda",),
    dtypes=HALF_FLOATS,
    description="PyTorch's cuDNN attention op (cuDNN >= 9), sm80+",
    min_capability=(8, 0),
    max_head_dim=128,
    probe=_probe,
)
