"""Merging partial attention results with an online softmax.

Attention of a query row over keys split into blocks A and B is recovered exactly from
each block's normalised output and log-sum-exp:

    lse = log(exp(lse_A) + exp(lse_B))
    out = exp(lse_A - lse) * out_A + exp(lse_B - lse) * out_B

Both weights are <= 1, so the update never overflows. A row that has seen no key yet has
``lse = -inf`` and contributes weight 0; a row that sees no key at all ends with
``out = 0, lse = -inf``.

A sink (one more logit per head whose value vector is zero) is merged the same way, once,
into the final out and lse (:func:`apply_sinks`), with its gradient from those
(:func:`sinks_grad`).
"""

from __future__ import annotations

import torch


def merge_block_(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold one block's result into the accumulators, in place.

    Written as ``lse += log(1 + exp(lse_B - lse))`` (``logaddexp``, in place) and
    ``out = lerp(out, out_B, exp(lse_B - lse_new))``: five small ops on the lse and one
    pass over ``out``. A row whose new lse is still -inf (no key seen yet, none in this
    block) gets weight 0, not ``exp(-inf - -inf) = nan``.

    Args:
        out_acc: ``(batch, q_len, n_heads, head_dim)`` float32 (float64) accumulator;
            may be a view into a larger accumulator.
        lse_acc: ``(batch, n_heads, q_len)`` same dtype as ``out_acc``; may be a view.
        block_out: ``(batch, q_len, n_heads, head_dim)``, any float dtype.
        block_lse: ``(batch, n_heads, q_len)``, any float dtype.
    """
    block_lse = block_lse.to(lse_acc.dtype)
    torch.logaddexp(lse_acc, block_lse, out=lse_acc)
    w_new = torch.exp(block_lse - lse_acc).nan_to_num_(0.0)  # (b, h, q)
    out_acc.lerp_(block_out.to(out_acc.dtype), w_new.transpose(1, 2).unsqueeze(-1))


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with one more logit per head, the sink, in every row's softmax: its value
    vector is zero, so it only rescales the rows and raises their lse.

    Args:
        out: ``(b, s, h, d)``, attention over the real keys, accumulation dtype.
        lse: ``(b, h, s)``, its log-sum-exp.
        sinks: ``(h,)``, one logit per query head (GPT-OSS's ``s_aux``).

    Returns:
        ``out * exp(lse - lse_s)`` and ``lse_s = logaddexp(lse, sink)``: the final out and
        lse, with which the ring's backward gives exact dq, dk, dv.
    """
    lse_s = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    return out * torch.exp(lse - lse_s).transpose(1, 2).unsqueeze(-1), lse_s


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks ``(h,)`` from this rank's rows: the sink's probability is
    ``p = exp(sink - lse)`` and ``d out / d sink = -p * out``, so the gradient is
    ``-sum over rows of p * (dout . out)``; the final ``out`` ``(b, s, h, d)`` and ``lse``
    ``(b, h, s)`` include the sink."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # (b, h, s)
    p_sink = torch.exp(sinks.to(acc).view(1, -1, 1) - lse)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
