"""Merging partial attention results with an online softmax.

Attention of a query row over keys split into blocks A and B is recovered exactly from
each block's normalised output and log-sum-exp:

    lse = log(exp(lse_A) + exp(lse_B))
    out = exp(lse_A - lse) * out_A + exp(lse_B - lse) * out_B

Both weights are <= 1, so the update never overflows. A row that has seen no key yet has
``lse = -inf`` and contributes weight 0; a row that sees no key at all ends with
``out = 0, lse = -inf``.
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
