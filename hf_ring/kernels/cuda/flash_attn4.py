"""flash-attn 4, the CuTe DSL FlashAttention for Hopper and Blackwell (PyPI ``flash-attn-4``,
module ``flash_attn.cute``): a pure-Python wheel whose kernels compile at first use.

Written against the interface of flash-attn-4 4.0.0b36 (``flash_attn/cute/interface.py``):
``_flash_attn_fwd(q, k, v, ..., softmax_scale, causal, softcap, window_size_left,
window_size_right, learnable_sink, ..., return_lse) -> (out, lse, ...)`` and
``_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal, softcap, ...) -> (dq, dk,
dv)``; note ``out`` before ``dout`` there, unlike flash-attn 2. Arguments are bound by name
against the installed signature (:func:`hf_ring.kernels.cuda.glue.bind_kwargs`) and the
forward's result is read by shape, so a renamed parameter or reordered result is an error.

What it takes: fp16/bf16; GQA natively; lse ``(b, hq, sq)`` float32, which its backward
checks. Its backward runs on sm90 and newer only (the forward on sm80 too), hence sm90+.
head_dim a multiple of 8, up to 256 on sm90; on sm100/sm110 up to 128, or 256.

Features: logit softcapping (``softcap``: scores become ``softcap * tanh(scores / softcap)``)
in the kernel, forward and backward (not on sm100 with head_dim 256, where its backward
lacks it: refused). Attention sinks need nothing from the kernel: the ring adds the sink
logit to the final lse once (``hf_ring.patterns.ring.merge.apply_sinks``), where passing
them to every block's kernel would count them once per block. Sliding windows: the
kernel's ``window_size_left/right`` give the masked kernel, each window-edge mask cut into
bands (:mod:`hf_ring.kernels.cuda.window_bands`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from typing import Any, Optional

import torch
from packaging.version import Version

from hf_ring.kernels.base import HALF_FLOATS, AttentionBackend, gpu_capability
from hf_ring.kernels.cuda.glue import bind_kwargs, check_block, distribution_installed, in_q_dtype, pick_out_lse
from hf_ring.kernels.cuda.window_bands import banded_backward, banded_forward, window_kwargs

FA4_DIST = "flash-attn-4"
FA4_MIN, FA4_END = Version("4.0.0b36"), Version("5")
_INSTEAD = "backend='flash_attn_3' (Hopper), 'torch_cudnn' or 'torch_flash'"


@functools.lru_cache(maxsize=None)
def _fa4() -> tuple[Any, Version]:
    """The interface module and the installed version; ValueError when unusable."""
    try:
        version = Version(importlib.metadata.version(FA4_DIST))
    except importlib.metadata.PackageNotFoundError as e:
        raise ValueError(f"backend 'flash_attn_4' needs {FA4_DIST} installed (pip install {FA4_DIST}); "
                         f"or pass {_INSTEAD}") from e
    if not FA4_MIN <= version < FA4_END:
        raise ValueError(f"backend 'flash_attn_4' supports {FA4_DIST} {FA4_MIN} <= version < {FA4_END}, found "
                         f"{version}; pip install '{FA4_DIST}>={FA4_MIN}' or pass {_INSTEAD}")
    try:
        module = importlib.import_module("flash_attn.cute.interface")
    except (ImportError, RuntimeError, OSError) as e:  # a missing dependency, or a CUDA toolkit it cannot load
        raise ValueError(f"backend 'flash_attn_4': {FA4_DIST} {version} is installed but flash_attn.cute does "
                         f"not import ({e}); reinstall it or pass {_INSTEAD}") from e
    return module, version


def check_fa4_block(q: torch.Tensor, softcap: Optional[float]) -> None:
    """The generic launch check, then what this kernel adds: head_dim per GPU generation
    and softcap support in its backward."""
    check_block(FLASH_ATTN_4, q)
    d = q.shape[-1]
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive float (leave it out for no capping), got {softcap}")
    if gpu_capability(q.device)[0] in (10, 11):
        if not (d <= 128 or d == 256):
            raise ValueError(f"backend 'flash_attn_4' takes head_dim <= 128 or 256 on this GPU generation, got {d}; "
                             f"pass {_INSTEAD}")
        if d == 256 and softcap:
            raise NotImplementedError("flash-attn 4's backward has no softcap at head_dim 256 on sm100; "
                                      "leave softcap out or use a model with head_dim <= 128")


def _call(entry: str, given: dict[str, Any]) -> Any:
    fa, version = _fa4()
    fn = getattr(fa, entry)
    return fn(**bind_kwargs(fn, f"flash-attn-4 {version} {entry}", given))


def fa4_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, *,
                softcap: Optional[float] = None,
                window: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(b, sq, hq, d)``, k/v ``(b, sk, hk, d)`` fp16/bf16 -> out like q, lse ``(b, hq, sq)`` f32.

    ``softcap``: caps every score at ``softcap * tanh(score / softcap)``; None is off.
    ``window``: the kernel's ``(left, right)`` (see :mod:`hf_ring.kernels.cuda.window_bands`).
    """
    check_fa4_block(q, softcap)
    given = dict(q=q, k=k, v=v, softmax_scale=scale, causal=causal, softcap=float(softcap or 0.0),
                 return_lse=True, **window_kwargs(window))
    return pick_out_lse(_call("_flash_attn_fwd", given), q, "flash_attn.cute.interface._flash_attn_fwd")


def fa4_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float, *, softcap: Optional[float] = None,
                 window: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block gradients given the final ``out`` ``(b, sq, hq, d)`` (any float dtype) and ``lse``
    ``(b, hq, sq)``; dq, dk, dv shaped like q, k, v in the input dtype. ``softcap`` as in
    :func:`fa4_forward`."""
    check_fa4_block(q, softcap)
    # The kernel checks out's dtype against q's and reads lse as a dense (b, hq, sq) array.
    out, dout = in_q_dtype(q, out, dout)
    given = dict(q=q, k=k, v=v, out=out, dout=dout, lse=lse.float().contiguous(),
                 softmax_scale=scale, causal=causal, softcap=float(softcap or 0.0), deterministic=False,
                 **window_kwargs(window))
    dq, dk, dv = _call("_flash_attn_bwd", given)[:3]
    return dq, dk, dv


def fa4_masked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, *,
                       softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fa4_forward` with a bool ``mask`` ``(sq, sk)`` (True = visible, a sliding
    window's edge) instead of ``causal``: rows that see no key give out 0 and lse -inf."""
    return banded_forward(lambda q, k, v, left, right, scale: fa4_forward(
        q, k, v, False, scale, softcap=softcap, window=(left, right)), q, k, v, mask, scale)


def fa4_masked_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, mask: torch.Tensor, scale: float, *,
                        softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`fa4_masked_forward`'s block given the final out and lse; float32."""
    return banded_backward(lambda dout, q, k, v, out, lse, left, right, scale: fa4_backward(
        dout, q, k, v, out, lse, False, scale, softcap=softcap, window=(left, right)),
        dout, q, k, v, out, lse, mask, scale)


# What hf_ring passes each entry point by name (tensors aside): checked against the
# installed signature before the first launch, so a renamed parameter refuses the backend.
_FWD_NAMES = ("q", "k", "v", "softmax_scale", "causal", "softcap", "return_lse", "window_size_left",
              "window_size_right")
_BWD_NAMES = ("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "softcap", "deterministic",
              "window_size_left", "window_size_right")


def _probe(device: torch.device, dtype: torch.dtype) -> None:
    fa, version = _fa4()
    for entry, names in (("_flash_attn_fwd", _FWD_NAMES), ("_flash_attn_bwd", _BWD_NAMES)):
        bind_kwargs(getattr(fa, entry), f"flash-attn-4 {version} {entry}", dict.fromkeys(names))


FLASH_ATTN_4 = AttentionBackend(
    name="flash_attn_4",
    forward=fa4_forward,
    backward=fa4_backward,
    devices=("cuda",),
    dtypes=HALF_FLOATS,
    description=f"flash-attn 4 (CuTe DSL, {FA4_DIST} >= {FA4_MIN}), sm90+; softcap in the kernel",
    installed=lambda: distribution_installed(FA4_DIST),
    install_hint=f"pip install {FA4_DIST}",
    min_capability=(9, 0),
    max_head_dim=256,
    probe=_probe,
    masked_forward=fa4_masked_forward,
    masked_backward=fa4_masked_backward,
    softcap=True,
)
