"""CPU stand-ins of flash-attn 3's hopper interface (module ``flash_attn_interface``,
``hopper/flash_attn_interface.py``), with the upstream signatures of two eras: every
parameter, in order, which ones are required, and their defaults, so that hf_ring's glue,
which binds by name against the installed signature, is tested against the real shapes.

- ``RELEASE`` (``_flash_attn_forward`` / ``_flash_attn_backward`` as in flash-attn's
  v2.8.3 tag): plain functions; every argument up to ``causal`` required (25 in the
  forward, 17 in the backward), the window as one ``window_size=(left, right)`` tuple,
  ``causal`` in both; the backward returns ``(dq, dk, dv, softmax_d)``.
- ``MAIN`` (the later ``torch.library`` custom ops): every argument after q, k, v
  (forward) or the lse (backward) defaulted, the window as ``window_size_left`` /
  ``window_size_right``, ``is_causal`` in the backward; the backward returns ``softmax_d``.

Both forwards return ``(out, softmax_lse, out_accum, softmax_lse_accum)``. What they
check, as the real ``mha_fwd`` / ``mha_bwd`` do: every tensor on q's device, k, v, out,
dout and the gradient buffers in q's dtype, the lse float32 ``(b, hq, sq)``; the
options hf_ring never sets left at their neutral values. What they compute: hf_ring's
plain-math reference under FlashAttention's window convention (float64 stays float64).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch

from fa4_standin import window_mask
from hf_ring.kernels.reference import reference_backward, reference_forward
from kernel_checks import check_devices, check_dtypes, check_lse

_WHAT = "flash_attn_interface"


def _unused(what: str, extras: dict[str, Any]) -> None:
    """The options hf_ring never sets must arrive at their neutral values."""
    neutral = {"attention_chunk": 0, "softcap": 0.0, "rotary_interleaved": True, "num_splits": 1, "sm_margin": 0,
               "deterministic": False}
    bad = {n: v for n, v in extras.items() if v != neutral.get(n)}
    if bad:
        raise AssertionError(f"{what}: unexpected values {bad}")


def _forward(q, k, v, softmax_scale, causal, left, right, extras) -> tuple:
    what = f"{_WHAT}._flash_attn_forward"
    _unused(what, {n: x for n, x in extras.items() if not isinstance(x, torch.Tensor) and x is not None})
    if any(isinstance(x, torch.Tensor) for x in extras.values()):
        raise AssertionError(f"{what}: hf_ring passes no paged, rotary, fp8 or varlen tensors")
    check_devices(what, q, {"k": k, "v": v})
    check_dtypes(what, q, {"key": k, "value": v})
    assert softmax_scale is not None and q.shape[2] % k.shape[2] == 0 and q.stride(-1) == 1
    mask = window_mask(q.shape[1], k.shape[1], causal, left, right)
    out, lse = reference_forward(q, k, v, causal, softmax_scale, mask)
    empty = torch.empty(0, device=q.device)
    return out, lse.float(), empty, empty


def _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, left, right, extras) -> None:
    what = f"{_WHAT}._flash_attn_backward"
    _unused(what, {n: x for n, x in extras.items() if not isinstance(x, torch.Tensor) and x is not None})
    if any(isinstance(x, torch.Tensor) for x in extras.values()):
        raise AssertionError(f"{what}: hf_ring passes no varlen tensors")
    tensors = dict(dout=dout, k=k, v=v, out=out, softmax_lse=softmax_lse, dq=dq, dk=dk, dv=dv)
    check_devices(what, q, tensors)
    check_dtypes(what, q, {"key": k, "value": v, "out": out, "dout": dout, "dq": dq, "dk": dk, "dv": dv})
    check_lse(what, softmax_lse, (q.shape[0], q.shape[2], q.shape[1]))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    mask = window_mask(q.shape[1], k.shape[1], causal, left, right)
    grads = reference_backward(dout, q, k, v, out, softmax_lse.to(acc), causal, softmax_scale, mask)
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(g)


# Arguments the stand-ins use; every other one goes to the neutral-value checks.
_OWN = {"dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "softmax_scale", "causal", "is_causal",
        "window_size", "window_size_left", "window_size_right"}


def _extras(args: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments other than :data:`_OWN` (``out`` is one of the forward's, unused)."""
    return {n: x for n, x in args.items() if n not in _OWN or (n == "out" and "dout" not in args)}


# ------------------------------------------------ the v2.8.3 release: plain functions


def release_forward(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
                    seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos,
                    rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal,
                    window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                    scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
    extras = _extras(locals())
    left, right = window_size  # a tuple, unpacked as the real function does
    return _forward(q, k, v, softmax_scale, causal, left, right, extras)


def release_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q,
                     max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1), softcap=0.0,
                     deterministic=False, sm_margin=0):
    extras = _extras(locals())
    left, right = window_size
    _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, left, right, extras)
    return dq, dk, dv, torch.empty(0, device=q.device)


# --------------------------------------- later builds: custom ops, every option defaulted


def main_forward(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
                 page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None,
                 seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                 causal=False, window_size_left=-1, window_size_right=-1, attention_chunk=0, softcap=0.0,
                 rotary_interleaved=True, scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
    extras = _extras(locals())
    return _forward(q, k, v, softmax_scale, causal, window_size_left, window_size_right, extras)


def main_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None,
                  sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None,
                  softmax_scale=None, is_causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
                  deterministic=False, sm_margin=0):
    extras = _extras(locals())
    if dq is None or dk is None or dv is None:
        raise AssertionError("hf_ring hands the backward its gradient buffers")
    _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, is_causal, window_size_left,
              window_size_right, extras)
    return torch.empty(0, device=q.device)


def module(era: str = "release") -> Any:
    """A stand-in of the ``flash_attn_interface`` module of one era (``"release"`` or ``"main"``)."""
    fns: dict[str, tuple[Optional[Any], Optional[Any]]] = {"release": (release_forward, release_backward),
                                                           "main": (main_forward, main_backward)}
    fwd, bwd = fns[era]
    return SimpleNamespace(_flash_attn_forward=fwd, _flash_attn_backward=bwd)
