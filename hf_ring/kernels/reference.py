"""Plain-math attention block: the definition every other backend is checked against.

Materialises the ``(q_len, k_len)`` score matrix, so it is for tests, for float64 and for
short blocks only. GQA is computed by grouping query heads, never by copying K and V.
Takes logit softcapping (``softcap=``), its backward through the tanh included. Fully
masked query rows get ``out = 0`` and ``lse = -inf`` (they contribute nothing when
merged), which flash kernels also do.
"""

from __future__ import annotations

from typing import Optional

import torch

from hf_ring.kernels.base import ALL_FLOATS, AttentionBackend


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scores(
    q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, mask: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Scaled, capped, masked scores ``(batch, n_kv_heads, group, q_len, k_len)`` in
    float32/64 from q ``(batch, q_len, n_heads, head_dim)`` and k ``(batch, k_len,
    n_kv_heads, head_dim)``; ``mask`` bool ``(q_len, k_len)``, True = visible, replaces
    ``causal`` when given. With ``softcap`` the scores are ``softcap * tanh(s / softcap)``
    and the second result is that tanh (same shape, unmasked; the backward's chain rule
    needs ``1 - tanh**2``); without, it is None."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    acc = _accum_dtype(q.dtype)
    qg = q.to(acc).view(b, sq, hk, hq // hk, d)  # (b, sq, hk, g, d)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.to(acc)) * scale
    capped = None
    if softcap is not None:
        capped = torch.tanh(s / softcap)
        s = capped * softcap
    if mask is not None:
        return s.masked_fill(~mask.to(device=q.device, dtype=torch.bool), float("-inf")), capped
    if causal:
        # Top-left aligned: query i sees keys 0..i. The ring only asks for causal blocks
        # with q_len == k_len, where every alignment convention agrees.
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return s, capped


def reference_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
    mask: Optional[torch.Tensor] = None, *, softcap: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block.

    Args:
        q: ``(batch, q_len, n_heads, head_dim)``; k, v: ``(batch, k_len, n_kv_heads,
            head_dim)``; same floating dtype.
        mask: optional bool ``(q_len, k_len)``, True = visible, instead of ``causal``.
        softcap: optional; scores become ``softcap * tanh(scores / softcap)`` (Gemma 2).
    Returns:
        out ``(batch, q_len, n_heads, head_dim)`` in q's dtype, and lse ``(batch, n_heads,
        q_len)`` in float32 (float64 for float64 inputs).
    """
    b, sq, hq, d = q.shape
    s, _ = _scores(q, k, causal, scale, mask, softcap)  # (b, hk, g, sq, sk)
    lse = torch.logsumexp(s, dim=-1)  # (b, hk, g, sq)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # -inf rows give 0
    out = torch.einsum("bhgqk,bkhd->bqhgd", p, v.to(s.dtype)).reshape(b, sq, hq, d)
    return out.to(q.dtype), lse.reshape(b, hq, sq)


def reference_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    mask: Optional[torch.Tensor] = None,
    *,
    softcap: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the *final* ``out`` and ``lse`` of each query row.

    With the final (merged over all blocks) ``out`` and ``lse``, the block's probabilities
    ``exp(s - lse)`` are the true softmax entries, so summing these block gradients over
    all blocks gives the exact gradient of the whole attention.

    Args:
        dout, out: ``(batch, q_len, n_heads, head_dim)``, any floating dtype; q, k, v as in
            :func:`reference_forward`; lse: ``(batch, n_heads, q_len)`` float32 or float64;
            mask and softcap as in :func:`reference_forward`.
    Returns:
        dq, dk, dv in float32 (float64 for float64 inputs), shaped like q, k, v.
    """
    b, sq, hq, d = q.shape
    hk = k.shape[2]
    g = hq // hk
    s, capped = _scores(q, k, causal, scale, mask, softcap)  # (b, hk, g, sq, sk)
    acc = s.dtype
    p = torch.exp(s - lse.to(acc).view(b, hk, g, sq, 1)).nan_to_num(0.0)
    do = dout.to(acc).view(b, sq, hk, g, d)
    o = out.to(acc).view(b, sq, hk, g, d)
    dv = torch.einsum("bhgqk,bqhgd->bkhd", p, do)
    dp = torch.einsum("bqhgd,bkhd->bhgqk", do, v.to(acc))
    delta = (do * o).sum(-1).permute(0, 2, 3, 1).unsqueeze(-1)  # (b, hk, g, sq, 1)
    ds = p * (dp - delta) * scale
    if capped is not None:  # d(c * tanh(x / c)) / dx = 1 - tanh(x / c)**2
        ds = ds * (1 - capped * capped)
    dq = torch.einsum("bhgqk,bkhd->bqhgd", ds, k.to(acc)).reshape(b, sq, hq, d)
    dk = torch.einsum("bhgqk,bqhgd->bkhd", ds, q.to(acc).view(b, sq, hk, g, d))
    return dq, dk, dv


def reference_masked_forward(q, k, v, mask, scale, *, softcap=None):
    """:func:`reference_forward` with a bool ``mask`` ``(q_len, k_len)``, True = visible,
    instead of the causal flag; rows with no visible key give out 0 and lse -inf."""
    return reference_forward(q, k, v, False, scale, mask, softcap=softcap)


def reference_masked_backward(dout, q, k, v, out, lse, mask, scale, *, softcap=None):
    """:func:`reference_backward` with a bool ``mask`` ``(q_len, k_len)`` (see above)."""
    return reference_backward(dout, q, k, v, out, lse, False, scale, mask, softcap=softcap)


REFERENCE = AttentionBackend(
    name="reference",
    forward=reference_forward,
    backward=reference_backward,
    devices=("cpu", "cuda"),
    dtypes=ALL_FLOATS,
    description="plain math; materialises the score matrix (tests, float64, short blocks)",
    masked_forward=reference_masked_forward,
    masked_backward=reference_masked_backward,
    softcap=True,
    slow_on=("cuda",),
    batched_views=True,
)
