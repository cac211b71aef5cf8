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

Summaries for context parallelism. A chunk's outputs and leaving state are affine in its
``S_0``, hence so are a whole run's: ``S_end = M S_in + S_ext`` and ``O = O_ext + Qhat
S_in``, with ``M = A_L ... A_1`` the run's transition (``dk x dk``) and ``Qhat``'s row
``t`` = ``q_t^T A_t ... A_1`` (the query seen through the transition). The same scan on
the widened state ``[S | P]`` (``dv + dk`` columns), entering ``[0 | I]`` with values
``[V | 0]``, leaves ``[S_ext | M]`` and reads ``Qhat`` off ``P``'s outputs
(:func:`summary_scan`): one scan with wider matrices, no run on the identity apart.

The batched terms (:func:`chunk_terms`) are computed once per run and serve both scans.

Must not import transformers or torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
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


@dataclass
class ChunkTerms:
    """What the scan over chunks reads, batched over the chunks (``n`` chunks of ``c``).

    Attributes:
        u: ``U0`` ``(B, H, n, c, dv)``; w: ``W`` ``(B, H, n, c, dk)``.
        attn: ``Q K^T o D`` ``(B, H, n, c, c)``.
        q_read: ``Q exp(gam)`` ``(B, H, n, c, dk)``: reads the entering state.
        k_write: ``K exp(gam_C - gam)`` ``(B, H, n, c, dk)``: writes to the leaving state.
        chunk_decay: ``exp(gam_C)`` ``(B, H, n, 1, 1)``.
        length: the run's tokens (before padding to ``n * c``).
    """

    u: torch.Tensor
    w: torch.Tensor
    attn: torch.Tensor
    q_read: torch.Tensor
    k_write: torch.Tensor
    chunk_decay: torch.Tensor
    length: int

    def detach(self) -> "ChunkTerms":
        return ChunkTerms(*(getattr(self, f.name).detach() for f in fields(self)[:-1]), self.length)

    def by_chunk(self) -> list[tuple[torch.Tensor, ...]]:
        """Per chunk: ``(u, w, attn, q_read, k_write, chunk_decay)``. ``unbind`` once: indexing
        chunk ``i`` out of each tensor would cost the backward a full-size gradient per chunk."""
        return list(zip(*(getattr(self, f.name).unbind(2) for f in fields(self)[:-1])))


def chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                chunk_size: int) -> ChunkTerms:
    """The batched part of the chunked form (see the module docstring).

    Args:
        q, k: ``(B, H, L, dk)``; v ``(B, H, L, dv)``; g, beta ``(B, H, L)``; one float dtype
            (float32 or float64), as :func:`heads_first` returns them.
        chunk_size: tokens per chunk; a run shorter than it is one chunk of its own length.
    """
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
    return ChunkTerms(u, w, attn=q @ k.transpose(-1, -2) * decay, q_read=q * gam.exp()[..., None],
                      k_write=k * (gam[..., -1:] - gam).exp()[..., None],
                      chunk_decay=gam[..., -1].exp()[..., None, None], length=length)


def scan(terms: ChunkTerms, state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over chunks from ``state`` ``(B, H, dk, dv)`` (None: zeros).

    Returns:
        out ``(B, H, L, dv)`` and the leaving state ``(B, H, dk, dv)``; differentiable.
    """
    outs = []
    for u, w, attn, q_read, k_write, decay in terms.by_chunk():
        if state is None:  # zero entering state: nothing to read
            v_new = u
            outs.append(attn @ v_new)
            state = k_write.transpose(-1, -2) @ v_new
            continue
        v_new = u - w @ state  # (B, H, c, dv): what the chunk writes
        outs.append(q_read @ state + attn @ v_new)
        state = state * decay + k_write.transpose(-1, -2) @ v_new
    out = torch.stack(outs, 2)
    return out.reshape(*out.shape[:2], -1, out.shape[-1])[:, :, :terms.length], state


def _flush(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its subnormal entries set to zero (flush to zero, as GPUs do): they carry
    less than the dtype's precision, and every later CPU operation on them is very slow."""
    return x.masked_fill(x.abs() < torch.finfo(x.dtype).tiny, 0)


@torch.no_grad()
def summary_scan(terms: ChunkTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's summary from a zero state: the scan on the widened state ``[S | P]``
    entering ``[0 | I]`` with values ``[V | 0]`` (only ``P``'s outputs are kept).

    ``P`` decays like the product of the run's decays (``exp(-100)`` over 2048 tokens at
    ``g = -0.05``: subnormal in float32, and subnormal arithmetic is tens of times slower
    on CPUs). So the scan carries ``P / s`` with ``s`` its largest entry, renormalised
    every chunk, and ``log s`` beside it (one per batch and head; the scan is linear, so
    ``P``'s columns scale apart from ``S``'s); ``Qhat`` and ``M`` are scaled back at the
    end, entries below the dtype's smallest normal number flushed to zero.

    Returns:
        ``qhat`` ``(B, H, L, dk)`` (row ``t``: ``q_t^T A_t ... A_1``) and ``[S_ext | M]``
        ``(B, H, dk, dv + dk)``. Not differentiable: the backward never needs its graph
        (see ``delta_rule``).
    """
    b, h, _, c, dv = terms.u.shape
    dk = terms.w.shape[-1]
    tiny = torch.finfo(terms.u.dtype).tiny
    qhats, log_scales, state = [], [], None
    log_scale = terms.u.new_zeros(b, h, 1, 1)  # log of P's scale entering the chunk
    for u, w, attn, q_read, k_write, decay in terms.by_chunk():
        if state is None:  # [S | P] = [0 | I]: W [S | P] = [0 | W]
            v_new = torch.cat([u, -w], -1)
            qhat = q_read + attn @ v_new[..., dv:]
            eye = torch.eye(dk, dtype=u.dtype, device=u.device).expand(b, h, dk, dk)
            state = torch.cat([u.new_zeros(b, h, dk, dv), eye * decay], -1) + k_write.transpose(-1, -2) @ v_new
        else:
            v_new = -(w @ state)  # (B, H, c, dv + dk)
            v_new[..., :dv] += u
            qhat = q_read @ state[..., dv:] + attn @ v_new[..., dv:]
            state = state * decay + k_write.transpose(-1, -2) @ v_new
        qhats.append(qhat)
        log_scales.append(log_scale)
        scale = state[..., dv:].abs().amax((-1, -2), keepdim=True).clamp_min(tiny)  # (B, H, 1, 1)
        state[..., dv:] /= scale
        log_scale = log_scale + scale.log()
    qhat = torch.stack(qhats, 2) * torch.stack(log_scales, 2).exp()  # (B, H, n, c, dk)
    state[..., dv:] *= log_scale.exp()
    return _flush(qhat.reshape(b, h, -1, dk)[:, :, :terms.length]), _flush(state)


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
    out, final = scan(chunk_terms(qh, kh, vh, gh, bh, chunk_size), state)
    return out.transpose(1, 2).to(q.dtype), final


__all__ = ["ChunkTerms", "accum_dtype", "chunk_terms", "heads_first", "local_gated_delta_rule", "scan", "summary_scan"]
