"""What the CUDA backends share: the per-launch check, and safe calls into kernel internals.

The ring needs two things public attention APIs hide: the forward's log-sum-exp, and a
backward that takes an externally merged ``out`` and ``lse``. So the CUDA backends call
kernels' internal entry points, whose signatures change between releases. Every call
therefore binds its arguments by the installed signature (:func:`bind_kwargs`) and reads
the result by shape (:func:`pick_out_lse`), raising an error naming what it found instead
of passing arguments to the wrong parameters or taking the wrong tensor as the lse. The
PyTorch ops are called positionally, after :func:`check_op_schema` has compared the
installed op's schema with the order the call was written for.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
from typing import Any, Callable, Optional

import torch

from hf_ring.kernels.base import AttentionBackend

# Values that switch a kernel option off (no dropout, no window, no softcap, no paged or
# rotary or fp8 extras). Only used for parameters the installed signature requires and
# hf_ring does not set itself; any other required parameter is an error.
NEUTRAL: dict[str, Any] = {
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


def check_block(backend: AttentionBackend, q: torch.Tensor) -> None:
    """Before a launch: :meth:`AttentionBackend.check` on q's device and dtype, and head_dim.

    Args:
        q: the block's queries, ``(..., head_dim)``; K/V share its device, dtype and head_dim.
    """
    backend.check(q.device, q.dtype)
    d = q.shape[-1]
    # The kernels load head_dim in 16-byte vectors.
    align = 4 if q.dtype == torch.float32 else 8
    limit = backend.max_head_dim
    if d % align or (limit is not None and d > limit):
        raise ValueError(f"attention backend {backend.name!r} needs head_dim a multiple of {align} and at "
                         f"most {limit}, got {d}; use backend='reference' for this head size")


@functools.lru_cache(maxsize=None)  # read once per function: it is called for every block
def params_of(fn: Callable) -> dict[str, bool]:
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
    params = params_of(fn)
    missing = [n for n in given if n not in params]
    unknown = [n for n, has_default in params.items()
               if not has_default and n not in given and n not in NEUTRAL]
    if missing or unknown:
        raise NotImplementedError(
            f"{what} has an unexpected signature (parameters {list(params)}; hf_ring needs "
            f"{missing} and does not know the required {unknown}); install a supported version "
            "(see hf_ring/kernels/cuda/flash_attn2.py and flash_attn3.py) or pass backend='torch_efficient'"
        )
    kwargs = {n: NEUTRAL[n] for n, has_default in params.items() if not has_default and n not in given}
    kwargs.update(given)
    return kwargs


def pick_out_lse(result: Any, q: torch.Tensor, what: str,
                 lse_shape: Optional[tuple[int, ...]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` from a flash forward's return tuple.

    out comes first; lse sits at index 1 (flash-attn >= 2.7, FA3) or 5 (flash-attn 2.6
    and early FA3 return ``out, q, k, v, out_padded, lse, ...``). Only a float32 tensor of
    ``lse_shape`` is taken as the lse.

    Args:
        result: what the kernel returned.
        q: the queries, ``(batch, q_len, n_heads, head_dim)`` or varlen ``(total_q, n_heads,
            head_dim)``; out must have its shape.
        what: the kernel's name, for the error.
        lse_shape: default ``(batch, n_heads, q_len)``; varlen callers pass ``(n_heads, total_q)``.
    Returns:
        out shaped like q, and lse float32 of ``lse_shape``.
    """
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


def in_q_dtype(q: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` (the backward's ``out`` and ``dout``, any float dtype) in q's dtype.

    Every CUDA kernel's backward checks "query and out / dout must have the same dtype";
    the ring hands ``out`` over in the merge's float32, and ``dout`` arrives in whatever
    dtype the loss upstream produced.
    """
    return tuple(t.to(q.dtype) for t in tensors)


def grad_buffers(q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised dq, dk, dv shaped and typed like q, k, v, for kernels that write into
    the gradients they are given."""
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    return dq, dk, dv


def check_op_schema(op: "torch._ops.OpOverload", positional: tuple[str, ...], keywords: tuple[str, ...],
                    instead: str) -> None:
    """Raise NotImplementedError unless the installed PyTorch's ``op`` takes ``positional``
    first, in that order, and has the keyword-only parameters ``keywords``.

    The CUDA backends call PyTorch's internal attention ops positionally; a reordered or
    renamed parameter would otherwise silently bind a value to the wrong one.

    Args:
        op: e.g. ``torch.ops.aten._flash_attention_forward.default``.
        positional: the leading positional parameter names the call passes.
        keywords: keyword-only parameter names the call passes.
        instead: what to use instead, for the error (e.g. ``"backend='torch_efficient'"``).
    """
    schema = op._schema
    names = tuple(a.name for a in schema.arguments if not a.kwarg_only)[: len(positional)]
    kw = {a.name for a in schema.arguments if a.kwarg_only}
    if names != positional or not set(keywords) <= kw:
        raise NotImplementedError(
            f"this PyTorch's {schema.name} takes ({', '.join(names)}; keyword {sorted(kw)}), not the "
            f"({', '.join(positional)}; keyword {list(keywords)}) hf_ring was written for; pass {instead}")


def repeat_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    """``(b, s, hk, d)`` -> ``(b, s, hk * group, d)``: query head h reads KV head h // group.

    For kernels that take equal head counts only; applied to the already-received block,
    never before communication.
    """
    return t if group == 1 else t.repeat_interleave(group, dim=2)


def sum_kv_groups(dt: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """The gradient of :func:`repeat_kv`: ``(b, s, hk * group, d)`` -> ``(b, s, hk, d)``,
    summed over each group in float32 (returned unchanged when there was no repetition)."""
    b, s, h, d = dt.shape
    if h == n_kv_heads:
        return dt
    return dt.reshape(b, s, n_kv_heads, h // n_kv_heads, d).sum(3, dtype=torch.float32)


def distribution_installed(name: str) -> bool:
    """Whether the package distribution ``name`` (as pip names it) is installed; imports nothing.

    By distribution rather than by module: flash-attn 4 installs into the ``flash_attn``
    namespace that flash-attn 2 owns, so a module name alone does not say which is there.
    """
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
