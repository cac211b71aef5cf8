"""Float64 attention over the full sequence: the reference every ring test compares with.

Built from PyTorch's plain SDPA math on float64 inputs (independent of hf_ring's own
kernels), with K/V repeated for GQA only here, in the reference.
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


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """norm(x - ref) / norm(ref), in float64."""
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()
