"""Mamba-2's SSD scan (state space duality) on one run of consecutive tokens, chunked, in
two phases: everything that does not depend on the state entering the run first, the
entering state's part of the outputs afterwards.

Per head ``h`` (of group ``h // (heads / groups)``), with the state ``S`` of shape ``(p, n)``,
token ``t`` does

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,    y_t = S_t C_t

(transformers' ``mamba2_chunk_scan``; ``D x_t`` is added by the caller). The transition is
one scalar per head, so the whole run is affine in its entering state ``S_in`` with a
scalar transition: ``S_end = a S_in + S_ext`` with ``a = exp(sum_t dt_t A)``, and
``y_t = y0_t + exp(sum_{u <= t} dt_u A) (S_in C_t)``, ``y0``/``S_ext`` the run from zero.

Chunked like transformers' (chunks of ``l`` tokens, the last one padded with ``dt = 0``
tokens, which change nothing): inside a chunk the outputs are masked "attention"
``(C B^T o L) (x dt)`` with ``L_ts = exp(sum_{s < u <= t} dt_u A)``; each chunk's own
contribution to the state at its end is summed; a chunk-by-chunk matrix of decays carries
those contributions to every later chunk's start (``start``: the state entering each chunk,
and leaving the run, from a zero entering state). :func:`chunk_terms` computes all of it
(phase 1); :func:`chunk_outputs` adds the states entering the chunks to the outputs, with
the run's entering state folded into them first (phase 2), so the entering state costs no
pass of its own.

Heads stay grouped: ``B`` and ``C`` are never repeated per head, ``C B^T`` is computed once
per group. Everything is autograd; the gradients come from torch.

Must not import transformers or torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(..., T)`` -> ``(..., T, T)``: entry ``[i, j]`` is ``sum_{j < k <= i} x_k`` for
    ``j <= i`` and ``-inf`` above the diagonal (exp gives the causal decay matrix). Sums of
    the terms themselves, not differences of cumulative sums: no cancellation."""
    t = x.shape[-1]
    x = x[..., None].expand(*x.shape, t)  # [..., i, j] = x_i
    strict = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), -1)
    sums = x.masked_fill(~strict, 0).cumsum(-2)
    return sums.masked_fill(~torch.tril(torch.ones_like(strict), 0), float("-inf"))


def discretize_dt(dt: torch.Tensor, dt_bias: Optional[torch.Tensor], softplus: bool,
                  limit: tuple[float, float], dtype: torch.dtype) -> torch.Tensor:
    """transformers' step sizes: ``clamp(softplus?(dt + dt_bias), *limit)``, ``dt`` ``(b, s, h)``
    and ``dt_bias`` ``(h,)`` -> ``(b, s, h)`` in ``dtype`` (computed in it: for bfloat16
    inputs this rounds less than transformers, which works in dt's own dtype)."""
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=limit[0], max=limit[1])


@dataclass
class SSDTerms:
    """Phase 1 of a batch of runs of ``length`` tokens, ``c`` chunks of ``l`` (``c l >= length``),
    all in the accumulation dtype (float32, float64 for float64 inputs).

    Attributes:
        y_diag: ``(b, c, l, h, p)``: each token's output from its own chunk's tokens.
        start: ``(b, c + 1, h, p, n)``: the state entering each chunk from a zero state
            entering the run; ``start[:, c]`` is the state leaving the run, ``S_ext``.
        reach: ``(b, h, c + 1)``: ``exp(sum dt A)`` from the run's start to each chunk's
            start; ``reach[..., c]`` is the run's transition ``a``.
        decay_out: ``(b, c, l, h)``: ``exp(sum dt A)`` from the chunk's start to each token
            (the token included).
        C: ``(b, c, l, g, n)``: the read-out vectors, padded.
        length: the run's tokens (the rest is padding).
    """

    y_diag: torch.Tensor
    start: torch.Tensor
    reach: torch.Tensor
    decay_out: torch.Tensor
    C: torch.Tensor
    length: int

    @property
    def leaving(self) -> torch.Tensor:
        """``S_ext`` ``(b, h, p, n)``: the state leaving the run from a zero entering state."""
        return self.start[:, -1]

    @property
    def transition(self) -> torch.Tensor:
        """``a`` ``(b, h)``: the factor the run applies to its entering state."""
        return self.reach[..., -1]


def chunk_terms(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                chunk_size: int) -> SSDTerms:
    """Phase 1 of runs of consecutive tokens from a zero entering state.

    Args:
        x: ``(b, s, h, p)``; dt: ``(b, s, h)``, already discretised (:func:`discretize_dt`);
            A: ``(h,)``, negative; B, C: ``(b, s, g, n)`` with ``h % g == 0`` (head ``i``
            reads group ``i // (h // g)``). All in one float dtype, the accumulation one.
        chunk_size: tokens per chunk at most; a run shorter than it is one chunk of its
            own length (no padding to compute).
    """
    b, s, h, p = x.shape
    g, n = B.shape[2:]
    r = h // g
    l = min(chunk_size, s)  # noqa: E741  (the chunk length, as in the einsums)
    c = -(-s // l)
    pad = c * l - s
    # Padding tokens have dt = 0: no input, decay exp(0) = 1; they change no state.
    xdt, dA, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x * dt[..., None], dt * A, B, C))
    X = xdt.view(b, c, l, g, r, p)
    B, C = B.view(b, c, l, g, n), C.view(b, c, l, g, n)
    dA = dA.view(b, c, l, h).permute(0, 3, 1, 2)  # (b, h, c, l)
    cum = dA.cumsum(-1)

    # Inside each chunk: (C B^T per group) o (causal decays per head), applied to x dt.
    decays = torch.exp(segment_sum(dA)).view(b, g, r, c, l, l).permute(0, 3, 1, 2, 4, 5)  # (b, c, g, r, t, u)
    scores = torch.einsum("bctgn,bcugn->bcgtu", C, B)[:, :, :, None] * decays
    y_diag = torch.einsum("bcgrtu,bcugrp->bctgrp", scores, X).reshape(b, c, l, h, p)

    # Each chunk's own contribution to the state at its end: (b, c, h, p, n).
    to_end = torch.exp(cum[..., -1:] - cum).view(b, g, r, c, l).permute(0, 3, 4, 1, 2)  # (b, c, l, g, r)
    own = torch.einsum("bclgn,bclgrp->bcgrpn", B, X * to_end[..., None]).reshape(b, c, h, p, n)

    # Between chunks: chunk_decay[t, z] carries chunk z - 1's contribution (column 0: the
    # entering state) to the start of chunk t; row c is the run's end.
    chunk_decay = torch.exp(segment_sum(F.pad(cum[..., -1], (1, 0))))  # (b, h, c + 1, c + 1)
    start = torch.einsum("bhtz,bzhpn->bthpn", chunk_decay[..., 1:], own)
    return SSDTerms(y_diag, start, chunk_decay[..., 0], torch.exp(cum).permute(0, 2, 3, 1), C, s)


def chunk_outputs(terms: SSDTerms, s_in: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Phase 2: the runs' outputs ``y`` ``(b, s, h, p)`` (without ``D x``) given the state
    entering each run, ``s_in`` ``(b, h, p, n)`` (None: zero)."""
    b, c, l, h, p = terms.y_diag.shape
    g, n = terms.C.shape[-2:]
    start = terms.start[:, :-1]  # (b, c, h, p, n)
    if s_in is not None:  # the entering state, decayed to each chunk's start
        start = start + terms.reach[..., :-1].transpose(1, 2)[..., None, None] * s_in[:, None]
    y_off = torch.einsum("bclgn,bcgrpn->bclgrp", terms.C, start.view(b, c, g, h // g, p, n))
    y = terms.y_diag + y_off.reshape(b, c, l, h, p) * terms.decay_out[..., None]
    return y.reshape(b, c * l, h, p)[:, :terms.length]


__all__ = ["SSDTerms", "chunk_outputs", "chunk_terms", "discretize_dt", "segment_sum"]
