"""CPU stand-ins of flash-attn 4's ``_flash_attn_fwd`` and ``_flash_attn_bwd`` (package
``flash-attn-4`` 4.0.0b36, ``flash_attn/cute/interface.py``), with their signatures:
every parameter, in order, with its default, so that hf_ring's glue, which binds by name
against the installed signature, is tested against the real one's shape. What they
compute: attention with optional logit softcapping, in float64 for float64 inputs.

Checks copied from the real functions' contract (tests/kernel_checks.py): every tensor on
q's device; k, v, and in the backward out and dout, in q's dtype; the backward's lse
float32 ``(b, hq, sq)``; GQA heads divide. Results: the forward returns ``(out,
lse, p, row_max, o_lo)`` (lse only when asked for or when inputs need gradients), the
backward ``(dq, dk, dv)``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from hf_ring.kernels.reference import reference_backward, reference_forward
from kernel_checks import check_devices, check_dtypes, check_lse


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def window_mask(sq: int, sk: int, causal: bool, left: Optional[int], right: Optional[int]) -> Optional[torch.Tensor]:
    """FlashAttention's visibility as a bool ``(sq, sk)`` mask, or None for plain ``causal``:
    query i sees key j iff ``i + sk - sq - left <= j <= i + sk - sq + right`` (bottom-right
    aligned; None or a negative value is unbounded; ``causal`` sets right to 0)."""
    if causal:
        right = 0
    unbounded = [w is None or w < 0 for w in (left, right)]
    if all(unbounded) or (causal and unbounded[0] and sq == sk):
        return None
    diag = torch.arange(sk)[None, :] - torch.arange(sq)[:, None] - (sk - sq)  # j - i - (sk - sq)
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if not unbounded[0]:
        visible &= diag >= -left
    if not unbounded[1]:
        visible &= diag <= right
    return visible


def _capped_scores(q, k, causal, scale, softcap, mask=None):
    """Capped scores ``(b, hq, sq, sk)`` and ``tanh(score / softcap)`` (for the derivative)."""
    g = q.shape[2] // k.shape[2]
    acc = _acc(q.dtype)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), k.to(acc).repeat_interleave(g, dim=2)) * scale
    t = torch.tanh(s / softcap)
    capped = softcap * t
    if mask is None and causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    if mask is not None:
        capped = capped.masked_fill(~mask.to(s.device), float("-inf"))
    return capped, t


def softcap_forward(q, k, v, causal, scale, softcap, mask=None):
    """Attention of one block with capped scores (``mask``, True = visible, replaces
    ``causal``); out like q, lse ``(b, hq, sq)``."""
    if not softcap:
        return reference_forward(q, k, v, causal, scale, mask)
    g = q.shape[2] // k.shape[2]
    capped, _ = _capped_scores(q, k, causal, scale, softcap, mask)
    lse = torch.logsumexp(capped, dim=-1)
    p = torch.exp(capped - lse[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.to(p.dtype).repeat_interleave(g, dim=2))
    return out.to(q.dtype), lse


def softcap_backward(dout, q, k, v, out, lse, causal, scale, softcap, mask=None):
    """dq, dk, dv of :func:`softcap_forward`'s block given the final out and lse."""
    if not softcap:
        return reference_backward(dout, q, k, v, out, lse.to(_acc(q.dtype)), causal, scale, mask)
    b, sk, hk, d = k.shape
    g = q.shape[2] // hk
    capped, t = _capped_scores(q, k, causal, scale, softcap, mask)
    acc = capped.dtype
    p = torch.exp(capped - lse.to(acc)[..., None])
    do = dout.to(acc)
    v_rep, k_rep = (x.to(acc).repeat_interleave(g, dim=2) for x in (v, k))
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, v_rep)
    delta = (do * out.to(acc)).sum(-1).transpose(1, 2)[..., None]  # (b, hq, sq, 1)
    ds = p * (dp - delta) * (1 - t * t) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k_rep)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(acc))
    dk, dv = (x.reshape(b, sk, hk, g, d).sum(3) for x in (dk, dv))
    return dq, dk, dv


def _flash_attn_fwd(
    q: Optional[torch.Tensor], k: Optional[torch.Tensor], v: torch.Tensor, qv=None, cu_seqlens_q=None,
    cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None, min_seqlen_k: Optional[int] = None, page_table=None,
    softmax_scale: Optional[float] = None, causal: bool = False, softcap: Optional[float] = None,
    window_size_left: Optional[int] = None, window_size_right: Optional[int] = None, learnable_sink=None,
    tile_mn=None, mma_pv_is_rs: Optional[bool] = None, intra_wg_overlap: Optional[bool] = None,
    num_threads: int = 384, num_splits: int = 1, pack_gqa: Optional[bool] = None, _arch: Optional[int] = None,
    score_mod: Optional[Callable] = None, mask_mod: Optional[Callable] = None, block_sparse_tensors=None,
    return_lse: bool = False, out=None, lse=None, aux_tensors=None, aux_scalars=None, q_descale=None,
    k_descale=None, v_descale=None, gather_kv_indices=None, scheduler_metadata=None,
    seqlen_k_per_split: Optional[int] = None, disable_scheduler_metadata: bool = False,
    gather_bwd_recompute_p: bool = False,
):
    assert q is not None and k is not None and q.shape[2] % k.shape[2] == 0
    check_devices("_flash_attn_fwd", q, {"k": k, "v": v})
    check_dtypes("_flash_attn_fwd", q, {"key": k, "value": v})
    assert cu_seqlens_q is None and learnable_sink is None and score_mod is None and mask_mod is None
    assert softmax_scale is not None
    mask = window_mask(q.shape[1], k.shape[1], causal, window_size_left, window_size_right)
    o, lse_ = softcap_forward(q, k, v, causal, softmax_scale, softcap or 0.0, mask)
    needs_lse = return_lse or any(t.requires_grad for t in (q, k, v))
    return o, (lse_.float() if needs_lse else None), None, None, None


def _flash_attn_bwd(
    q, k, v, out, dout, lse, softmax_scale: Optional[float] = None, causal: bool = False, softcap: float = 0.0,
    window_size_left: Optional[int] = None, window_size_right: Optional[int] = None, m_block_size: int = 64,
    n_block_size: int = 128, num_threads: int = 256, pack_gqa: bool = False, num_stages_Q: int = 2,
    num_stages_dO: int = 2, SdP_swapAB: bool = False, dKV_swapAB: bool = False, dQ_swapAB: bool = False,
    AtomLayoutMSdP: int = 2, AtomLayoutNdKV: int = 2, AtomLayoutMdQ: int = 2, V_in_regs: bool = False,
    cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None, deterministic: bool = False, dq=None, dk=None, dv=None,
    score_mod: Optional[Callable] = None, score_mod_bwd: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None, aux_tensors=None, aux_scalars=None, block_sparse_tensors=None,
    dlse=None, learnable_sink=None,
):
    b, sq, hq, _ = q.shape
    check_devices("_flash_attn_bwd", q, {"k": k, "v": v, "out": out, "dout": dout, "lse": lse})
    check_dtypes("_flash_attn_bwd", q, {"key": k, "value": v, "out": out, "dout": dout})
    check_lse("_flash_attn_bwd", lse, (b, hq, sq))
    assert learnable_sink is None and softmax_scale is not None and hq % k.shape[2] == 0
    mask = window_mask(sq, k.shape[1], causal, window_size_left, window_size_right)
    grads = softcap_backward(dout, q, k, v, out, lse, causal, softmax_scale, softcap, mask)
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))
