"""Float64 attention written independently of hf_ring: what every kernel and ring test
compares with.

``full_attention`` (the whole sequence, optional documents) is built on PyTorch's SDPA
math; ``block_attention`` (one block, q_len and k_len may differ, any scale) is plain
scores -> mask -> softmax -> weighted sum with gradients from autograd;
``feature_attention`` (the whole sequence with sliding window, softcapping and sinks
written out) likewise. None calls hf_ring; K/V are repeated for GQA only here, in the reference.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def full_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, doc_ids: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(b, s, hq, d)``, k/v ``(b, s, hk, d)`` (any float dtype, computed in float64).

    ``doc_ids`` ``(s,)``: tokens attend only within their own document.
    Returns out ``(b, s, hq, d)`` float64 (differentiable) and lse ``(b, hq, s)`` float64.
    """
    group = q.shape[2] // k.shape[2]
    qt = q.double().transpose(1, 2)
    kt = k.double().repeat_interleave(group, dim=2).transpose(1, 2)
    vt = v.double().repeat_interleave(group, dim=2).transpose(1, 2)
    s = q.shape[1]
    mask = torch.ones(s, s, dtype=torch.bool)
    if causal:
        mask = mask.tril()
    if doc_ids is not None:
        mask = mask & (doc_ids[:, None] == doc_ids[None, :])
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    scores = (qt @ kt.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return out.transpose(1, 2), lse


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention block in float64, differentiable in q, k, v.

    q ``(b, sq, hq, d)``, k/v ``(b, sk, hk, d)`` (any float dtype, computed in float64).
    Causal is top-left aligned: query i sees keys 0..i. Returns out ``(b, sq, hq, d)`` and
    lse ``(b, hq, sq)``, both float64; a query that sees no key (only when ``sk == 0``)
    gets out 0 and lse -inf.
    """
    group = q.shape[2] // k.shape[2]
    qt = q.double().transpose(1, 2)  # (b, hq, sq, d)
    kt = k.double().repeat_interleave(group, dim=2).transpose(1, 2)  # (b, hq, sk, d)
    vt = v.double().repeat_interleave(group, dim=2).transpose(1, 2)
    scores = (qt @ kt.transpose(-1, -2)) * scale  # (b, hq, sq, sk)
    if causal:
        sq, sk = scores.shape[-2:]
        visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = probs @ vt  # (b, hq, sq, d)
    return out.transpose(1, 2), torch.logsumexp(scores, dim=-1)


def block_attention_grads(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (float64, shaped like q, k, v) of ``sum(block_attention(...)[0] * dout)``;
    dout ``(b, sq, hq, d)``."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, _ = block_attention(*leaves, causal, scale)
    return torch.autograd.grad(out, leaves, dout.double())


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
    cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool, scale: float,
) -> dict[str, torch.Tensor]:
    """Independent blocks on concatenated rows, as a varlen kernel computes them.

    q, dout ``(total_q, hq, d)``, k/v ``(total_k, hk, d)``; cu_q/cu_k ``(n + 1,)``: block i
    is queries ``cu_q[i]:cu_q[i+1]`` against keys ``cu_k[i]:cu_k[i+1]``. Returns float64
    ``out`` like q, ``lse`` ``(hq, total_q)``, and ``dq``, ``dk``, ``dv`` like q, k, v.
    """
    like = {"out": q, "dq": q, "dk": k, "dv": v}
    res = {name: torch.zeros(t.shape, dtype=torch.float64) for name, t in like.items()}
    res["lse"] = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
    for qa, qb, ka, kb in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        qs, ks = slice(qa, qb), slice(ka, kb)
        block = (q[None, qs], k[None, ks], v[None, ks])
        out, lse = block_attention(*block, causal, scale)
        res["out"][qs], res["lse"][:, qs] = out[0], lse[0]
        dq, dk, dv = block_attention_grads(dout[None, qs], *block, causal, scale)
        res["dq"][qs], res["dk"][ks], res["dv"][ks] = dq[0], dk[0], dv[0]
    return res



def feature_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *, causal: bool = True,
    scale: Optional[float] = None, window: Optional[int] = None, softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None, block_ids: Optional[torch.Tensor] = None,
) -> dict[str, torch.Tensor]:
    """Float64 attention over the full sequence with every feature written out, and its
    gradients from autograd.

    q, dout ``(b, s, hq, d)``, k/v ``(b, s, hk, d)``; ``window``: key j visible to query i
    iff ``0 <= i - j < window``; ``softcap``: scores -> ``softcap * tanh(scores / softcap)``
    (after the scale, before the mask); ``sinks`` ``(hq,)``: a column of per-head logits
    appended to the scores, dropped after the softmax; ``block_ids`` int ``(b, s)``: -1 or a
    block's id, tokens of one block see each other both ways, as transformers' Gemma 3
    mask (``window AND (causal OR same block)``). Returns float64 ``out``, ``lse``
    ``(b, hq, s)`` (sink included), ``dq``, ``dk``, ``dv`` and, with sinks, ``dsinks``.
    """
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().double().requires_grad_())
    qt, kt, vt = (t.transpose(1, 2) for t in leaves[:3])  # (b, h, s, d)
    group = q.shape[2] // k.shape[2]
    kt, vt = (t.repeat_interleave(group, dim=1) for t in (kt, vt))  # GQA, reference only
    scores = qt @ kt.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    n = q.shape[1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = (i >= j) if causal else torch.ones(n, n, dtype=torch.bool)
    if block_ids is not None:  # (b, 1, n, n): broadcast over heads
        same = (block_ids[:, :, None] == block_ids[:, None, :]) & (block_ids[:, :, None] >= 0)
        visible = (visible | same)[:, None]
    if window is not None:
        visible = visible & (i - j < window)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        b, h = scores.shape[:2]
        scores = torch.cat([scores, leaves[3].view(1, h, 1, 1).expand(b, h, n, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    out = (probs[..., :n] @ vt).transpose(1, 2)
    grads = torch.autograd.grad(out, leaves, dout.double())
    names = ("dq", "dk", "dv", "dsinks")
    return {"out": out.detach(), "lse": torch.logsumexp(scores, -1).detach(), **dict(zip(names, grads))}
