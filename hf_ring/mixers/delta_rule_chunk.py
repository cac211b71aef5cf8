"""The gated delta rule on one run of consecutive tokens, chunked, heads first.

Per head, with the state ``S`` of shape ``(dk, dv)``, token ``t`` does

    S_t = A_t S_{t-1} + beta_t k_t v_t^T,   A_t = exp(g_t) (I - beta_t k_t k_t^T)   (dk x dk)
    o_t = S_t^T q_t                         (q_t already scaled by dk ** -0.5)

(Qwen3-Next's and Qwen3.5's linear attention, flash-linear-attention's
``chunk_gated_delta_rule``). Inside a chunk of ``C`` tokens entering with ``S_0``, write
``gam`` for the cumulative log decay from the chunk's start (token included) and
``D_ij = exp(gam_i - gam_j)`` for ``j <= i``. The delta rule's "new values" ``u_i``
(what token ``i`` writes) solve the unit lower-triangular system

    T U = V beta - (K beta exp(gam)) S_0,   T = I + strictly_lower(beta_i (k_i . k_j) D_ij)

so ``U = U0 - W S_0`` with ``U0 = T^-1 V beta`` and ``W = T^-1 K beta exp(gam)``, and then

    O   = (Q exp(gam)) S_0 + (Q K^T o D) U                 (lower triangle, diagonal included)
    S_C = exp(gam_C) S_0 + (K exp(gam_C - gam))^T U.

Everything but the scan over chunks is batched over the chunks.

Summaries for context parallelism. Each chunk's output and final state are affine in its
``S_0``, hence so are a whole run's: ``S_end = M S_in + S_ext`` and ``O = O_ext + Qhat
S_in``, with ``M = A_L ... A_1`` the run's transition and ``Qhat`` row ``t`` = ``q_t^T
A_t ... A_1`` (the query seen through the transition). Running the same scan on the
widened state ``[S | P]`` (``dv + dk`` columns), entering ``[0 | I]`` with values ``[V |
0]``, returns all four at once: outputs ``[O_ext | Qhat]`` and final state ``[S_ext | M]``.
One scan, wider matrices: no rerun after the states are known.

Must not import transformers or torch.distributed.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype states and outputs accumulate in: float32, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                use_qk_l2norm: bool) -> tuple[torch.Tensor, ...]:
    """The op's inputs as the scan takes them.

    Args:
        q, k: ``(batch, seq, hk, dk)``; v ``(batch, seq, hv, dv)``; g (log decay, <= 0) and
            beta ``(batch, seq, hv)``; ``hv % hk == 0`` (each q/k head serves ``hv // hk``
            consecutive value heads); any float dtype.
        use_qk_l2norm: L2-normalise q and k over dk first (eps 1e-6 inside the root).

    Returns:
        q, k ``(batch, hv, seq, dk)``, v ``(batch, hv, seq, dv)``, g, beta ``(batch, hv,
        seq)``, all in :func:`accum_dtype`; q scaled by ``dk ** -0.5``.
    """
    dt = accum_dtype(q.dtype)
    group = v.shape[2] // k.shape[2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    q, k, v = (t.transpose(1, 2).to(dt) for t in (q, k, v))
    g, beta = (t.transpose(1, 2).to(dt) for t in (g, beta))
    if use_qk_l2norm:
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + 1e-6)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               chunk_size: int, state: Optional[torch.Tensor] = None,
               summary: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule over one run (see the module docstring).

    Args:
        q, k: ``(B, H, L, dk)``; v ``(B, H, L, dv)``; g, beta ``(B, H, L)``; one float
            dtype (float32 or float64), as :func:`heads_first` returns them.
        chunk_size: tokens per chunk; a run shorter than it is one chunk of its own length.
        state: the entering state ``(B, H, dk, dv)``, or None for zeros. Must be None with
            ``summary`` (the summary is taken from a zero state).
        summary: also return the run's transition and its queries seen through it.

    Returns:
        ``(out, final)``: without ``summary``, ``out`` ``(B, H, L, dv)`` and the final state
        ``(B, H, dk, dv)``; with it, ``out`` ``(B, H, L, dv + dk)`` = ``[O_ext | Qhat]`` and
        ``final`` ``(B, H, dk, dv + dk)`` = ``[S_ext | M]``. Differentiable in every input.
    """
    if summary and state is not None:
        raise ValueError("chunk_scan(summary=True) summarises from a zero state; pass state=None")
    b, h, length, dk = k.shape
    dv = v.shape[-1]
    c = min(chunk_size, length)
    pad = -length % c
    if pad:  # padded tokens have k = v = beta = 0 and g = 0: A = I, nothing written
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (length + pad) // c
    q, k, v = (t.reshape(b, h, n, c, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)

    gam = g.cumsum(-1)  # (b, h, n, c): log decay from the chunk's start, token included
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # Masked before the exp: above the diagonal gam_i - gam_j > 0 could overflow.
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # (b, h, n, c, c)
    kb = k * beta[..., None]  # (b, h, n, c, dk)
    tri = (kb @ k.transpose(-1, -2) * decay).tril(-1)  # strictly lower part of T
    # One solve for both right-hand sides: T [U0 | W] = [V beta | K beta exp(gam)].
    rhs = torch.cat([v * beta[..., None], kb * gam.exp()[..., None]], -1)
    eye_c = torch.eye(c, dtype=q.dtype, device=q.device)
    u, w = torch.linalg.solve_triangular(tri + eye_c, rhs, upper=False, unitriangular=True).split([dv, dk], -1)
    attn = q @ k.transpose(-1, -2) * decay  # (b, h, n, c, c), causal within the chunk
    q_read = q * gam.exp()[..., None]  # (b, h, n, c, dk): reads the entering state
    k_write = k * (gam[..., -1:] - gam).exp()[..., None]  # (b, h, n, c, dk): decayed to the chunk's end
    chunk_decay = gam[..., -1].exp()[..., None, None]  # (b, h, n, 1, 1)

    if summary:  # widened state [S | P] entering [0 | I], values [V | 0]
        u = F.pad(u, (0, dk))
        eye_k = torch.eye(dk, dtype=q.dtype, device=q.device).expand(b, h, dk, dk)
        state = torch.cat([q.new_zeros(b, h, dk, dv), eye_k], -1)
    width = u.shape[-1]
    outs = []
    for i in range(n):
        if state is None:  # zero entering state: skip the reads of it
            v_new = u[:, :, i]
            outs.append(attn[:, :, i] @ v_new)
            state = k_write[:, :, i].transpose(-1, -2) @ v_new
            continue
        v_new = u[:, :, i] - w[:, :, i] @ state  # (b, h, c, width)
        outs.append(q_read[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_write[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, 2).reshape(b, h, n * c, width)[:, :, :length]
    return out, state


def local_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = 64, initial_state: Optional[torch.Tensor] = None,
                           use_qk_l2norm_in_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over whole rows, on one process (no context parallelism).

    Args:
        q, k: ``(batch, seq, hk, dk)``; v ``(batch, seq, hv, dv)``; g, beta ``(batch, seq, hv)``.
        initial_state: ``(batch, hv, dk, dv)`` or None (zeros).

    Returns:
        out ``(batch, seq, hv, dv)`` in q's dtype and the final state ``(batch, hv, dk, dv)``
        in float32 (float64 for float64 inputs).
    """
    qh, kh, vh, gh, bh = heads_first(q, k, v, g, beta, use_qk_l2norm_in_kernel)
    state = None if initial_state is None else initial_state.to(qh.dtype)
    out, final = chunk_scan(qh, kh, vh, gh, bh, chunk_size, state)
    return out.transpose(1, 2).to(q.dtype), final


__all__ = ["accum_dtype", "chunk_scan", "heads_first", "local_gated_delta_rule"]
