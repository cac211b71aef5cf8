"""CPU stand-ins of the CUDA kernels hf_ring's CUDA backends call, and a switch that routes
those backends to them: for the glue's tests (test_kernels_cuda*.py) and for
``benchmarks/gpu_check.py --dry-run-cpu``, which runs its whole logic through them.

Each stand-in computes with hf_ring's plain-math reference kernel (float64 inputs stay
float64), but takes its arguments and returns its results as the real kernel does:

- PyTorch's ops (``torch_flash``, ``torch_cudnn``): arguments are bound by the installed
  PyTorch's own schema (:func:`bind_schema`), so a renamed, added or reordered parameter
  breaks the tests; results have the shapes and dtypes of the ops' meta functions (lse
  ``(b, h, sq)``, varlen ``(h, total_q)``, cuDNN ``(b, h, sq, 1)``; the dropout state the
  forward returns; the output in the query's memory layout). The backward stand-ins
  check what the glue hands back: the lse dense, float32 and of the forward's shape, the
  dropout state of the forward's type, the block lengths as ``max_q`` / ``max_k``.
- flash-attn 2 (2.7+), the hopper build and flash-attn 4 (4.0.0b36): functions with the
  upstream signatures (names, order, defaults), which the glue binds by name.

Stand-ins assert what the real kernels would check (head counts, lse layout, dtypes), but
accept float64, which the tests use to measure the glue's own error.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
from packaging.version import Version

from hf_ring.kernels import registry
from hf_ring.kernels.cuda import flash_attn2, flash_attn3, flash_attn4, torch_cudnn
from hf_ring.kernels.cuda import glue as cuda_glue
from hf_ring.kernels.cuda import torch_efficient, torch_flash
from hf_ring.kernels.base import ALL_FLOATS, AttentionBackend
from hf_ring.kernels.reference import reference_backward, reference_forward
import fa4_standin
from varlen_standin import looped_varlen_backward, looped_varlen_forward

OPS = SimpleNamespace(flash_fwd=torch.ops.aten._flash_attention_forward.default,
                      flash_bwd=torch.ops.aten._flash_attention_backward.default,
                      cudnn_fwd=torch.ops.aten._scaled_dot_product_cudnn_attention.default,
                      cudnn_bwd=torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default)


def bind_schema(op: "torch._ops.OpOverload", args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by parameter name, bound as the installed op's schema binds them
    (positional parameters, then keyword-only ones, defaults filled in); TypeError where the
    real op would refuse the call."""
    params = op._schema.arguments
    positional = [a for a in params if not a.kwarg_only]
    if len(args) > len(positional):
        raise TypeError(f"{op._schema.name} takes {len(positional)} positional arguments, got {len(args)}")
    bound = {a.name: value for a, value in zip(positional, args)}
    names = {a.name for a in params}
    for name, value in kwargs.items():
        if name in bound or name not in names:
            raise TypeError(f"{op._schema.name}: unexpected or repeated argument {name!r}")
        bound[name] = value
    for a in params:
        if a.name not in bound:
            if not a.has_default_value():
                raise TypeError(f"{op._schema.name}: missing argument {a.name!r}")
            bound[a.name] = a.default_value
    return bound


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _like(grads, tensors) -> tuple[torch.Tensor, ...]:
    """Gradients in the dtypes of the tensors they belong to, as the kernels return them."""
    return tuple(g.to(t.dtype) for g, t in zip(grads, tensors))


# ------------------------------------------------------ PyTorch's flash op (torch_flash)


def flash_forward(*args, **kwargs):
    a = bind_schema(OPS.flash_fwd, args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    assert a["dropout_p"] == 0.0 and not a["return_debug_mask"] and a["scale"] is not None
    assert all(a[n] is None for n in ("seqused_k", "alibi_slopes", "block_table"))
    assert q.shape[-2] % k.shape[-2] == 0, "the kernel takes GQA natively"
    if a["cum_seq_q"] is None:
        assert q.dim() == 4 and (a["max_q"], a["max_k"]) == (q.shape[1], k.shape[1])
        mask = fa4_standin.window_mask(q.shape[1], k.shape[1], a["is_causal"], a["window_size_left"],
                                       a["window_size_right"])
        out, lse = reference_forward(q, k, v, a["is_causal"], a["scale"], mask)
    else:
        assert a["window_size_left"] is None and a["window_size_right"] is None
        out, lse = looped_varlen_forward(q, k, v, a["cum_seq_q"], a["cum_seq_k"], a["max_q"], a["max_k"],
                                         a["is_causal"], a["scale"])
    rng_state, unused = torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64)
    return out, lse.float(), rng_state, unused, torch.empty(0, dtype=q.dtype)


def flash_backward(*args, **kwargs):
    a = bind_schema(OPS.flash_bwd, args, kwargs)
    dout, q, k, v, out, lse = (a[n] for n in ("grad_out", "query", "key", "value", "out", "logsumexp"))
    assert a["dropout_p"] == 0.0
    assert lse.dtype == torch.float32 and lse.is_contiguous() and out.dtype == q.dtype
    rng_state, unused = a["rng_state"], a["unused"]  # the forward's dropout state
    assert rng_state.shape == (2,) and rng_state.dtype == unused.dtype == torch.uint64 and unused.dim() == 0
    if a["cum_seq_q"] is None:
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]), "dense lse is (b, h, sq)"
        assert (a["max_q"], a["max_k"]) == (q.shape[1], k.shape[1])
        mask = fa4_standin.window_mask(q.shape[1], k.shape[1], a["is_causal"], a["window_size_left"],
                                       a["window_size_right"])
        grads = reference_backward(dout, q, k, v, out, lse.to(_acc(q.dtype)), a["is_causal"], a["scale"], mask)
    else:
        assert a["window_size_left"] is None and a["window_size_right"] is None
        grads = looped_varlen_backward(dout, q, k, v, out, lse, a["cum_seq_q"], a["cum_seq_k"], a["max_q"],
                                       a["max_k"], a["is_causal"], a["scale"])
    return _like(grads, (q, k, v))


# ---------------------------------------------------- PyTorch's cuDNN op (torch_cudnn)


def _bshd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


def cudnn_forward(*args, **kwargs):
    a = bind_schema(OPS.cudnn_fwd, args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]  # (b, h, s, d)
    assert a["attn_bias"] is None and a["compute_log_sumexp"] and a["dropout_p"] == 0.0
    assert not a["return_debug_mask"] and a["scale"] is not None
    assert q.shape[1] == k.shape[1] == v.shape[1], "the op's dense path takes equal head counts"
    out, lse = reference_forward(_bshd(q), _bshd(k), _bshd(v), a["is_causal"], a["scale"])
    seed, offset = (torch.zeros((), dtype=torch.int64, device=q.device) for _ in range(2))
    # out (b, sq, h, d) contiguous, returned transposed: the query's own memory layout.
    return _bshd(out), lse.float().unsqueeze(-1), None, None, q.shape[2], k.shape[2], seed, offset, None


def cudnn_backward(*args, **kwargs):
    a = bind_schema(OPS.cudnn_bwd, args, kwargs)
    dout, q, k, v, out = (_bshd(a[n]) for n in ("grad_out", "query", "key", "value", "out"))
    lse = a["logsumexp"]
    b, sq, h, _ = q.shape
    assert k.shape[2] == h and out.dtype == q.dtype and out.shape == q.shape == dout.shape
    assert lse.shape == (b, h, sq, 1) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert a["attn_bias"] is None and a["cum_seq_q"] is None and a["cum_seq_k"] is None
    assert (a["max_q"], a["max_k"]) == (sq, k.shape[1]) and a["dropout_p"] == 0.0
    for t in (a["philox_seed"], a["philox_offset"]):  # the forward's dropout state
        assert t.dtype == torch.int64 and t.dim() == 0 and t.device == q.device
    grads = reference_backward(dout, q, k, v, out, lse[..., 0].to(_acc(q.dtype)), a["is_causal"], a["scale"])
    return tuple(_bshd(g) for g in _like(grads, (q, k, v)))


# ------------------------------------- PyTorch's memory-efficient op (torch_efficient)


def efficient_forward(query, key, value, bias, cu_q, cu_k, max_q, max_k, dropout_p, custom_mask_type,
                      compute_log_sumexp, *, scale=None):
    assert query.shape[2] == key.shape[2] == value.shape[2], "the op takes equal head counts"
    assert bias is None and dropout_p == 0.0 and compute_log_sumexp and custom_mask_type in (0, 1)
    out, lse = reference_forward(query, key, value, custom_mask_type == 1, scale)
    pad = -query.shape[1] % 32  # rows padded to a multiple of 32 with +inf
    lse = torch.nn.functional.pad(lse.float(), (0, pad), value=float("inf"))
    return out, lse, torch.empty(()), torch.empty(()), query.shape[1], key.shape[1]


def efficient_backward(grad_out, query, key, value, bias, out, cu_q, cu_k, max_q, max_k, logsumexp, dropout_p,
                       seed, offset, custom_mask_type, bias_requires_grad, *, scale=None):
    assert query.shape[2] == key.shape[2] and out.is_contiguous() and logsumexp.shape[-1] % 32 == 0
    assert torch.isinf(logsumexp[:, :, max_q:]).all() and max_q == query.shape[1] and max_k == key.shape[1]
    lse = logsumexp[:, :, :max_q].to(_acc(query.dtype))
    dq, dk, dv = reference_backward(grad_out, query, key, value, out, lse, custom_mask_type == 1, scale)
    return (*_like((dq, dk, dv), (query, key, value)), None)


# --------------------------------------- flash-attn 2.7+ and the hopper build (FA3)


def fa2_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                alibi_slopes, return_softmax):
    assert (window_size_left, window_size_right) == (-1, -1) and dropout_p == 0.0 and softcap >= 0.0
    # flash-attn's convention: softcap 0.0 means none.
    out, lse = reference_forward(q, k, v, causal, softmax_scale, softcap=softcap or None)
    return out, lse.float(), None, None


def fa2_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                 window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    assert softmax_lse.is_contiguous() and softmax_lse.dtype == torch.float32
    assert (window_size_left, window_size_right) == (-1, -1)
    for buf, g in zip((dq, dk, dv), reference_backward(dout, q, k, v, out, softmax_lse.to(_acc(q.dtype)), causal,
                                                      softmax_scale, softcap=softcap or None)):
        buf.copy_(g)
    return None


def fa2_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                       softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                       alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None):
    assert (window_size_left, window_size_right) == (-1, -1) and isinstance(max_seqlen_q, int)
    out, lse = looped_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     causal, softmax_scale)
    return out, lse, None, None


def fa2_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                        window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                        zero_tensors=False):
    assert softmax_lse.is_contiguous() and (window_size_left, window_size_right) == (-1, -1)
    grads = looped_varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, causal, softmax_scale)
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(g)
    return None


def fa3_forward(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None, softmax_scale=None,
                causal=False, window_size_left=-1, window_size_right=-1, num_splits=1, sm_margin=0):
    mask = fa4_standin.window_mask(q.shape[1], k.shape[1], causal, window_size_left, window_size_right)
    out, lse = reference_forward(q, k, v, causal, softmax_scale, mask)
    return out, lse.float(), torch.empty(0), torch.empty(0)


def fa3_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, dq=None, dk=None, dv=None,
                 softmax_scale=None, is_causal=False, window_size_left=-1, window_size_right=-1,
                 deterministic=False, sm_margin=0):
    mask = fa4_standin.window_mask(q.shape[1], k.shape[1], is_causal, window_size_left, window_size_right)
    for buf, g in zip((dq, dk, dv), reference_backward(dout, q, k, v, out, softmax_lse.to(_acc(q.dtype)),
                                                      is_causal, softmax_scale, mask)):
        buf.copy_(g)
    return torch.empty(0)


# ------------------------------------------------------------------------------ switch

Patch = Callable[[Any, str, Any], None]  # setattr, or pytest's monkeypatch.setattr
_MODULES = {  # backend name -> its module, and that module's names for its kernel(s)
    "torch_flash": (torch_flash, {"_FWD": flash_forward, "_BWD": flash_backward}),
    "torch_cudnn": (torch_cudnn, {"_FWD": cudnn_forward, "_BWD": cudnn_backward}),
    "torch_efficient": (torch_efficient, {"_EFF_FWD": efficient_forward, "_EFF_BWD": efficient_backward}),
    "flash_attn": (flash_attn2, {"_fa2": lambda: (SimpleNamespace(
        _flash_attn_forward=fa2_forward, _flash_attn_backward=fa2_backward,
        _flash_attn_varlen_forward=fa2_varlen_forward, _flash_attn_varlen_backward=fa2_varlen_backward),
        Version("2.8.3"))}),
    "flash_attn_3": (flash_attn3, {"_fa3": lambda: SimpleNamespace(_flash_attn_forward=fa3_forward,
                                                                   _flash_attn_backward=fa3_backward)}),
    "flash_attn_4": (flash_attn4, {"_fa4": lambda: (fa4_standin, flash_attn4.FA4_MIN),
                                   "gpu_capability": lambda device: (9, 0)}),
}
CUDA_NAMES = tuple(_MODULES)


def cpu_copy(backend: AttentionBackend, keep_dtypes: bool = False) -> AttentionBackend:
    """``backend``'s record for CPU tensors, with nothing to probe; of any float dtype
    (the tests' float64) unless ``keep_dtypes``."""
    return dataclasses.replace(backend, devices=("cpu",), dtypes=backend.dtypes if keep_dtypes else ALL_FLOATS,
                               min_capability=None, probe=None, installed=lambda: True)


def install(patch: Patch, names: Optional[tuple[str, ...]] = None,
            keep_dtypes: bool = False) -> dict[str, AttentionBackend]:
    """Route the CUDA backends ``names`` (default all) to the stand-ins on CPU tensors.

    Patches each backend module's kernel handles, makes its per-launch check accept CPU
    tensors (head_dim and dtype are still checked, on the CPU copy of its record), and
    registers the CPU copies (see :func:`cpu_copy`) under the same names and ``"auto"``
    priorities. Returns the copies by name.
    """
    copies: dict[str, AttentionBackend] = {}
    table = dict(registry._REGISTERED)
    for name in names or CUDA_NAMES:
        module, handles = _MODULES[name]
        entry = table[name]
        copies[name] = cpu_copy(entry.backend, keep_dtypes)
        table[name] = entry._replace(backend=copies[name])
        for attr, value in handles.items():
            patch(module, attr, value)
        patch(module, "check_block", lambda backend, q: cuda_glue.check_block(copies[backend.name], q))
    patch(registry, "_REGISTERED", table)
    return copies
