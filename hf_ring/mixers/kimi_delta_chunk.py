"""Kimi delta attention (KDA) on one run of consecutive tokens, chunked, heads first.

KDA (Kimi Linear's linear attention) is the gated delta rule with a decay per key channel
instead of one per head. Per head, with the state ``S`` of shape ``(dk, dv)``, token ``t``
does

    S_t = A_t S_{t-1} + beta_t k_t v_t^T,   A_t = (I - beta_t k_t k_t^T) diag(exp g_t)
    o_t = S_t^T q_t                         (q_t already scaled by dk ** -0.5)

(transformers' ``chunk_kimi_delta_attention``, flash-linear-attention's ``chunk_kda``).
Inside a chunk of ``C`` tokens entering with ``S_0``, write ``gam_t`` for the cumulative
log decay from the chunk's start (token included; a ``dk`` vector) and
``L(a, k)_ij = sum_c a_ic k_jc exp(gam_ic - gam_jc)`` for ``j <= i`` (zero above). The
new values ``u_i`` (what token ``i`` writes) solve the unit lower-triangular system

    T U = V beta - (K beta exp(gam)) S_0,   T = I + strictly_lower(L(K beta, K))

so ``U = U0 - W S_0`` with ``U0 = T^-1 V beta``, ``W = T^-1 K beta exp(gam)``, and

    O   = (Q exp(gam)) S_0 + L(Q, K) U
    S_C = diag(exp gam_C) S_0 + (K exp(gam_C - gam))^T U.

These are ``delta_rule_chunk``'s terms with the decays moved inside the products, its
chunk decay a ``(dk, 1)`` column instead of a scalar: :func:`chunk_terms` builds a
``delta_rule_chunk.ChunkTerms`` and ``delta_rule_chunk.scan`` runs KDA as it is.

``exp(gam_i - gam_j)`` per channel does not factor safely as ``exp(gam_i) exp(-gam_j)``:
``exp(-gam_j)`` overflows float32 within a few strongly decaying tokens (Kimi's gates
reach ``g = -16`` per token). So ``L`` is built in blocks of 8 tokens (as
flash-linear-attention does in sub-chunks of 16): a block's products with the tokens
before it factor through the decay at the block's start (both factors at most 1, one
matrix product), products within a block are taken pair by pair (``8 x 8 x dk``).

For context parallelism, :func:`widened_scan` runs the scan on the widened state
``[S | P]`` (``dv + dk`` columns) entering ``[0 | I]`` with values ``[V | 0]``, under
autograd: it gives in one pass the outputs from a zero state ``O0``, the queries seen
through the transition ``Qhat`` (row ``t``: ``q_t^T A_t ... A_1``), the state left from
zero ``S_ext`` and the run's transition ``M = A_L ... A_1``; then ``O = O0 + Qhat S_in``
and ``S_end = M S_in + S_ext`` for any entering ``S_in``.

Must not import transformers or torch.distributed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_ring.mixers.delta_rule_chunk import ChunkTerms

# Tokens per block of the decayed products: the pairwise products grow with it, the
# factored ones' exps shrink; on CPUs at chunk 64, dk 128, 8 is about twice as fast as 16,
# and faster than 4.
BLOCK = 8


def _flush(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its entries below ``tiny / eps`` in size (``1e-31`` in float32) set to zero.

    Products of such entries with numbers of order ``eps`` or less are subnormal, CPU
    arithmetic on subnormals is about 100 times slower (GPUs flush them), and what is lost
    is that small in absolute size next to the outputs, of order one. Flushing only the
    subnormals themselves (``delta_rule_chunk``) leaves the products slow: a decaying
    transition spends hundreds of tokens between ``1e-31`` and ``1e-38``."""
    info = torch.finfo(x.dtype)
    return x.masked_fill(x.abs() < info.tiny / info.eps, 0)


def _exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` for ``x <= 0``, flushed (:func:`_flush`)."""
    return _flush(x.exp())


def decayed_products(a: torch.Tensor, k: torch.Tensor, gam: torch.Tensor) -> torch.Tensor:
    """``L(a, k)``: ``sum_c a_ic k_jc exp(gam_ic - gam_jc)`` for ``j <= i``, zero above.

    Args:
        a: ``(..., B, H, n, c, dk)`` (leading dimensions broadcast: queries and keys stacked).
        k, gam: ``(B, H, n, c, dk)``; gam non-increasing along ``c`` (cumulative log decay).

    Returns:
        ``(..., B, H, n, c, c)`` in ``a``'s dtype.
    """
    c = k.shape[-2]
    rows = []
    for s0 in range(0, c, BLOCK):
        s1 = min(s0 + BLOCK, c)
        g_blk = gam[..., s0:s1, :]  # (B, H, n, m, dk)
        above = torch.ones(s1 - s0, s1 - s0, dtype=torch.bool, device=k.device).triu(1)[..., None]
        # Within the block pair by pair, masked before the exp: above the diagonal
        # gam_i - gam_j > 0 could overflow.
        pair = _exp((g_blk[..., :, None, :] - g_blk[..., None, :, :]).masked_fill(above, float("-inf")))
        parts = [(a[..., s0:s1, None, :] * k[..., None, s0:s1, :] * pair).sum(-1)]  # (..., m, m)
        if s0:  # the earlier tokens through the decay at the block's start: both factors <= 1
            ref = gam[..., s0 - 1:s0, :]
            left = a[..., s0:s1, :] * _exp(g_blk - ref)
            parts.insert(0, left @ (k[..., :s0, :] * _exp(ref - gam[..., :s0, :])).transpose(-1, -2))
        if s1 < c:
            parts.append(parts[-1].new_zeros(*parts[-1].shape[:-1], c - s1))
        rows.append(torch.cat(parts, -1))
    return torch.cat(rows, -2)


def chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                chunk_size: int) -> ChunkTerms:
    """The batched part of the chunked form (see the module docstring); differentiable.

    Args:
        q, k, g: ``(B, H, L, dk)`` (q scaled, g the log decay, <= 0); v ``(B, H, L, dv)``;
            beta ``(B, H, L)``; one float dtype (float32 or float64), as
            ``delta_rule_chunk.heads_first`` returns them.
        chunk_size: tokens per chunk; a run shorter than it is one chunk of its own length.

    Returns:
        ``ChunkTerms`` with ``chunk_decay`` ``exp(gam_C)`` of shape ``(B, H, n, dk, 1)``.
    """
    b, h, length, dk = k.shape
    dv = v.shape[-1]
    c = min(chunk_size, length)
    pad = -length % c
    if pad:  # padded tokens have k = v = beta = 0 and g = 0: A = I, nothing written
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (length + pad) // c
    q, k, v, g = (t.reshape(b, h, n, c, t.shape[-1]) for t in (q, k, v, g))
    beta = beta.reshape(b, h, n, c, 1)

    gam = g.cumsum(-2)  # (b, h, n, c, dk): log decay from the chunk's start, token included
    kb = k * beta
    attn, tri = decayed_products(torch.stack([q, kb]), k, gam)  # (b, h, n, c, c) each
    # One solve for both right-hand sides: T [U0 | W] = [V beta | K beta exp(gam)].
    rhs = torch.cat([v * beta, kb * _exp(gam)], -1)
    u, w = torch.linalg.solve_triangular(tri.tril(-1), rhs, upper=False, unitriangular=True).split([dv, dk], -1)
    gam_end = gam[..., -1:, :]  # (b, h, n, 1, dk)
    return ChunkTerms(u, w, attn=attn, q_read=q * _exp(gam), k_write=k * _exp(gam_end - gam),
                      chunk_decay=_exp(gam_end).transpose(-1, -2), length=length)


def widened_scan(terms: ChunkTerms) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scan on the widened state ``[S | P]`` entering ``[0 | I]`` with values ``[V | 0]``
    (module docstring); differentiable.

    ``P`` decays like the product of the run's decays (``exp(-100)`` over 2048 tokens at
    ``g = -0.05``: subnormal in float32), so each chunk's outputs and leaving state are
    flushed (:func:`_flush`); what is lost is below ``1e-31`` in absolute size, and the
    outputs ``O0 + Qhat S_in`` are of order one.

    Returns:
        ``o0`` ``(B, H, L, dv)``, ``qhat`` ``(B, H, L, dk)`` and ``[S_ext | M]`` ``(B, H, dk,
        dv + dk)``, in the terms' dtype.
    """
    dv, dk = terms.u.shape[-1], terms.w.shape[-1]
    outs, state = [], None
    for u, w, attn, q_read, k_write, decay in terms.by_chunk():
        if state is None:  # entering [0 | I]: W [0 | I] = [0 | W], Q_read [0 | I] = [0 | Q_read]
            v_new = torch.cat([u, -w], -1)  # (B, H, c, dv + dk)
            out = attn @ v_new + F.pad(q_read, (dv, 0))
            state = F.pad(torch.diag_embed(decay[..., 0]), (dv, 0)) + k_write.transpose(-1, -2) @ v_new
        else:
            v_new = F.pad(u, (0, dk)) - w @ state
            out = q_read @ state + attn @ v_new
            state = state * decay + k_write.transpose(-1, -2) @ v_new
        outs.append(_flush(out))
        state = _flush(state)
    out = torch.stack(outs, 2)
    out = out.reshape(*out.shape[:2], -1, dv + dk)[:, :, :terms.length]
    return out[..., :dv], out[..., dv:], state


__all__ = ["BLOCK", "chunk_terms", "decayed_products", "widened_scan"]
