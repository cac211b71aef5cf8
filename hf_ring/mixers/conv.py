"""Context-parallel causal depthwise conv1d: what transformers' hybrid models compute with
``causal_conv1d_fn`` (Mamba-2, Bamba, Granite 4.0 hybrid, Nemotron-H, Falcon-H1, Zamba2,
Qwen3-Next and Qwen3.5's gated delta nets, Kimi Linear, LFM2), exact under context
parallelism, forward and backward.

Convention, the one of ``causal_conv1d_fn`` (and the ``causal-conv1d`` package): ``x`` is
``(batch, channels, seq)`` (the models transpose their ``(batch, seq, channels)`` hidden
states before the call), ``weight`` ``(channels, width)`` (an ``nn.Conv1d(groups=channels)``
weight with its middle dimension squeezed), ``bias`` ``(channels,)``; for every channel c,

    y[c, t] = act(bias[c] + sum_{j=0}^{width-1} weight[c, j] * x[c, t - (width - 1) + j])

with ``x`` zero before the start of the sequence or of the token's document (packed rows),
and ``act`` the identity or SiLU, applied after the bias.

Under context parallelism each rank holds pieces (:func:`hf_ring.sharding.pieces.row_pieces`)
and each piece needs the ``width - 1`` inputs before it: they travel in one all-gather per
call (:mod:`hf_ring.mixers.halo`), whose size does not depend on the sequence length, and
their gradient comes back in one reduce-scatter.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_ring.distributed.active import resolve_cp_group
from hf_ring.distributed.collectives import Collectives, GroupCollectives
from hf_ring.mixers.halo import add_tail_grads, piece_halos, piece_tails
from hf_ring.sharding.pieces import RUN_LAYOUTS, Piece, row_pieces

# transformers' hybrids pass their config's hidden_act ("silu") or nothing (LFM2).
CONV_ACTIVATIONS = (None, "silu", "swish")


def _conv_pieces(xc: torch.Tensor, wc: torch.Tensor, bc: Optional[torch.Tensor], activation: Optional[str],
                 halos: list[torch.Tensor], mine: list[Piece]) -> torch.Tensor:
    """The conv of this rank's pieces given their halos, all in one dtype.

    ``xc`` ``(batch, channels, local_seq)``, ``wc`` ``(channels, width)``, ``bc``
    ``(channels,)`` or None, ``halos`` one ``(batch, channels, width - 1)`` per piece ->
    ``(batch, channels, local_seq)``.
    """
    halo = wc.shape[-1] - 1
    # One convolution over [halo_0, piece_0, halo_1, piece_1, ...] without padding: output i
    # reads extended inputs i .. i + halo, so piece s's outputs start where its halo starts,
    # at local_start + s * halo, and nothing mixes across pieces.
    ext = torch.cat([t for p, h in zip(mine, halos)
                     for t in (h, xc[..., p.local_start:p.local_start + p.length])], dim=-1)
    y_ext = F.conv1d(ext, wc.unsqueeze(1), bc, groups=xc.shape[1])  # (batch, channels, local_seq + (n-1)*halo)
    y = torch.cat([y_ext[..., p.local_start + s * halo:p.local_start + s * halo + p.length]
                   for s, p in enumerate(mine)], dim=-1)  # (batch, channels, local_seq)
    return y if activation is None else F.silu(y)


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    # float32 at least (float64 stays float64): the sums over the width and the weight's
    # gradient, a sum over every token, run in it; the output returns to x's dtype.
    return torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)


class _HaloConv1d(torch.autograd.Function):
    """The op over a group of more than one rank. Its own backward, rather than autograd
    through the all-gather, so that every rank runs the reduce-scatter: a rank whose halos
    are all zeros (contiguous rank 0) would otherwise leave the others waiting in it."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation, pieces, coll):
        compute = _compute_dtype(x, weight)
        xc, halo, mine = x.to(compute), weight.shape[-1] - 1, pieces[coll.rank]
        # Tails travel in the compute dtype, so the halo's gradient is summed in it too.
        gathered = coll.all_gather(piece_tails(xc, mine, halo))  # (world, n, batch, channels, halo)
        halos = piece_halos(gathered, pieces, coll.rank, halo)
        y = _conv_pieces(xc, weight.to(compute), None if bias is None else bias.to(compute), activation, halos, mine)
        # Kept: x and the small tails; the backward recomputes the cheap depthwise conv.
        ctx.save_for_backward(x, weight, bias, gathered)
        ctx.activation, ctx.pieces, ctx.coll = activation, pieces, coll
        return y.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, bias, gathered = ctx.saved_tensors
        compute, coll, halo = gathered.dtype, ctx.coll, weight.shape[-1] - 1
        mine = ctx.pieces[coll.rank]
        with torch.enable_grad():
            leaves = [t.detach().to(compute).requires_grad_() for t in (x, gathered, weight)]
            leaves += [] if bias is None else [bias.detach().to(compute).requires_grad_()]
            halos = piece_halos(leaves[1], ctx.pieces, coll.rank, halo)
            y = _conv_pieces(leaves[0], leaves[2], leaves[3] if bias is not None else None,
                             ctx.activation, halos, mine)
            grads = torch.autograd.grad(y, leaves, dy.to(compute), allow_unused=True)
        dx, d_gathered, dw = grads[0], grads[1], grads[2]
        if ctx.needs_input_grad[0]:  # the same on every rank: the model is the same
            if d_gathered is None:  # this rank read no halo, but the others wait for its share
                d_gathered = torch.zeros_like(gathered)
            add_tail_grads(dx, coll.reduce_scatter(d_gathered), mine, halo)  # (n, batch, channels, halo)
        return (dx.to(x.dtype) if ctx.needs_input_grad[0] else None, dw.to(weight.dtype),
                None if bias is None else grads[3].to(bias.dtype), None, None, None)


def causal_conv1d_pieces(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         activation: Optional[str], pieces: list[list[Piece]],
                         coll: Optional[Collectives]) -> torch.Tensor:
    """The op on already validated arguments (:func:`context_parallel_causal_conv1d` checks them).

    Args:
        x: ``(batch, channels, local_seq)``, any floating dtype.
        weight: ``(channels, width)``; bias: ``(channels,)`` or None.
        activation: one of :data:`CONV_ACTIVATIONS`.
        pieces: every rank's pieces of the row, ``pieces[rank][slot]`` (each row of the
            batch is cut the same way).
        coll: the context-parallel group's collectives (every rank of it must call this
            together, forward and backward); None for a world of one (no communication:
            every piece starts its document).

    Returns:
        ``(batch, channels, local_seq)`` in ``x``'s dtype. Differentiable in ``x``,
        ``weight`` and ``bias``; their gradients are in their own dtypes.
    """
    halo = weight.shape[-1] - 1
    if coll is not None and halo > 0:
        return _HaloConv1d.apply(x, weight, bias, activation, pieces, coll)
    # Nothing comes from another rank: plain autograd, each piece with a zero halo.
    compute = _compute_dtype(x, weight)
    xc = x.to(compute)
    mine = pieces[0 if coll is None else coll.rank]
    halos = [xc.new_zeros(x.shape[:2] + (halo,))] * len(mine)
    y = _conv_pieces(xc, weight.to(compute), None if bias is None else bias.to(compute), activation, halos, mine)
    return y.to(x.dtype)


def context_parallel_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    activation: Optional[str] = None,
    group: Optional[dist.ProcessGroup] = None,
    layout: str = "zigzag",
    local_doc_lens: Optional[Union[Sequence[int], torch.Tensor]] = None,
) -> torch.Tensor:
    """Causal depthwise conv1d of a context-parallel shard, exact as on the full sequence.

    Args:
        x: this rank's shard ``(batch, channels, local_seq)``, floating (bf16, fp16, fp32,
            fp64), sharded along the last dimension in ``layout`` (``hf_ring.shard_sequence``
            with ``dim=-1``; packed rows: ``hf_ring.sharding.shard_packed``). ``batch``,
            ``channels`` and ``local_seq`` must be the same on every rank of the group.
        weight: ``(channels, width)``, floating, ``width >= 1``.
        bias: ``(channels,)`` or None.
        activation: None, ``"silu"`` or ``"swish"`` (the same), applied after the bias.
        group: the context-parallel group; None means the active state's CP group, else
            the default group, or a world of one when torch.distributed is not initialised
            (a plain local causal conv).
        layout: ``"zigzag"`` or ``"contiguous"``; ``"stripe"`` is refused (one-token pieces).
        local_doc_lens: a packed row's documents, each one's local length (its global length
            over the group's size; every document zigzag-sharded on its own), ints summing to
            ``local_seq``, the same for every row of the batch; None for dense rows.

    Returns:
        ``(batch, channels, local_seq)`` in ``x``'s dtype, this rank's tokens of the output.

    Gradients: ``x``'s is exact (the halo's part is sent back to the rank holding those
    tokens). ``weight``'s and ``bias``'s are this rank's tokens' share, like any parameter
    under context parallelism: summed over the group (the gradient all-reduce of data
    parallel training over the dp x cp world does it) they are the full gradient.

    Communication, independent of the sequence length: one all-gather in the forward and
    one reduce-scatter in the backward; in each, every rank contributes its pieces' tails,
    ``pieces * batch * channels * (width - 1)`` elements (float32; float64 for float64
    inputs), ``pieces`` being 1 (contiguous) or 2 (zigzag) per document, and the all-gather
    hands every rank all ``world`` ranks' tails. None when the group has one rank or
    ``width == 1``. Pieces shorter than ``width - 1`` (few tokens per rank) are handled: a
    halo reads as many pieces back as it takes, on whichever ranks hold them.

    Raises:
        ValueError: shapes, dtypes, activation, layout or document lengths that do not fit;
            the message says what to pass instead.
    """
    docs = _check_args(x, weight, bias, activation, local_doc_lens)
    coll = _collectives(resolve_cp_group(group, "hf_ring.mixers.context_parallel_causal_conv1d"))
    local_len = x.shape[-1]
    if coll is None:
        pieces = [_local_pieces(layout, local_len, docs)]
    else:
        pieces = row_pieces(layout, coll.world, local_len, docs)
    return causal_conv1d_pieces(x, weight, bias, activation, pieces, coll)


def _collectives(group: Optional[dist.ProcessGroup]) -> Optional[GroupCollectives]:
    """The group's collectives, or None for a world of one (nothing to send)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    coll = GroupCollectives(group)
    if coll.rank < 0:
        raise ValueError("this process is not a member of the group passed as group=; pass the "
                         "context-parallel group this rank belongs to")
    return coll if coll.world > 1 else None


def _local_pieces(layout: str, local_len: int, docs: Optional[list[int]]) -> list[Piece]:
    """A world of one: each document is one piece that starts it (no halo from anywhere)."""
    if layout not in RUN_LAYOUTS or (docs is not None and layout != "zigzag"):
        # The same refusal as under context parallelism, so a setting that would fail at
        # cp > 1 fails at cp = 1 too (row_pieces raises it).
        row_pieces(layout, 1, local_len, docs)
    lens = docs if docs is not None else [local_len]
    if sum(lens) != local_len or any(n <= 0 for n in lens):
        raise ValueError(f"document local lengths {lens} do not make up {local_len} local tokens; "
                         "local_doc_lens must be positive and sum to x.shape[-1]")
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return [Piece(doc=i, chunk=0, chunks=1, owner=0, slot=i, local_start=s, length=n)
            for i, (s, n) in enumerate(zip(starts, lens))]


def _check_args(x, weight, bias, activation, local_doc_lens) -> Optional[list[int]]:
    """Validate the public arguments; returns ``local_doc_lens`` as ints (or None)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError(
            f"x must be a floating tensor (batch, channels, local_seq), got "
            f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}; models holding "
            "(batch, seq, channels) pass hidden_states.transpose(1, 2), as causal_conv1d_fn expects")
    if x.shape[-1] == 0:
        raise ValueError("x has no tokens (local_seq == 0); every rank must hold at least one token")
    channels = x.shape[1]
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise ValueError("weight must be a floating tensor (channels, width)")
    if weight.dim() == 3 and weight.shape[1] == 1:
        raise ValueError(f"weight has the nn.Conv1d shape {tuple(weight.shape)}; pass conv1d.weight.squeeze(1) "
                         "(channels, width), as the models do for causal_conv1d_fn")
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(f"weight must be (channels, width) = ({channels}, width >= 1) for x of shape "
                         f"{tuple(x.shape)}, got {tuple(weight.shape)}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (channels,)):
        raise ValueError(f"bias must be None or ({channels},), got "
                         f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"activation must be one of {CONV_ACTIVATIONS}, got {activation!r}; another "
                         "pointwise activation can be applied to the output of activation=None exactly")
    if local_doc_lens is None:
        return None
    if isinstance(local_doc_lens, torch.Tensor):
        if local_doc_lens.dim() != 1 or local_doc_lens.is_floating_point():
            raise ValueError("local_doc_lens must be a 1-d integer tensor or a sequence of ints")
        return [int(n) for n in local_doc_lens.tolist()]  # one host sync; pass ints to avoid it
    if not all(isinstance(n, int) for n in local_doc_lens) or len(local_doc_lens) == 0:
        raise ValueError(f"local_doc_lens must be a non-empty sequence of ints, got {local_doc_lens!r}")
    return list(local_doc_lens)


__all__ = ["CONV_ACTIVATIONS", "causal_conv1d_pieces", "context_parallel_causal_conv1d"]
