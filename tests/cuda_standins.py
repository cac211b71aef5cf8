"""CPU stand-ins of the CUDA kernels hf_ring's CUDA backends call, and a switch that routes
those backends to them: for the glue's tests (test_kernels_cuda*.py) and for
``benchmarks/gpu_check.py --dry-run-cpu``, which runs its whole logic through them.

Each stand-in computes with hf_ring's plain-math reference kernel (float64 inputs stay
float64), but takes its arguments and returns its results as the real kernel does:

- PyTorch's ops (``torch_flash``, ``torch_cudnn``): arguments are bound by the installed
  PyTorch's own schema (:func:`bind_schema`), so a renamed, added or reordered parameter
  breaks the tests; results have the shapes, dtypes and devices of the ops' meta
  functions (lse ``(b, h, sq)``, varlen ``(h, total_q)``; cuDNN's lse of the installed
  op's rank, asked of its meta function, or of an older era, :data:`CUDNN_ERAS`; the
  dropout state on the query's device; the output in the query's memory layout). The
  backward stand-ins check what the glue hands back: the lse dense, float32 and of the
  forward's shape, the dropout state of the forward's type, the block lengths as
  ``max_q`` / ``max_k``.
- flash-attn 2 (2.7+), the hopper build (tests/fa3_standin.py, two eras) and flash-attn 4
  (4.0.0b36, tests/fa4_standin.py): functions with the upstream signatures (names, order,
  required arguments, defaults), which the glue binds by name.

Every stand-in checks what the real kernel checks of its tensors (tests/kernel_checks.py):
all on the query's device, K/V, ``out`` and ``dout`` in the query's dtype, the lse
float32. :func:`install` with ``device_type="cuda"`` lets the glue run on fake CUDA
tensors (``FakeTensorMode``), where a tensor made on the CPU is caught. Stand-ins accept
float64, which the tests use to measure the glue's own error.
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
import fa3_standin
import fa4_standin
from kernel_checks import check_devices, check_dtypes, check_lse, is_fake
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
    check_devices("_flash_attention_forward", q, a)
    check_dtypes("_flash_attention_forward", q, {"key": k, "value": v})
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
                                         a["is_causal"], a["scale"], bottom_right=True)
    # The dropout state, as the real forward makes it: on the query's device.
    rng_state = torch.empty(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty((), dtype=torch.uint64, device=q.device)
    return out, lse.float(), rng_state, unused, torch.empty(0, dtype=q.dtype, device=q.device)


def flash_backward(*args, **kwargs):
    a = bind_schema(OPS.flash_bwd, args, kwargs)
    dout, q, k, v, out, lse = (a[n] for n in ("grad_out", "query", "key", "value", "out", "logsumexp"))
    # The dropout state too: the kernel gets its pointer whatever the dropout.
    check_devices("_flash_attention_backward", q, a)
    check_dtypes("_flash_attention_backward", q, {"key": k, "value": v, "out": out, "grad_out": dout})
    assert a["dropout_p"] == 0.0
    rng_state, unused = a["rng_state"], a["unused"]  # the forward's dropout state
    assert rng_state.shape == (2,) and rng_state.dtype == unused.dtype == torch.uint64 and unused.dim() == 0
    if a["cum_seq_q"] is None:
        check_lse("_flash_attention_backward", lse, (q.shape[0], q.shape[2], q.shape[1]))
        assert (a["max_q"], a["max_k"]) == (q.shape[1], k.shape[1])
        mask = fa4_standin.window_mask(q.shape[1], k.shape[1], a["is_causal"], a["window_size_left"],
                                       a["window_size_right"])
        grads = reference_backward(dout, q, k, v, out, lse.to(_acc(q.dtype)), a["is_causal"], a["scale"], mask)
    else:
        check_lse("_flash_attention_backward", lse, (q.shape[1], q.shape[0]))
        assert a["window_size_left"] is None and a["window_size_right"] is None
        grads = looped_varlen_backward(dout, q, k, v, out, lse, a["cum_seq_q"], a["cum_seq_k"], a["max_q"],
                                       a["max_k"], a["is_causal"], a["scale"], bottom_right=True)
    return _like(grads, (q, k, v))


# ---------------------------------------------------- PyTorch's cuDNN op (torch_cudnn)


def _bshd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


# Eras of the cuDNN op's lse: "installed" is whatever this PyTorch's meta function
# returns (``(b, h, sq, 1)`` in 2.13); "3-D" is ``(b, h, sq)``, as PyTorch before 2.9 returned it.
CUDNN_ERAS = ("installed", "3-D")


def cudnn_lse_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, era: str) -> tuple[int, ...]:
    """The lse shape the cuDNN forward returns for q ``(b, h, sq, d)`` and k, v ``(b, h, sk, d)``
    in ``era``: for "installed", asked of the installed op itself, on meta copies of the inputs."""
    if era == "3-D":
        return tuple(q.shape[:3])
    meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in (q, k, v)]
    return tuple(OPS.cudnn_fwd(*meta, None, True, 0.0, False, False, scale=1.0)[1].shape)


def cudnn_ops(era: str = "installed") -> tuple[Callable, Callable]:
    """Stand-ins of the cuDNN forward and backward ops whose lse is of ``era`` (CUDNN_ERAS)."""
    assert era in CUDNN_ERAS

    def forward(*args, **kwargs):
        a = bind_schema(OPS.cudnn_fwd, args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]  # (b, h, s, d)
        check_devices("_scaled_dot_product_cudnn_attention", q, a)
        check_dtypes("_scaled_dot_product_cudnn_attention", q, {"key": k, "value": v})
        assert a["attn_bias"] is None and a["compute_log_sumexp"] and a["dropout_p"] == 0.0
        assert not a["return_debug_mask"] and a["scale"] is not None
        assert q.shape[1] == k.shape[1] == v.shape[1], "the op's dense path takes equal head counts"
        out, lse = reference_forward(_bshd(q), _bshd(k), _bshd(v), a["is_causal"], a["scale"])
        seed, offset = (torch.zeros((), dtype=torch.int64, device=q.device) for _ in range(2))
        lse = lse.float().reshape(cudnn_lse_shape(q, k, v, era))
        # out (b, sq, h, d) contiguous, returned transposed: the query's own memory layout.
        return _bshd(out), lse, None, None, q.shape[2], k.shape[2], seed, offset, None

    def backward(*args, **kwargs):
        a = bind_schema(OPS.cudnn_bwd, args, kwargs)
        what = "_scaled_dot_product_cudnn_attention_backward"
        check_devices(what, a["query"], a)
        check_dtypes(what, a["query"], {n: a[n] for n in ("key", "value", "out", "grad_out")})
        check_lse(what, a["logsumexp"], cudnn_lse_shape(a["query"], a["key"], a["value"], era))
        dout, q, k, v, out = (_bshd(a[n]) for n in ("grad_out", "query", "key", "value", "out"))
        b, sq, h, _ = q.shape
        assert k.shape[2] == h and out.shape == q.shape == dout.shape
        assert a["attn_bias"] is None and a["cum_seq_q"] is None and a["cum_seq_k"] is None
        assert (a["max_q"], a["max_k"]) == (sq, k.shape[1]) and a["dropout_p"] == 0.0
        for t in (a["philox_seed"], a["philox_offset"]):  # the forward's dropout state
            assert t.dtype == torch.int64 and t.dim() == 0
        lse = a["logsumexp"].reshape(b, h, sq).to(_acc(q.dtype))
        grads = reference_backward(dout, q, k, v, out, lse, a["is_causal"], a["scale"])
        return tuple(_bshd(g) for g in _like(grads, (q, k, v)))

    return forward, backward


cudnn_forward, cudnn_backward = cudnn_ops()


# ------------------------------------- PyTorch's memory-efficient op (torch_efficient)


def efficient_forward(query, key, value, bias, cu_q, cu_k, max_q, max_k, dropout_p, custom_mask_type,
                      compute_log_sumexp, *, scale=None):
    check_devices("_efficient_attention_forward", query, {"key": key, "value": value})
    check_dtypes("_efficient_attention_forward", query, {"key": key, "value": value})
    assert query.shape[2] == key.shape[2] == value.shape[2], "the op takes equal head counts"
    assert bias is None and dropout_p == 0.0 and compute_log_sumexp and custom_mask_type in (0, 1)
    out, lse = reference_forward(query, key, value, custom_mask_type == 1, scale)
    pad = -query.shape[1] % 32  # rows padded to a multiple of 32 with +inf
    lse = torch.nn.functional.pad(lse.float(), (0, pad), value=float("inf"))
    # Without dropout the real forward returns its seed and offset as CPU scalars.
    return out, lse, torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64), query.shape[1], \
        key.shape[1]


def efficient_backward(grad_out, query, key, value, bias, out, cu_q, cu_k, max_q, max_k, logsumexp, dropout_p,
                       seed, offset, custom_mask_type, bias_requires_grad, *, scale=None):
    what = "_efficient_attention_backward"
    check_devices(what, query, dict(grad_out=grad_out, key=key, value=value, out=out, logsumexp=logsumexp,
                                    philox_seed=seed, philox_offset=offset),
                  cpu_scalars=("philox_seed", "philox_offset"))
    check_dtypes(what, query, {"key": key, "value": value, "out": out, "grad_out": grad_out})
    assert query.shape[2] == key.shape[2] and out.is_contiguous() and logsumexp.shape[-1] % 32 == 0
    assert max_q == query.shape[1] and max_k == key.shape[1]
    if not is_fake(logsumexp):
        assert torch.isinf(logsumexp[:, :, max_q:]).all()
    lse = logsumexp[:, :, :max_q].to(_acc(query.dtype))
    dq, dk, dv = reference_backward(grad_out, query, key, value, out, lse, custom_mask_type == 1, scale)
    return (*_like((dq, dk, dv), (query, key, value)), None)


# ------------------------------------------------------------------- flash-attn 2.7+


def fa2_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                alibi_slopes, return_softmax):
    check_devices("flash_attn._flash_attn_forward", q, {"k": k, "v": v})
    check_dtypes("flash_attn._flash_attn_forward", q, {"key": k, "value": v})
    assert (window_size_left, window_size_right) == (-1, -1) and dropout_p == 0.0 and softcap >= 0.0
    # flash-attn's convention: softcap 0.0 means none.
    out, lse = reference_forward(q, k, v, causal, softmax_scale, softcap=softcap or None)
    return out, lse.float(), None, None


def _fa2_backward_checks(what: str, dout, q, k, v, out, softmax_lse, dq, dk, dv, lse_shape) -> None:
    """What flash-attn 2's ``mha_bwd`` / ``mha_varlen_bwd`` check of their tensors."""
    check_devices(what, q, dict(dout=dout, k=k, v=v, out=out, softmax_lse=softmax_lse, dq=dq, dk=dk, dv=dv))
    check_dtypes(what, q, {"key": k, "value": v, "out": out, "dout": dout, "dq": dq, "dk": dk, "dv": dv})
    check_lse(what, softmax_lse, lse_shape)


def fa2_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                 window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    _fa2_backward_checks("flash_attn._flash_attn_backward", dout, q, k, v, out, softmax_lse, dq, dk, dv,
                         (q.shape[0], q.shape[2], q.shape[1]))
    assert (window_size_left, window_size_right) == (-1, -1)
    for buf, g in zip((dq, dk, dv), reference_backward(dout, q, k, v, out, softmax_lse.to(_acc(q.dtype)), causal,
                                                      softmax_scale, softcap=softcap or None)):
        buf.copy_(g)
    return None


def fa2_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                       softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                       alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None,
                       zero_tensors=False):
    what = "flash_attn._flash_attn_varlen_forward"
    check_devices(what, q, dict(k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k))
    check_dtypes(what, q, {"key": k, "value": v})
    assert (window_size_left, window_size_right) == (-1, -1) and isinstance(max_seqlen_q, int)
    # flash-attn aligns a causal block of fewer queries than keys to the bottom right (since 2.1).
    out, lse = looped_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     causal, softmax_scale, bottom_right=True)
    return out, lse, None, None


def fa2_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                        window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                        zero_tensors=False):
    what = "flash_attn._flash_attn_varlen_backward"
    _fa2_backward_checks(what, dout, q, k, v, out, softmax_lse, dq, dk, dv, (q.shape[1], q.shape[0]))
    check_devices(what, q, dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k))
    assert (window_size_left, window_size_right) == (-1, -1)
    grads = looped_varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, causal, softmax_scale, bottom_right=True)
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(g)
    return None


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
    "flash_attn_3": (flash_attn3, {"_fa3": lambda: fa3_standin.module("release")}),
    "flash_attn_4": (flash_attn4, {"_fa4": lambda: (fa4_standin, flash_attn4.FA4_MIN),
                                   "gpu_capability": lambda device: (9, 0)}),
}
CUDA_NAMES = tuple(_MODULES)


def cpu_copy(backend: AttentionBackend, keep_dtypes: bool = False) -> AttentionBackend:
    """``backend``'s record for CPU tensors, with nothing to probe; of any float dtype
    (the tests' float64) unless ``keep_dtypes``."""
    return dataclasses.replace(backend, devices=("cpu",), dtypes=backend.dtypes if keep_dtypes else ALL_FLOATS,
                               min_capability=None, probe=None, installed=lambda: True)


def _launch_check(copies: dict[str, AttentionBackend], device_type: str) -> Callable:
    """The per-launch check, for inputs on ``device_type``: on "cpu" the CPU copy's own;
    on "cuda" (fake tensors, no GPU to ask) the device type, then the record's dtype and
    head_dim rules on the CPU copy."""
    def check(backend: AttentionBackend, q: torch.Tensor) -> None:
        if device_type == "cpu":
            return cuda_glue.check_block(copies[backend.name], q)
        if q.device.type != device_type:
            raise ValueError(f"attention backend {backend.name!r} runs on {device_type} here, but the tensors "
                             f"are on {q.device}")
        cuda_glue.check_block(copies[backend.name], SimpleNamespace(device=torch.device("cpu"), dtype=q.dtype,
                                                                    shape=q.shape))
    return check


def install(patch: Patch, names: Optional[tuple[str, ...]] = None, keep_dtypes: bool = False,
            device_type: str = "cpu") -> dict[str, AttentionBackend]:
    """Route the CUDA backends ``names`` (default all) to the stand-ins.

    Patches each backend module's kernel handles, makes its per-launch check accept
    tensors on ``device_type`` ("cpu": real CPU tensors; "cuda": fake CUDA tensors under
    ``FakeTensorMode``, see tests/kernel_checks.py; head_dim and dtype are still checked,
    on the CPU copy of its record), and registers the CPU copies (see :func:`cpu_copy`)
    under the same names and ``"auto"`` priorities. Returns the copies by name.
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
        patch(module, "check_block", _launch_check(copies, device_type))
    patch(registry, "_REGISTERED", table)
    return copies
