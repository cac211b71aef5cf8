"""flash-attn 3, the hopper build (module ``flash_attn_interface``), dense blocks.

sm90 GPUs only (the build targets sm90a), fp16/bf16, head_dim up to 256. The interface
has no version of its own to check and renamed its arguments across builds (``causal`` ->
``is_causal`` in the backward; ``window_size=(l, r)`` -> two ints), so argument names are
read from the installed functions and bound by :func:`hf_ring.kernels.cuda.glue.bind_kwargs`.
Sliding windows: the kernel's window gives the masked kernel, each window-edge mask cut
into bands (:mod:`hf_ring.kernels.cuda.window_bands`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any, Callable, Optional

import torch

from hf_ring.kernels.base import HALF_FLOATS, AttentionBackend, gpu_capability
from hf_ring.kernels.cuda.glue import (NEUTRAL, bind_kwargs, check_block, grad_buffers, in_q_dtype, params_of,
                                       pick_out_lse)
from hf_ring.kernels.cuda.window_bands import banded_backward, banded_forward, window_kwargs


@functools.lru_cache(maxsize=None)
def _fa3() -> Any:
    """The interface module; ValueError when it cannot be imported."""
    try:
        return importlib.import_module("flash_attn_interface")
    except ImportError as e:
        raise ValueError("backend 'flash_attn_3' needs the flash-attn hopper build (module "
                         f"flash_attn_interface) importable ({e}); pass backend='flash_attn'") from e


def _fa3_call(fn: Callable, what: str, given: dict[str, Any], causal: bool,
              window: Optional[tuple[int, int]] = None) -> Any:
    """Call ``fn`` with the causal flag and window under the names this build uses (no
    window: unbounded)."""
    params = params_of(fn)
    flag = next((n for n in ("is_causal", "causal") if n in params), "causal")
    if window is None:
        win = {n: NEUTRAL[n] for n in ("window_size", "window_size_left", "window_size_right") if n in params}
    else:
        win = {"window_size": tuple(window)} if "window_size" in params else window_kwargs(window)
    return fn(**bind_kwargs(fn, what, {**given, flag: causal, **win}))


def fa3_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, *,
                window: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(b, sq, hq, d)``, k/v ``(b, sk, hk, d)`` fp16/bf16 -> out like q, lse ``(b, hq, sq)`` f32;
    ``window``: the kernel's ``(left, right)`` (see :mod:`hf_ring.kernels.cuda.window_bands`)."""
    check_block(FLASH_ATTN_3, q)
    what = "flash_attn_interface._flash_attn_forward"
    result = _fa3_call(_fa3()._flash_attn_forward, what, dict(q=q, k=k, v=v, softmax_scale=scale), causal, window)
    return pick_out_lse(result, q, what)


def fa3_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float, *,
                 window: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block gradients given the final ``out`` ``(b, sq, hq, d)`` (any float dtype) and
    ``lse`` ``(b, hq, sq)``; dq, dk, dv in the input dtype, shaped like q, k, v; ``window``
    as in :func:`fa3_forward`."""
    check_block(FLASH_ATTN_3, q)
    dq, dk, dv = grad_buffers(q, k, v)
    out, dout = in_q_dtype(q, out, dout)
    # The kernel indexes lse as a dense (b, h, sq) array; the ring passes a column slice.
    given = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse.float().contiguous(),
                 dq=dq, dk=dk, dv=dv, softmax_scale=scale)
    _fa3_call(_fa3()._flash_attn_backward, "flash_attn_interface._flash_attn_backward", given, causal, window)
    return dq, dk, dv


def fa3_masked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fa3_forward` with a bool ``mask`` ``(sq, sk)`` (True = visible, a sliding
    window's edge) instead of ``causal``: rows that see no key give out 0 and lse -inf."""
    return banded_forward(lambda q, k, v, left, right, scale: fa3_forward(q, k, v, False, scale, window=(left, right)),
                          q, k, v, mask, scale)


def fa3_masked_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, mask: torch.Tensor,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`fa3_masked_forward`'s block given the final out and lse; float32."""
    return banded_backward(lambda dout, q, k, v, out, lse, left, right, scale: fa3_backward(
        dout, q, k, v, out, lse, False, scale, window=(left, right)), dout, q, k, v, out, lse, mask, scale)


def _probe(device: torch.device, dtype: torch.dtype) -> None:
    # The hopper build is compiled for sm90a only: Blackwell and later cannot run it.
    major, minor = gpu_capability(device)
    if major != 9:
        raise ValueError(f"backend 'flash_attn_3' (the hopper build) runs on sm90 GPUs only, this one is "
                         f"{major}.{minor}; pass backend='flash_attn_4' or 'torch_cudnn'")
    _fa3()


FLASH_ATTN_3 = AttentionBackend(
    name="flash_attn_3",
    forward=fa3_forward,
    backward=fa3_backward,
    devices=("cuda",),
    dtypes=HALF_FLOATS,
    description="flash-attn 3 hopper build (module flash_attn_interface), sm90",
    installed=lambda: importlib.util.find_spec("flash_attn_interface") is not None,
    install_hint="build flash-attn's hopper/ folder: cd hopper && python setup.py install",
    min_capability=(9, 0),
    max_head_dim=256,
    probe=_probe,
    masked_forward=fa3_masked_forward,
    masked_backward=fa3_masked_backward,
)
