"""PyTorch's cuDNN attention op on CUDA (``aten::_scaled_dot_product_cudnn_attention`` and
``_backward``): cuDNN 9's fused attention, shipped with every CUDA build of PyTorch.

Called as PyTorch's own context parallelism calls it: the forward with
``compute_log_sumexp=True`` returns the lse, and the backward takes an externally merged
``out`` and ``lse`` (here the ring's final ones). Layout and arguments, as the installed
PyTorch declares them (schema and meta function):

- q, k, v, out, dout are ``(batch, heads, seq, head_dim)``: hf_ring's ``(batch, seq,
  heads, head_dim)`` tensors transposed, a view; the output comes back in the query's
  memory layout, so transposing it back is a view too.
- the lse is float32 ``(batch, heads, q_len, 1)`` in PyTorch 2.9 and later, ``(batch, heads,
  q_len)`` before, in the forward and in the backward alike. The rank is read once from the
  installed op itself (its meta function, on two-row meta tensors: :func:`lse_rank`), not
  from a version number, and every forward's lse is checked against it; hf_ring's
  ``(batch, heads, q_len)`` is a view of either, and one query row keeps its dimension.
- equal head counts only (the op's dense path reads one head count), so GQA blocks
  repeat K/V here, on the received block, and dK/dV are summed back over each group.
- ``philox_seed`` / ``philox_offset`` are the forward's dropout state; with dropout 0 the
  kernel does not read them, so the backward passes int64 scalars on the tensors' device,
  the forward's type (made per call: a cached tensor would outlive a fake mode).
  ``attn_bias`` and ``cum_seq_q/k`` are None (no bias, dense rows), ``max_q`` / ``max_k``
  the block's lengths.

sm80+ (``backend="auto"`` takes it on sm90+ only, where PyTorch 2.5 made it the SDPA default),
fp16/bf16, head_dim a multiple of 8 up to 128, cuDNN >= 9. No softcap and no
sliding-window kernel (refused). The positional order is checked against the installed
PyTorch's schemas before the first call.
"""

from __future__ import annotations

import functools

import torch

from hf_ring.kernels.base import HALF_FLOATS, AttentionBackend
from hf_ring.kernels.cuda.glue import check_block, check_op_schema, in_q_dtype, repeat_kv, sum_kv_groups

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


@functools.lru_cache(maxsize=None)  # one meta call per op: its lse layout does not change
def lse_rank(op: "torch._ops.OpOverload") -> int:
    """3 or 4: the rank of the lse the installed cuDNN forward ``op`` returns, as its meta
    function declares it for a ``(1, 1, 2, 8)`` block (two query rows, so the sequence
    dimension is not mistaken for the trailing unit one)."""
    q = torch.empty(1, 1, 2, 8, device="meta", dtype=torch.float16)
    try:
        lse = op(q, q, q, None, True, 0.0, False, False, scale=1.0)[1]
    except (RuntimeError, NotImplementedError) as e:  # no meta function in this PyTorch
        raise NotImplementedError(f"cannot read this PyTorch's cuDNN attention lse layout from its meta function "
                                  f"({e}); pass {_INSTEAD}") from e
    for rank, shape in ((4, (1, 1, 2, 1)), (3, (1, 1, 2))):
        if tuple(lse.shape) == shape:
            return rank
    raise NotImplementedError(f"this PyTorch's cuDNN attention returns an lse of shape {tuple(lse.shape)} for a "
                              f"(1, 1, 2, 8) block, neither (1, 1, 2, 1) nor (1, 1, 2); pass {_INSTEAD}")


def _no_dropout_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty((), dtype=torch.int64, device=device), torch.empty((), dtype=torch.int64, device=device)


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    """``(b, s, h, d)`` -> the op's ``(b, h, s, d)``, a view."""
    return t.transpose(1, 2)


def _op_lse_shape(q: torch.Tensor) -> tuple[int, ...]:
    """The op's lse shape for q ``(b, sq, hq, d)``: ``(b, hq, sq, 1)`` or ``(b, hq, sq)``."""
    b, sq, hq, _ = q.shape
    return (b, hq, sq, 1) if lse_rank(_FWD) == 4 else (b, hq, sq)


def cudnn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(b, sq, hq, d)``, k/v ``(b, sk, hk, d)`` fp16/bf16 -> out like q, lse ``(b, hq, sq)`` f32."""
    check_block(TORCH_CUDNN, q)
    group = q.shape[2] // k.shape[2]
    out, lse = _FWD(_bhsd(q), _bhsd(repeat_kv(k, group)), _bhsd(repeat_kv(v, group)), None, True, 0.0, causal,
                    False, scale=scale)[:2]
    want = _op_lse_shape(q)
    if tuple(lse.shape) != want:
        raise NotImplementedError(f"this PyTorch's cuDNN attention returned an lse of shape {tuple(lse.shape)}, its "
                                  f"meta function declares {want}; pass {_INSTEAD}")
    b, sq, hq, _ = q.shape
    return _bhsd(out), lse.reshape(b, hq, sq)  # a view of either rank, sq == 1 included


def cudnn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block gradients given the final ``out`` ``(b, sq, hq, d)`` and ``dout`` like it (any float
    dtype) and ``lse`` ``(b, hq, sq)``; dq in q's dtype, dk/dv in float32 when K/V heads
    were repeated (summed over each group), else in their dtype."""
    check_block(TORCH_CUDNN, q)
    hk, group = k.shape[2], q.shape[2] // k.shape[2]
    seed, offset = _no_dropout_state(q.device)
    out, dout = in_q_dtype(q, out, dout)
    # out and dout in q's own layout (the ring's may be row slices of wider tensors), and
    # the lse dense, of the shape the forward returned it in.
    op_lse = lse.float().contiguous().view(_op_lse_shape(q))
    dq, dk, dv = _BWD(_bhsd(dout.contiguous()), _bhsd(q), _bhsd(repeat_kv(k, group)), _bhsd(repeat_kv(v, group)),
                      _bhsd(out.contiguous()), op_lse, seed, offset, None, None, None, q.shape[1], k.shape[1], 0.0,
                      causal, scale=scale)
    return _bhsd(dq), sum_kv_groups(_bhsd(dk), hk), sum_kv_groups(_bhsd(dv), hk)


def _probe(device: torch.device, dtype: torch.dtype) -> None:
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if version is None or version < CUDNN_MIN_VERSION:
        raise ValueError(f"backend 'torch_cudnn' needs cuDNN >= 9 in PyTorch, found {version}; install a CUDA "
                         f"build of PyTorch with cuDNN 9 or pass {_INSTEAD}")
    check_cudnn_schema()
    lse_rank(_FWD)


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
