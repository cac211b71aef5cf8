"""flash-attn 2.x (``flash_attn.flash_attn_interface``), dense and variable-length.

Supported: flash-attn 2.6 up to (not including) 3, on sm80+ GPUs, fp16/bf16, head_dim up
to 256. Calls the package's internal ``_flash_attn_*`` entry points (the public ones hide
the lse and cannot take an external one in the backward); their arguments are bound by
the installed signature, which changed at 2.7 (``window_size`` split into two ints).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
from typing import Any, Optional

import torch
from packaging.version import Version

from hf_ring.kernels.base import HALF_FLOATS, AttentionBackend
from hf_ring.kernels.cuda.glue import (bind_kwargs, check_block, distribution_installed, grad_buffers, in_q_dtype,
                                       pick_out_lse)

FA2_MIN, FA2_SPLIT_WINDOW, FA2_END = Version("2.6.0"), Version("2.7.0"), Version("3")


@functools.lru_cache(maxsize=None)
def _fa2() -> tuple[Any, Version]:
    """The interface module and the installed version; ValueError when unusable."""
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
    (no dropout, alibi or window; no softcap unless ``given`` sets one), bound by the
    installed signature."""
    fa, version = _fa2()
    fn, what = getattr(fa, entry), f"flash-attn {version} {entry}"
    given = {"softcap": 0.0, **given, "dropout_p": 0.0, "alibi_slopes": None, **fa2_window(version)}
    return fn(**bind_kwargs(fn, what, given)), what


def fa2_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float, *, softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(b, sq, hq, d)``, k/v ``(b, sk, hk, d)`` fp16/bf16 -> out like q, lse ``(b, hq, sq)`` f32;
    ``softcap``: the kernel's own logit capping (flash-attn >= 2.6)."""
    check_block(FLASH_ATTN, q)
    given = dict(q=q, k=k, v=v, softmax_scale=scale, causal=causal, return_softmax=False,
                 softcap=softcap or 0.0)
    result, what = _fa2_call("_flash_attn_forward", given)
    return pick_out_lse(result, q, what)


def fa2_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float, *,
                 softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block gradients given the final ``out`` ``(b, sq, hq, d)`` (any float dtype) and
    ``lse`` ``(b, hq, sq)``; dq, dk, dv in the input dtype, shaped like q, k, v; ``softcap``
    as in :func:`fa2_forward` (the kernel differentiates through its tanh)."""
    check_block(FLASH_ATTN, q)
    dq, dk, dv = grad_buffers(q, k, v)
    out, dout = in_q_dtype(q, out, dout)
    # The kernel indexes lse as a dense (b, h, sq) array; the ring passes a column slice.
    given = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse.float().contiguous(),
                 dq=dq, dk=dk, dv=dv, softmax_scale=scale, causal=causal, deterministic=False,
                 softcap=softcap or 0.0)
    _fa2_call("_flash_attn_backward", given)
    return dq, dk, dv


def _varlen_args(cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int) -> dict[str, Any]:
    return dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_q), max_seqlen_k=int(max_k))


def fa2_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                       cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(total_q, hq, d)``, k/v ``(total_k, hk, d)`` fp16/bf16, cu_q/cu_k int32 ``(n + 1,)``
    -> out like q, lse ``(hq, total_q)`` f32.

    That lse layout is flash-attn >= 2.6's unpadded one; a padded ``(n, hq, max_q)`` lse, as
    older releases returned, is refused by :func:`pick_out_lse`'s shape check. A causal
    block may have fewer queries than keys (the all-gather's chunk against its document's
    prefix, ``ring/chunk_varlen.py``): the kernel aligns it to the bottom right, as this
    backend declares (``varlen_causal_bottom_right``); square blocks align either way.
    """
    check_block(FLASH_ATTN, q)
    given = dict(q=q, k=k, v=v, softmax_scale=scale, causal=causal, return_softmax=False,
                 **_varlen_args(cu_q, cu_k, max_q, max_k))
    result, what = _fa2_call("_flash_attn_varlen_forward", given)
    return pick_out_lse(result, q, what, lse_shape=(q.shape[1], q.shape[0]))


def fa2_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                        max_q: int, max_k: int, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the blocks of :func:`fa2_varlen_forward` given the final ``out``
    ``(total_q, hq, d)`` and ``lse`` ``(hq, total_q)``; dq, dk, dv shaped and typed like q, k, v."""
    check_block(FLASH_ATTN, q)
    dq, dk, dv = grad_buffers(q, k, v)
    out, dout = in_q_dtype(q, out, dout)
    given = dict(dout=dout.contiguous(), q=q, k=k, v=v, out=out.contiguous(),
                 softmax_lse=lse.float().contiguous(), dq=dq, dk=dk, dv=dv, softmax_scale=scale,
                 causal=causal, deterministic=False, **_varlen_args(cu_q, cu_k, max_q, max_k))
    _fa2_call("_flash_attn_varlen_backward", given)
    return dq, dk, dv


def _probe(device: torch.device, dtype: torch.dtype) -> None:
    _fa2()


FLASH_ATTN = AttentionBackend(
    name="flash_attn",
    forward=fa2_forward,
    backward=fa2_backward,
    devices=("cuda",),
    dtypes=HALF_FLOATS,
    description=f"flash-attn 2 ({FA2_MIN} <= version < {FA2_END}), sm80+",
    installed=lambda: distribution_installed("flash_attn"),
    install_hint="pip install flash-attn --no-build-isolation",
    min_capability=(8, 0),
    max_head_dim=256,
    probe=_probe,
    varlen_forward=fa2_varlen_forward,
    varlen_backward=fa2_varlen_backward,
    varlen_causal_bottom_right=True,  # flash-attn's causal mask is bottom-right aligned since 2.1
    softcap=True,
)
