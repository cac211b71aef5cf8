"""CUDA block kernels: flash-attn 2, flash-attn 3 (hopper build) and PyTorch's
memory-efficient attention op (``aten::_efficient_attention_forward/backward``).

The ring needs two things public attention APIs hide: the forward's log-sum-exp, and a
backward that takes an externally merged ``out`` and ``lse``. So every backend here calls
a kernel's internal entry points, whose signatures change between releases. Each call
therefore checks the installed signature (argument names, and the version where one is
published) and raises an error naming what it found instead of passing arguments to the
wrong parameters. Every backend also checks device, dtype, head_dim and GPU generation
before launching anything.

Semantics are those of ``hf_ring.kernels.reference``: tensors ``(batch, seq, heads,
head_dim)``, lse ``(batch, n_heads, q_len)`` float32 in natural-log units, causal blocks
square (so top-left and bottom-right alignment agree), K/V possibly with fewer heads (GQA).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import math
from typing import Any, Callable

import torch
from packaging.version import Version

from hf_ring.kernels.backends import AttentionBackend

_HALF = (torch.float16, torch.bfloat16)

# Values that switch a kernel option off (no dropout, no window, no softcap, no paged or
# rotary or fp8 extras). Only used for parameters the installed signature requires and
# hf_ring does not set itself; any other required parameter is an error.
_NEUTRAL: dict[str, Any] = {
    "dropout_p": 0.0, "softcap": 0.0, "alibi_slopes": None, "return_softmax": False,
    "deterministic": False, "rng_state": None, "window_size": (-1, -1),
    "window_size_left": -1, "window_size_right": -1, "attention_chunk": 0,
    "rotary_interleaved": True, "num_splits": 1, "pack_gqa": None, "sm_margin": 0,
    "gqa_parallel": False, "scheduler_metadata": None,
    **{name: None for name in (
        "k_new", "v_new", "qv", "out", "out_", "cu_seqlens_q", "cu_seqlens_k",
        "cu_seqlens_k_new", "seqused_q", "seqused_k", "sequed_q", "sequed_k",
        "max_seqlen_q", "max_seqlen_k", "page_table", "block_table", "kv_batch_idx", "leftpad_k",
        "rotary_cos", "rotary_sin", "seqlens_rotary", "q_descale", "k_descale",
        "v_descale", "descale_q", "descale_k", "descale_v",
    )},
}


# ---------------------------------------------------------------- shared checks and glue


def _check(name: str, q: torch.Tensor, dtypes: tuple, min_cc: tuple[int, int], max_head_dim: int) -> None:
    """Device, dtype, head_dim and GPU generation, with errors that say what to do."""
    if q.device.type != "cuda":
        raise ValueError(f"attention backend {name!r} runs on CUDA tensors, got {q.device}; pass "
                         "backend='auto' or one of hf_ring.kernels.available_backends(device, dtype)")
    if q.dtype not in dtypes:
        raise ValueError(f"attention backend {name!r} takes {[str(d) for d in dtypes]}, got {q.dtype}; "
                         "cast the model (e.g. torch_dtype=torch.bfloat16) or pass backend='auto'")
    d = q.shape[-1]
    align = 4 if q.dtype == torch.float32 else 8
    if d % align or d > max_head_dim:
        raise ValueError(f"attention backend {name!r} needs head_dim a multiple of {align} and at most "
                         f"{max_head_dim}, got {d}; use backend='reference' for this head size")
    cc = _capability(q.device)
    if q.dtype == torch.bfloat16:
        min_cc = max(min_cc, (8, 0))
    if cc < min_cc:
        raise ValueError(f"attention backend {name!r} needs a GPU of compute capability >= "
                         f"{min_cc[0]}.{min_cc[1]} for {q.dtype}, this one is {cc[0]}.{cc[1]}; "
                         "pass backend='torch_efficient' or backend='auto'")


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)  # read once per function: it is called for every block
def _params(fn: Callable) -> dict[str, bool]:
    """Parameter name -> whether it has a default, for a Python function or a torch op."""
    op = getattr(fn, "_opoverload", None) or (fn if isinstance(fn, torch._ops.OpOverload) else None)
    if op is not None:
        return {a.name: a.has_default_value() for a in op._schema.arguments}
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        raise NotImplementedError(f"cannot read the parameters of {fn!r}; hf_ring needs them to call "
                                  "it safely")
    return {n: p.default is not inspect.Parameter.empty for n, p in params.items()}


def bind_kwargs(fn: Callable, what: str, given: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for ``fn``: ``given`` plus neutral values for other required ones.

    Raises NotImplementedError when ``fn`` lacks a parameter we set or requires one we do
    not know: the installed kernel is a version this code was not written for.
    """
    params = _params(fn)
    missing = [n for n in given if n not in params]
    unknown = [n for n, has_default in params.items()
               if not has_default and n not in given and n not in _NEUTRAL]
    if missing or unknown:
        raise NotImplementedError(
            f"{what} has an unexpected signature (parameters {list(params)}; hf_ring needs "
            f"{missing} and does not know the required {unknown}); install a supported version "
            "(see hf_ring/kernels/cuda.py) or pass backend='torch_efficient'"
        )
    kwargs = {n: _NEUTRAL[n] for n, has_default in params.items() if not has_default and n not in given}
    kwargs.update(given)
    return kwargs


def pick_out_lse(result: Any, q: torch.Tensor, what: str, lse_shape: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` from a flash forward's tuple: out first, lse at index 1 (flash-attn
    >= 2.7, FA3) or 5 (flash-attn 2.6 and early FA3 return ``out, q, k, v, out_padded,
    lse, ...``). Only a float32 tensor of ``lse_shape`` (default ``(batch, n_heads,
    q_len)``) is taken as the lse."""
    if lse_shape is None:
        b, sq, hq, _ = q.shape
        lse_shape = (b, hq, sq)
    lse_shape = tuple(lse_shape)
    if isinstance(result, (tuple, list)) and len(result) >= 2 and result[0].shape == q.shape:
        for i in (1, 5):
            t = result[i] if i < len(result) else None
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == lse_shape:
                return result[0], t
    items = result if isinstance(result, (tuple, list)) else [result]
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in items]
    raise NotImplementedError(f"{what} returned {shapes}; expected out {tuple(q.shape)} and a float32 lse "
                              f"{lse_shape}: this kernel version is not supported")


def _grad_buffers(q, k, v):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), \
        torch.empty(k.shape, dtype=k.dtype, device=k.device), \
        torch.empty(v.shape, dtype=v.dtype, device=v.device)


# ------------------------------------------------------------------------ flash-attn 2.x

FA2_MIN, FA2_SPLIT_WINDOW, FA2_END = Version("2.6.0"), Version("2.7.0"), Version("3")


@functools.lru_cache(maxsize=None)
def _fa2() -> tuple[Any, Version]:
    try:
        version = Version(importlib.metadata.version("flash_attn"))
        module = importlib.import_module("flash_attn.flash_attn_interface")
    except (ImportError, importlib.metadata.PackageNotFoundError) as e:
        raise ValueError(f"backend 'flash_attn' needs flash-attn >= {FA2_MIN} importable ({e}); "
                         "pip install flash-attn --no-build-isolation, or pass backend='torch_efficient'") from e
    if not FA2_MIN <= version < FA2_END:
        raise ValueError(f"backend 'flash_attn' supports flash-attn {FA2_MIN} <= version < {FA2_END}, "
                         f"found {version}; upgrade it or pass backend='torch_efficient'")
    return module, version


def fa2_window(version: Version) -> dict[str, Any]:
    """flash-attn 2.7 split ``window_size=(left, right)`` into two ints; -1 is unbounded."""
    if version >= FA2_SPLIT_WINDOW:
        return {"window_size_left": -1, "window_size_right": -1}
    return {"window_size": (-1, -1)}


def _fa2_call(entry: str, given: dict[str, Any]) -> tuple[Any, str]:
    """Call flash-attn 2's ``entry`` with ``given`` plus the options hf_ring switches off
    (no dropout, softcap, alibi or window), bound by the installed signature."""
    fa, version = _fa2()
    fn, what = getattr(fa, entry), f"flash-attn {version} {entry}"
    given = {**given, "dropout_p": 0.0, "softcap": 0.0, "alibi_slopes": None, **fa2_window(version)}
    return fn(**bind_kwargs(fn, what, given)), what


def fa2_forward(q, k, v, causal: bool, scale: float):
    """q ``(b, sq, hq, d)``, k/v ``(b, sk, hk, d)`` fp16/bf16 -> out like q, lse ``(b, hq, sq)`` f32."""
    _check("flash_attn", q, _HALF, (8, 0), 256)
    given = dict(q=q, k=k, v=v, softmax_scale=scale, causal=causal, return_softmax=False)
    result, what = _fa2_call("_flash_attn_forward", given)
    return pick_out_lse(result, q, what)


def fa2_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """Block gradients given the final ``out`` ``(b, sq, hq, d)`` and ``lse`` ``(b, hq, sq)``;
    dq, dk, dv in the input dtype, shaped like q, k, v."""
    _check("flash_attn", q, _HALF, (8, 0), 256)
    dq, dk, dv = _grad_buffers(q, k, v)
    # The kernel indexes lse as a dense (b, h, sq) array; the ring passes a column slice.
    given = dict(dout=dout, q=q, k=k, v=v, out=out.to(q.dtype), softmax_lse=lse.float().contiguous(),
                 dq=dq, dk=dk, dv=dv, softmax_scale=scale, causal=causal, deterministic=False)
    _fa2_call("_flash_attn_backward", given)
    return dq, dk, dv


def _varlen_args(cu_q, cu_k, max_q: int, max_k: int) -> dict[str, Any]:
    return dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_q), max_seqlen_k=int(max_k))


def fa2_varlen_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    """q ``(total_q, hq, d)``, k/v ``(total_k, hk, d)`` fp16/bf16, cu_q/cu_k int32 ``(n + 1,)``
    -> out like q, lse ``(hq, total_q)`` f32 (flash-attn >= 2.6's unpadded varlen lse; a
    padded ``(n, hq, max_q)`` one, as older releases returned, is refused by the shape check).
    Causal blocks are square, so the kernel's bottom-right alignment is top-left here."""
    _check("flash_attn", q, _HALF, (8, 0), 256)
    given = dict(q=q, k=k, v=v, softmax_scale=scale, causal=causal, return_softmax=False,
                 **_varlen_args(cu_q, cu_k, max_q, max_k))
    result, what = _fa2_call("_flash_attn_varlen_forward", given)
    return pick_out_lse(result, q, what, lse_shape=(q.shape[1], q.shape[0]))


def fa2_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    """Gradients of the blocks of :func:`fa2_varlen_forward` given the final ``out``
    ``(total_q, hq, d)`` and ``lse`` ``(hq, total_q)``; dq, dk, dv shaped and typed like q, k, v."""
    _check("flash_attn", q, _HALF, (8, 0), 256)
    dq, dk, dv = _grad_buffers(q, k, v)
    given = dict(dout=dout.contiguous(), q=q, k=k, v=v, out=out.to(q.dtype).contiguous(),
                 softmax_lse=lse.float().contiguous(), dq=dq, dk=dk, dv=dv, softmax_scale=scale,
                 causal=causal, deterministic=False, **_varlen_args(cu_q, cu_k, max_q, max_k))
    _fa2_call("_flash_attn_varlen_backward", given)
    return dq, dk, dv


# ------------------------------------------------------------- flash-attn 3 (hopper build)


@functools.lru_cache(maxsize=None)
def _fa3() -> Any:
    try:
        return importlib.import_module("flash_attn_interface")
    except ImportError as e:
        raise ValueError("backend 'flash_attn_3' needs the flash-attn hopper build (module "
                         f"flash_attn_interface) importable ({e}); pass backend='flash_attn'") from e


def _fa3_call(fn: Callable, what: str, given: dict[str, Any], causal: bool) -> Any:
    # The hopper interface has no version of its own to check, and renamed its arguments
    # across builds (causal -> is_causal in the backward; window_size=(l, r) -> two ints),
    # so the names are read from the installed function.
    params = _params(fn)
    flag = next((n for n in ("is_causal", "causal") if n in params), "causal")
    window = {n: _NEUTRAL[n] for n in ("window_size", "window_size_left", "window_size_right") if n in params}
    return fn(**bind_kwargs(fn, what, {**given, flag: causal, **window}))


def fa3_forward(q, k, v, causal: bool, scale: float):
    """As :func:`fa2_forward`, on sm90 (Hopper) GPUs."""
    _check("flash_attn_3", q, _HALF, (9, 0), 256)
    what = "flash_attn_interface._flash_attn_forward"
    result = _fa3_call(_fa3()._flash_attn_forward, what, dict(q=q, k=k, v=v, softmax_scale=scale), causal)
    return pick_out_lse(result, q, what)


def fa3_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """As :func:`fa2_backward`, on sm90 (Hopper) GPUs."""
    _check("flash_attn_3", q, _HALF, (9, 0), 256)
    dq, dk, dv = _grad_buffers(q, k, v)
    given = dict(dout=dout, q=q, k=k, v=v, out=out.to(q.dtype), softmax_lse=lse.float().contiguous(),
                 dq=dq, dk=dk, dv=dv, softmax_scale=scale)
    _fa3_call(_fa3()._flash_attn_backward, "flash_attn_interface._flash_attn_backward", given, causal)
    return dq, dk, dv


# ------------------------------------------------- PyTorch memory-efficient attention op

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
        schema = op._schema
        names = tuple(a.name for a in schema.arguments if not a.kwarg_only)[: len(expected)]
        kw = {a.name for a in schema.arguments if a.kwarg_only}
        if names != expected or "scale" not in kw:
            raise NotImplementedError(f"this PyTorch's {schema.name} takes ({', '.join(names)}; "
                                      f"kw {sorted(kw)}), not the ({', '.join(expected)}; kw scale) hf_ring was written for; "
                                      "pass backend='flash_attn' or 'reference'")


def _repeat_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    """``(b, s, hk, d)`` -> ``(b, s, hk * group, d)``: query head h reads KV head h // group."""
    return t if group == 1 else t.repeat_interleave(group, dim=2)


def efficient_forward(q, k, v, causal: bool, scale: float):
    """q ``(b, sq, hq, d)``, k/v ``(b, sk, hk, d)`` f32/f16/bf16 -> out like q, lse ``(b, hq, sq)`` f32."""
    _check("torch_efficient", q, (torch.float32, *_HALF), (5, 0), 512)
    check_efficient_schema()
    group = q.shape[2] // k.shape[2]
    mask = _MASK_CAUSAL_TOP_LEFT if causal else _MASK_NONE
    out, lse = _EFF_FWD(q, _repeat_kv(k, group), _repeat_kv(v, group), None, None, None, None, None,
                        0.0, mask, True, scale=scale)[:2]
    return out, lse[:, :, : q.shape[1]]


def efficient_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """Block gradients given the final ``out`` and ``lse``; dq in q's dtype, dk/dv in float32
    when K/V heads were repeated (summed over each group), else in their dtype."""
    _check("torch_efficient", q, (torch.float32, *_HALF), (5, 0), 512)
    check_efficient_schema()
    b, sq, hq, d = q.shape
    hk, group = k.shape[2], hq // k.shape[2]
    padded = torch.full((b, hq, math.ceil(sq / _LSE_ALIGN) * _LSE_ALIGN), float("inf"),
                        dtype=torch.float32, device=q.device)
    padded[:, :, :sq] = lse
    empty = torch.empty((), dtype=torch.int64)  # philox seed/offset: unused without dropout
    mask = _MASK_CAUSAL_TOP_LEFT if causal else _MASK_NONE
    # The kernel assumes out's row stride is heads * head_dim, hence the contiguous copy.
    dq, dk, dv = _EFF_BWD(dout.contiguous(), q, _repeat_kv(k, group), _repeat_kv(v, group), None,
                          out.to(q.dtype).contiguous(), None, None, sq, k.shape[1], padded, 0.0,
                          empty, empty, mask, False, scale=scale)[:3]
    if group > 1:
        sk = k.shape[1]
        dk = dk.view(b, sk, hk, group, d).sum(3, dtype=torch.float32)
        dv = dv.view(b, sk, hk, group, d).sum(3, dtype=torch.float32)
    return dq, dk, dv


def _probe(name: str, min_cc: tuple[int, int], load: Callable[[], Any]) -> Callable[[torch.device, torch.dtype], None]:
    """What :func:`_check` verifies that is known before any tensor exists: the package
    loads in a supported version and the GPU is recent enough."""

    def probe(device: torch.device, dtype: torch.dtype) -> None:
        load()
        need = max(min_cc, (8, 0)) if dtype == torch.bfloat16 else min_cc
        if device.type == "cuda" and _capability(device) < need:
            cc = _capability(device)
            raise ValueError(f"attention backend {name!r} needs a GPU of compute capability >= "
                             f"{need[0]}.{need[1]} for {dtype}, this one is {cc[0]}.{cc[1]}")

    return probe


def cuda_backends() -> list[AttentionBackend]:
    """The CUDA backends; whether their packages are installed is checked at selection."""
    return [
        AttentionBackend("flash_attn", fa2_forward, fa2_backward, ("cuda",), _HALF,
                         f"flash-attn 2 ({FA2_MIN} <= version < {FA2_END}), sm80+",
                         _probe("flash_attn", (8, 0), _fa2), fa2_varlen_forward, fa2_varlen_backward),
        AttentionBackend("flash_attn_3", fa3_forward, fa3_backward, ("cuda",), _HALF,
                         "flash-attn 3 hopper build (module flash_attn_interface), sm90",
                         _probe("flash_attn_3", (9, 0), _fa3)),
        AttentionBackend("torch_efficient", efficient_forward, efficient_backward, ("cuda",),
                         (torch.float32, *_HALF), "PyTorch's memory-efficient attention op (CUDA)",
                         _probe("torch_efficient", (5, 0), check_efficient_schema)),
    ]
