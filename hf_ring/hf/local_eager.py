"""Local attention with attention sinks or logit softcapping, for ``ring_flash`` without
context parallelism.

Why it exists: without CP ``ring_flash`` delegates to transformers' SDPA attention, and
SDPA has neither sinks (GPT-OSS's ``s_aux``: one extra logit per query head in every
row's softmax, whose value is zero) nor logit softcapping (Gemma 2's
``attn_logit_softcapping``); transformers itself runs such models eagerly. So here the
same computation is written out, exactly as an eager implementation does: scores,
softcapping, the model's 4-D mask (causal, window, padding), a sink column, softmax, the
sink column dropped, the weighted sum of V. It materialises the ``(q_len, k_len)``
scores, like eager attention.
"""

from __future__ import annotations

from typing import Optional

import torch


def eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: float,
    causal: bool,
    sinks: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Attention with a sink logit per head and / or softcapped scores.

    Args:
        query: ``(batch, n_heads, q_len, head_dim)``; key ``(batch, n_kv_heads, k_len,
            head_dim)``, value ``(batch, n_kv_heads, k_len, value_head_dim)``; one float dtype.
        attention_mask: transformers' 4-D SDPA mask ``(batch or 1, 1, q_len, k_len)``, bool
            (True: attend) or additive float, or None (then causal, aligned bottom-right
            when ``k_len > q_len``, or nothing when not ``causal``).
        scaling: softmax scale.
        causal: whether a missing mask means causal.
        sinks: ``(n_heads,)`` float, differentiable, or None.
        softcap: scores become ``softcap * tanh(scores / softcap)`` before the mask, or None.

    Returns:
        ``(batch, q_len, n_heads, value_head_dim)`` in the query's dtype.
    """
    b, hq, sq, d = query.shape
    hk, sk = key.shape[1], key.shape[2]
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    qg = query.to(acc).view(b, hk, hq // hk, sq, d)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qg, key.to(acc)).reshape(b, hq, sq, sk) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask.to(acc)
    elif causal:
        visible = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril(sk - sq)
        scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink_column = sinks.to(acc).view(1, hq, 1, 1).expand(b, hq, sq, 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("bhgqk,bhkd->bqhgd", probs.view(b, hk, hq // hk, sq, sk), value.to(acc))
    return out.reshape(b, sq, hq, value.shape[-1]).to(query.dtype)  # V heads may be narrower (MLA)
