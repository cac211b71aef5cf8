"""The CPU block kernels (``reference``, the definition every other backend is checked
against, and ``torch_cpu_flash``) against an attention written independently of hf_ring
(``reference_attention.block_attention``: plain scores -> mask -> softmax -> weighted sum
in float64, gradients by autograd).

Covered: forward out and lse, backward dq/dk/dv given the final out and lse, causal
(square) and non-causal blocks with q_len != k_len, MHA, GQA (8 query / 2 KV heads) and
MQA, block gradients summed over a ring-like split of the sequence, and rows that see no
key.

Tolerances, on norm(x - ref) / norm(ref):
- float64 inputs: 1e-10. Both sides compute in float64 (eps 1.1e-16) over at most a few
  dozen terms per sum; what separates them is rounding order, ~1e-15.
- float32 inputs: 1e-5. The kernels accumulate in float32 (eps 6e-8): each entry of out
  or a gradient is a sum of up to k_len * head_dim rounded products, so the norm-wise
  error is a few 1e-7 (measured below 5e-7 here). 1e-5 leaves that a margin of 20 and is
  still 1000 times below a 1% error, which must fail.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_ring.kernels import get_backend
from closeness import rel_err
from reference_attention import block_attention, block_attention_grads

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
CPU = torch.device("cpu")
BACKENDS = ("reference", "torch_cpu_flash")
HEADS = [(8, 2), (4, 4), (4, 1)]
# (causal, q_len, k_len): causal blocks are square, as the ring asks; non-causal ones are
# not, and neither length is a multiple of a typical tile.
SHAPES = [(True, 12, 12), (False, 7, 11)]
DTYPES = {"float64": torch.float64, "float32": torch.float32}
CASES = [
    pytest.param(name, dtype, heads, causal, sq, sk,
                 id=f"{name}-{dtype_name}-{heads[0]}x{heads[1]}-{'causal' if causal else 'full'}")
    for name in BACKENDS for dtype_name, dtype in DTYPES.items() for heads in HEADS for causal, sq, sk in SHAPES
]


def _inputs(hq: int, hk: int, sq: int, sk: int, dtype: torch.dtype, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(2, sq, hq, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, sk, hk, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    return q, k, v, dout, 1 / math.sqrt(d)


@pytest.mark.parametrize("name,dtype,heads,causal,sq,sk", CASES)
def test_forward_matches_independent_attention(name, dtype, heads, causal, sq, sk):
    q, k, v, _, scale = _inputs(*heads, sq, sk, dtype)
    out, lse = get_backend(name, CPU, dtype).forward(q, k, v, causal, scale)
    want_out, want_lse = block_attention(q, k, v, causal, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, heads[0], sq) and lse.dtype == dtype  # float32 or float64, never lower
    assert rel_err(out, want_out) <= TOL[dtype], rel_err(out, want_out)
    assert rel_err(lse, want_lse) <= TOL[dtype], rel_err(lse, want_lse)


@pytest.mark.parametrize("name,dtype,heads,causal,sq,sk", CASES)
def test_backward_matches_autograd(name, dtype, heads, causal, sq, sk):
    q, k, v, dout, scale = _inputs(*heads, sq, sk, dtype)
    out, lse = block_attention(q, k, v, causal, scale)
    # The ring hands the backward the merged out and lse: float32 for float32 inputs.
    out, lse = out.to(dtype), lse.to(dtype)
    grads = get_backend(name, CPU, dtype).backward(dout, q, k, v, out, lse, causal, scale)
    for what, got, want, like in zip("qkv", grads, block_attention_grads(dout, q, k, v, causal, scale), (q, k, v)):
        assert got.shape == like.shape, what
        assert rel_err(got, want) <= TOL[dtype], (what, rel_err(got, want))


@pytest.mark.parametrize("name", BACKENDS)
def test_block_gradients_sum_to_the_full_gradient(name):
    """Causal attention over 2 x 2 blocks, as a ring of two computes it: diagonal blocks
    causal and square, the lower off-diagonal one non-causal, each block's backward given
    the final out and lse of the whole sequence. The block gradients must add up to the
    gradient of the whole attention."""
    q, k, v, dout, scale = _inputs(8, 2, 16, 16, torch.float64)
    out, lse = block_attention(q, k, v, True, scale)
    backend = get_backend(name, CPU, torch.float64)
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    halves = (slice(0, 8), slice(8, 16))
    for (qi, ki, causal) in ((0, 0, True), (1, 0, False), (1, 1, True)):
        qs, ks = halves[qi], halves[ki]
        bdq, bdk, bdv = backend.backward(dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs],
                                         lse[:, :, qs], causal, scale)
        dq[:, qs] += bdq
        dk[:, ks] += bdk
        dv[:, ks] += bdv
    for what, got, want in zip("qkv", (dq, dk, dv), block_attention_grads(dout, q, k, v, True, scale)):
        assert rel_err(got, want) <= TOL[torch.float64], (what, rel_err(got, want))


def test_rows_that_see_no_key():
    """A block with no keys: every query row is fully masked. Its out is 0 and its lse
    -inf, so it adds nothing when merged, and its backward gives zero dq."""
    q, k, v, dout, scale = _inputs(8, 2, 5, 0, torch.float64)
    backend = get_backend("reference", CPU, torch.float64)
    out, lse = backend.forward(q, k, v, False, scale)
    want_out, want_lse = block_attention(q, k, v, False, scale)
    assert torch.equal(out, torch.zeros_like(q)) and torch.equal(want_out, out)
    assert torch.isneginf(lse).all() and torch.isneginf(want_lse).all()
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, False, scale)
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == k.shape and dv.shape == v.shape
