"""The Mamba-1 selective scan under context parallelism (Mamba, Falcon-Mamba, Jamba).

Computes exactly what one process computes over the full sequence (transformers'
``mamba_selective_scan``, whose torch path is a Python loop over tokens), each rank
holding its pieces of the sequence (``hf_ring.sharding.pieces``: zigzag, contiguous,
packed rows). Per channel ``d`` and state entry ``n``:

    h_t = exp(delta_t A) * h_{t-1} + delta_t B_t u_t,    y_t = C_t . h_t + D u_t,

times ``silu(z_t)``. The transition is diagonal, so a run of tokens summarises itself as
the state it leaves from a zero state, ``S_ext``, and its transition ``T = exp(A *
sum(delta))``, both ``(batch, d_inner, d_state)``:

1. every piece from a zero state (``_scan_pieces``), in chunks of at most ``chunk_size``
   tokens (each piece padded to whole chunks; a padded token has ``delta = 0``, so it
   leaves the state alone): a loop over a chunk's positions, vectorised over every chunk
   of every piece; then a loop over the chunks, composing each piece's chunks from zero;
2. one all-gather of every piece's ``[S_ext | T]`` (``(pieces, batch, d_inner,
   2 d_state)`` per rank, whatever the sequence length); every rank composes, in sequence
   order, the state entering each of its pieces (``state_exchange.compose_in_order``,
   applying ``T * S``), zero at each document's start;
3. each chunk's entering state (its state from zero plus its piece's entering state
   decayed to it) corrects the chunk's outputs, ``y_t += C_t . (exp(A cs_t) * S_chunk)``
   (``cs_t``: the chunk's cumulative ``delta`` up to ``t``); then ``D u`` and the gate.

Everything is autograd (the loop within chunks with its own backward, ``_ChunkScan``, so
that no step copies a full-size tensor); the all-gather is differentiable (its backward
reduce-scatters), so the gradient of every input is exact, and each rank's gradient of
the replicated ``A``, ``D``, ``delta_bias`` is its part (the ranks' parts sum to the
full one, as their losses do).

Numerics: every factor is ``exp(A x)`` with ``x`` a sum of ``delta`` over at most one
chunk, or a product of such factors; with ``A <= 0`` and ``delta >= 0`` (Mamba's ``A =
-exp(A_log)``, softplus) each is in ``(0, 1]``: nothing overflows (no ``exp(-x)``
rescaling), and a factor that underflows is a state that has decayed away. States
accumulate in float32 (float64 for float64 inputs), as transformers' do.

Must not import transformers, accelerate, or hf_ring's patterns, hf, memory, training or
wrap layers.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_ring.distributed.collectives import Collectives, GroupCollectives, all_gather
from hf_ring.distributed.active import resolve_cp_group
from hf_ring.distributed.groups import group_coords
from hf_ring.mixers.state_exchange import compose_in_order, join_exchange, rank_pieces
from hf_ring.sharding.pieces import Piece


def _check_inputs(u, delta, A, B, C, D, z, delta_bias, chunk_size) -> None:
    named = {"u": u, "delta": delta, "A": A, "B": B, "C": C, "D": D, "z": z, "delta_bias": delta_bias}
    given = {k: t for k, t in named.items() if t is not None}
    if not all(isinstance(t, torch.Tensor) and t.dtype.is_floating_point for t in given.values()):
        raise ValueError(f"{', '.join(given)} must be floating-point tensors")
    if u.dim() != 3:
        raise ValueError(f"u must be channels-first (batch, d_inner, local_seq), got {tuple(u.shape)}")
    b, d, s = u.shape
    if A.dim() != 2 or A.shape[0] != d:
        raise ValueError(f"A must be (d_inner, d_state) = ({d}, d_state), got {tuple(A.shape)}")
    want = {"delta": (b, d, s), "z": (b, d, s), "B": (b, A.shape[1], s), "C": (b, A.shape[1], s),
            "D": (d,), "delta_bias": (d,)}
    for name, shape in want.items():
        if name in given and tuple(given[name].shape) != shape:
            extra = (" (mamba_ssm's grouped (batch, groups, d_state, seq) or time-invariant (d_inner, "
                     "d_state) B and C are not supported: pass them per token)") if name in "BC" else ""
            raise ValueError(f"{name} must be {shape} (u is (batch, d_inner, local_seq) = {(b, d, s)}, A "
                             f"(d_inner, d_state) = {tuple(A.shape)}), got {tuple(given[name].shape)}{extra}")
    if len({t.device for t in given.values()}) > 1:
        raise ValueError(f"{', '.join(given)} must be on one device")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


class _Pieces(NamedTuple):
    """Every piece of one rank scanned from a zero state, ``k`` chunks of ``L`` tokens in
    all (pieces padded to whole chunks), ``cd`` the compute dtype."""

    y0: torch.Tensor  # (L, b, k, d) cd: outputs from a zero state entering each chunk
    decay: torch.Tensor  # (L, b, k, d, n) cd: exp(A cs_t), the chunk's decay up to t
    C: torch.Tensor  # (L, b, k, n) cd
    zero_in: torch.Tensor  # (b, k, d, n) cd: the state entering each chunk, its piece from zero
    spans: list[tuple[int, int]]  # each piece's first chunk and chunk count
    to_chunk: list[Optional[torch.Tensor]]  # (b, chunks, d, n): a piece's start decayed to its chunks
    s_ext: list[torch.Tensor]  # (b, d, n) per piece: the state it leaves from zero
    trans: list[torch.Tensor]  # (b, d, n) per piece: its transition exp(A * sum(delta))


def _chunked(x: torch.Tensor, pieces: list[Piece], L: int) -> torch.Tensor:
    """``x`` ``(b, c, s)`` -> ``(L, b, k, c)``: each piece padded with zeros to whole
    chunks of ``L``, a chunk's positions first (each step of the scan reads one slab)."""
    if any(p.length % L for p in pieces):  # else the pieces tile the row in whole chunks already
        x = torch.cat([F.pad(x[..., p.local_start:p.local_start + p.length], (0, -p.length % L))
                       for p in pieces], -1)
    return x.reshape(*x.shape[:2], -1, L).permute(3, 0, 2, 1).contiguous()


class _ChunkScan(torch.autograd.Function):
    """The states of every chunk from a zero state, ``h_i = a_i * h_{i-1} + x_i`` along
    the first dimension: a, x ``(L, ...)`` -> h ``(L, ...)``. Its own backward, the same
    loop in reverse, ``g_i += a_{i+1} * g_{i+1}``: autograd over the loop would index or
    stack full-size tensors once a step; here every step writes into one buffer."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.empty_like(x)
        h[0] = x[0]
        for i in range(1, len(x)):
            torch.addcmul(x[i], a[i], h[i - 1], out=h[i])
        ctx.save_for_backward(a, h)
        return h

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, h = ctx.saved_tensors
        g = grad.clone()  # becomes the gradient of every state, hence of x
        for i in range(len(g) - 2, -1, -1):
            g[i].addcmul_(a[i + 1], g[i + 1])
        d_a = torch.empty_like(a)
        d_a[0] = 0  # the first state is x_0 alone
        torch.mul(g[1:], h[:-1], out=d_a[1:])
        return d_a, g


def _scan_pieces(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 pieces: list[Piece], L: int) -> _Pieces:
    """Every piece from a zero state (module docstring, 1). u, dt ``(b, d, s)``, B, C
    ``(b, n, s)``, A ``(d, n)``, all in the compute dtype; dt after bias and softplus."""
    u, dt, B, C = (_chunked(x, pieces, L) for x in (u, dt, B, C))  # (L, b, k, ·)
    d_a = torch.exp(dt[..., None] * A)  # (L, b, k, d, n): each token's transition
    states = _ChunkScan.apply(d_a, (dt * u)[..., None] * B[..., None, :])  # (L, b, k, d, n)
    y0 = (states @ C[..., None])[..., 0]  # (L, b, k, d)
    decay = torch.exp(dt.cumsum(0)[..., None] * A)  # within one chunk: a sum of <= L deltas
    ends, chunk_trans = states[-1].unbind(1), decay[-1].unbind(1)  # per chunk (b, d, n): leaving state, transition
    zero_in, spans, to_chunk, s_ext, trans, k = [], [], [], [], [], 0
    for p in pieces:  # the chunks of each piece composed from zero, in order
        n_chunks = -(-p.length // L)
        state, reach, reaches = torch.zeros_like(ends[0]), torch.ones_like(ends[0]), []
        for c in range(k, k + n_chunks):
            zero_in.append(state)
            reaches.append(reach)
            state = torch.addcmul(ends[c], chunk_trans[c], state)
            reach = chunk_trans[c] * reach if not p.first else reach  # a first piece's start is zero
        spans.append((k, n_chunks))
        to_chunk.append(None if p.first else torch.stack(reaches, 1))
        s_ext.append(state)
        trans.append(reach)
        k += n_chunks
    return _Pieces(y0, decay, C, torch.stack(zero_in, 1), spans, to_chunk, s_ext, trans)


def _outputs(t: _Pieces, s_in: list[Optional[torch.Tensor]], pieces: list[Piece], L: int) -> torch.Tensor:
    """The true outputs ``(b, d, s)`` (module docstring, 3), given each piece's entering
    state ``(b, d, n)`` (None: zero)."""
    enter = torch.cat([t.zero_in[:, k:k + m] if s is None else t.zero_in[:, k:k + m] + reach * s[:, None]
                       for (k, m), reach, s in zip(t.spans, t.to_chunk, s_in)], 1)  # (b, k, d, n)
    y = t.y0 + ((t.decay * enter) @ t.C[..., None])[..., 0]  # (L, b, k, d)
    b, d = y.shape[1], y.shape[3]
    y = y.permute(1, 3, 2, 0).reshape(b, d, -1)  # (b, d, k L)
    return torch.cat([y[..., k * L:k * L + p.length] for (k, _), p in zip(t.spans, pieces)], -1)


def selective_scan_op(
    u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    coll: Optional[Collectives], layout: str = "zigzag", local_doc_lens: Optional[Sequence[int]] = None,
    D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None, delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = False, return_last_state: bool = False, chunk_size: int = 64,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`context_parallel_selective_scan` over given collectives (None: one
    process); the benchmark passes virtual ones. No check across ranks."""
    _check_inputs(u, delta, A, B, C, D, z, delta_bias, chunk_size)
    rank, world = (coll.rank, coll.world) if coll is not None else (0, 1)
    mine, order = rank_pieces(layout, rank, world, u.shape[-1], local_doc_lens)
    cd = torch.float64 if torch.float64 in (u.dtype, delta.dtype, A.dtype, B.dtype, C.dtype) else torch.float32
    dt = delta if delta_bias is None else delta + delta_bias.to(delta.dtype)[:, None]  # as transformers:
    dt = (F.softplus(dt) if delta_softplus else dt).to(cd)  # bias and softplus in delta's dtype
    L = min(chunk_size, max(p.length for p in mine))
    terms = _scan_pieces(u.to(cd), dt, A.to(cd), B.to(cd), C.to(cd), mine, L)
    n = A.shape[1]
    if world == 1:  # every piece is a whole document: nothing enters it, it leaves its final state
        y, final = _outputs(terms, [None] * len(mine), mine, L), terms.s_ext
    else:
        pack = torch.stack([torch.cat([s, t], -1) for s, t in zip(terms.s_ext, terms.trans)])
        every = all_gather(pack, coll)  # (world, pieces, b, d, 2n); every rank takes part
        last = [p for p in order if p.chunk == p.chunks - 1]  # each document's last piece
        needed = {(p.doc, p.chunk) for p in mine if not p.first}
        needed |= {(p.doc, p.chunk) for p in last} if return_last_state else set()
        entering, leaving = compose_in_order(
            order, lambda p: (every[p.owner, p.slot, ..., n:], every[p.owner, p.slot, ..., :n]), torch.mul, needed)
        y = _outputs(terms, [None if p.first else entering[(p.doc, p.chunk)] for p in mine], mine, L)
        y = join_exchange(y, every)
        final = [leaving[(p.doc, p.chunk)] for p in last] if return_last_state else None
    # D and the gate after the correction; y's dtype is transformers' (u's, promoted with D's and z's).
    out_dtype = u.dtype
    if D is not None:
        y, out_dtype = y + u.to(cd) * D.to(cd)[:, None], torch.promote_types(out_dtype, D.dtype)
    if z is not None:
        y, out_dtype = y * F.silu(z.to(cd)), torch.promote_types(out_dtype, z.dtype)
    if not return_last_state:
        return y.to(out_dtype), None
    final = torch.stack(final)  # (docs, b, d, n)
    return y.to(out_dtype), (final[0] if local_doc_lens is None else final.transpose(0, 1))


def context_parallel_selective_scan(
    u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
    D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None, delta_bias: Optional[torch.Tensor] = None,
    delta_softplus: bool = False, return_last_state: bool = False, group: Optional[dist.ProcessGroup] = None,
    layout: str = "zigzag", local_doc_lens: Optional[Sequence[int]] = None, chunk_size: int = 64,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The Mamba-1 selective scan over a sequence sharded across ``group``; exact,
    differentiable (transformers' ``mamba_selective_scan``, also Falcon-Mamba's and Jamba's).

    Args:
        u: ``(batch, d_inner, local_seq)``, channels first: this rank's shard in ``layout``.
        delta: ``(batch, d_inner, local_seq)``, the time steps (before ``delta_bias`` and
            softplus).
        A: ``(d_inner, d_state)``, negative (Mamba's ``-exp(A_log)``).
        B, C: ``(batch, d_state, local_seq)``.
        D: ``(d_inner,)`` or None: the skip, ``y += D u``.
        z: ``(batch, d_inner, local_seq)`` or None: the gate, ``y *= silu(z)``.
        delta_bias: ``(d_inner,)`` or None, added to ``delta`` (in delta's dtype).
        delta_softplus: apply softplus to ``delta`` (after the bias).
        return_last_state: also return the state leaving each row (document).
        group: the context-parallel group (None: the active state's CP group, else the
            default group, or one process when torch.distributed is not initialised).
        layout: ``"zigzag"`` or ``"contiguous"``; ``"stripe"`` is refused (one-token pieces
            would each need a state).
        local_doc_lens: a packed row's documents, each one's local length (every document
            zigzag-sharded on its own); no state crosses a document boundary. None: dense.
        chunk_size: tokens per chunk of the scan (the result does not depend on it).
        Any float dtypes; the scan runs in float32 (float64 when u, delta, A, B or C is).

    Returns:
        ``(y, last_state)``: y ``(batch, d_inner, local_seq)`` in u's dtype promoted with D's
        and z's (as transformers; its Mamba layers pass D in float32 and cast y back);
        last_state None, or in the scan's dtype, the same on every rank: ``(batch, d_inner,
        d_state)``, packed ``(batch, n_docs, d_inner, d_state)``.
    """
    group = resolve_cp_group(group, "hf_ring.mixers.context_parallel_selective_scan")
    _, world = group_coords(group)
    coll = GroupCollectives(group) if world > 1 else None
    return selective_scan_op(u, delta, A, B, C, coll, layout, local_doc_lens, D, z, delta_bias, delta_softplus,
                             return_last_state, chunk_size)


__all__ = ["context_parallel_selective_scan", "selective_scan_op"]
