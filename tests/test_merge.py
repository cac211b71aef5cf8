"""The (out, lse) merge against attention computed over the union of two key blocks.

Splitting the keys of one attention call into blocks A and B and merging the two partial
results must give the result over all keys: out and lse within 1e-12 (float64: the merge
is a few exp/log/lerp operations per element). Rows where a block sees no key (lse -inf)
and rows where neither does (both -inf: out 0, lse -inf, no NaN) are included, and the
accumulators may be strided views, as the ring passes them.
"""

from __future__ import annotations

import torch

from hf_ring.patterns.ring.merge import merge_block_
import pytest

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)


def _attend(q, k, v, mask):
    """q (b, s, h, d), k/v (b, t, h, d), mask (s, t) bool -> out (b, s, h, d), lse (b, h, s); float64."""
    scores = torch.einsum("bshd,bthd->bhst", q, k).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhst,bthd->bshd", p, v), lse


def test_merge_equals_attention_over_both_blocks():
    g = torch.Generator().manual_seed(0)
    b, s, h, d, ta, tb = 2, 6, 3, 8, 5, 4
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, ta + tb, h, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, ta + tb, h, d, generator=g, dtype=torch.float64)
    mask = torch.rand(s, ta + tb, generator=g) < 0.6
    mask[0, :ta] = False  # row 0 sees nothing in block A
    mask[1, ta:] = False  # row 1 sees nothing in block B
    mask[2, :] = False  # row 2 sees no key at all
    want_out, want_lse = _attend(q, k, v, mask)
    out_a, lse_a = _attend(q, k[:, :ta], v[:, :ta], mask[:, :ta])
    out_b, lse_b = _attend(q, k[:, ta:], v[:, ta:], mask[:, ta:])
    # Strided accumulators: a slice of larger buffers, as the ring merges query blocks.
    big_out = torch.zeros(b, s + 2, h, d, dtype=torch.float64)
    big_lse = torch.zeros(b, h, s + 2, dtype=torch.float64)
    big_out[:, 1 : s + 1] = out_a
    big_lse[:, :, 1 : s + 1] = lse_a
    merge_block_(big_out[:, 1 : s + 1], big_lse[:, :, 1 : s + 1], out_b, lse_b)
    got_out, got_lse = big_out[:, 1 : s + 1], big_lse[:, :, 1 : s + 1]
    assert not got_out.isnan().any()
    torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-12)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(got_lse), finite)
    torch.testing.assert_close(got_lse[finite], want_lse[finite], rtol=1e-12, atol=1e-12)
    assert torch.equal(got_out[:, 2], torch.zeros_like(got_out[:, 2]))
    assert torch.equal(big_lse[:, :, 0], torch.zeros(b, h, dtype=torch.float64))  # neighbours untouched
