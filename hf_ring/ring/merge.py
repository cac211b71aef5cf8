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

    Args:
        out_acc: ``(batch, q_len, n_heads, head_dim)`` float32 (float64) accumulator;
            may be a view into a larger accumulator.
        lse_acc: ``(batch, n_heads, q_len)`` same dtype as ``out_acc``; may be a view.
        block_out: ``(batch, q_len, n_heads, head_dim)``, any float dtype.
        block_lse: ``(batch, n_heads, q_len)``, any float dtype.
    """
    block_lse = block_lse.to(lse_acc.dtype)
    new_lse = torch.logaddexp(lse_acc, block_lse)
    # Rows where both are -inf: keep weights finite (0) instead of exp(-inf - -inf) = nan.
    ref = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(lse_acc - ref).transpose(1, 2).unsqueeze(-1)  # (b, q, h, 1)
    w_new = torch.exp(block_lse - ref).transpose(1, 2).unsqueeze(-1)
    out_acc.mul_(w_old).addcmul_(block_out.to(out_acc.dtype), w_new)
    lse_acc.copy_(new_lse)
