"""Value heads of another size than q/k's (multi-head latent attention): every kernel runs
them on zero-padded heads (hf_ring.kernels.value_heads), exactly. Checked here on one
process against float64 SDPA, which takes any value head size; the patterns over spawned
worlds are checked in tests/test_cp_patterns.py (its ``_mla`` cases).

Float64 inputs: padding adds exact zeros, so the results agree with SDPA to rounding
(1e-12 leaves three orders of magnitude over the ~1e-15 measured).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hf_ring
from hf_ring.kernels import get_backend
from hf_ring.kernels.value_heads import with_value_head_dim

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

CPU = torch.device("cpu")
TOL = 1e-12


def _sdpa(q, k, v, causal=True, mask=None, scale=0.3):
    """Float64 reference, (b, s, h, d) in and out, GQA by repetition."""
    group = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt, vt = (t.repeat_interleave(group, 2).transpose(1, 2) for t in (k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal and mask is None,
                                          scale=scale).transpose(1, 2)


def _leaves(dk: int, dv: int, seq: int = 12):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, seq, 4, dk, generator=g, dtype=torch.float64)
    k = torch.randn(2, seq, 2, dk, generator=g, dtype=torch.float64)
    v = torch.randn(2, seq, 2, dv, generator=g, dtype=torch.float64)
    return q, k, v, torch.randn(2, seq, 4, dv, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("name", ["reference", "torch_cpu_flash"])
@pytest.mark.parametrize("dk, dv", [(12, 8), (8, 12), (8, 8)])
@pytest.mark.parametrize("masked", [False, True])
def test_padded_kernels_are_exact(name, dk, dv, masked):
    backend = with_value_head_dim(get_backend(name, CPU, torch.float64), dk, dv)
    q, k, v, dout = _leaves(dk, dv)
    mask = torch.rand(12, 12, generator=torch.Generator().manual_seed(1)) < 0.7
    mask |= torch.eye(12, dtype=torch.bool)  # every row sees a key
    if masked:
        out, lse = backend.masked_forward(q, k, v, mask, 0.3)
        grads = backend.masked_backward(dout, q, k, v, out, lse, mask, 0.3)
    else:
        out, lse = backend.forward(q, k, v, True, 0.3)
        grads = backend.backward(dout, q, k, v, out, lse, True, 0.3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _sdpa(*leaves, mask=mask if masked else None)
    want_grads = torch.autograd.grad(want, leaves, dout)
    assert out.shape == want.shape and (out - want).abs().max() < TOL
    for got, ref in zip(grads, want_grads):
        assert got.shape == ref.shape and (got - ref).abs().max() < TOL


def test_same_size_heads_keep_the_kernel_itself():
    backend = get_backend("reference", CPU, torch.float64)
    assert with_value_head_dim(backend, 8, 8) is backend


@pytest.mark.parametrize("backend", ["reference", "torch_cpu_flash"])
def test_packed_rows_with_narrow_value_heads_are_exact(backend):
    g = torch.Generator().manual_seed(5)
    cu = [0, 8, 20, 24]
    q = torch.randn(24, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(24, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(24, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    out = hf_ring.ring_flash_attn_varlen_func(q, k, v, cu, backend=backend, softmax_scale=0.3)
    want = torch.cat([_sdpa(q[None, a:b], k[None, a:b], v[None, a:b])[0] for a, b in zip(cu[:-1], cu[1:])])
    assert (out - want).abs().max() < TOL
    for got, ref in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        assert (got - ref).abs().max() < TOL


def test_a_padded_width_over_the_kernels_limit_is_refused():
    from hf_ring.kernels.cuda.torch_cudnn import TORCH_CUDNN

    with pytest.raises(NotImplementedError, match="heads of at most 128.*padded to 192"):
        with_value_head_dim(TORCH_CUDNN, 192, 128)
