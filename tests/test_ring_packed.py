"""Packed rows under the ring: documents of uneven lengths, each zigzag-sharded on its own,
against float64 attention computed document by document.

Each document is padded at its end to a multiple of 2 * cp_size (as the collator does).
Padding sits after the document's real tokens, so under the causal mask no real query
sees it, and the padding rows get a zero output gradient (their labels are ignored), so
real tokens' out, lse and gradients must match the reference on the unpadded documents.
Tolerance 1e-5 relative for float32 inputs, as for dense rows.
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from distributed import run_world
from hf_ring.sharding import shard_packed, unshard_packed
from reference_attention import full_attention, rel_err

REAL_LENS = (13, 3, 22, 7)  # includes one document shorter than 2 * cp_size
HQ, HK, D = 8, 2, 64


def _layout(world: int):
    """Padded global boundaries, and the positions of real tokens in the padded row."""
    multiple = 2 * world
    padded = [-(-n // multiple) * multiple for n in REAL_LENS]
    cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    real = torch.cat([torch.arange(n) + int(cu[i]) for i, n in enumerate(REAL_LENS)])
    return cu, real


def _inputs(world: int):
    cu, real = _layout(world)
    total = int(cu[-1])
    g = torch.Generator().manual_seed(7)
    q = torch.randn(total, HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(total, HK, D, generator=g, dtype=torch.float64)
    v = torch.randn(total, HK, D, generator=g, dtype=torch.float64)
    dout = torch.zeros(total, HQ, D, dtype=torch.float64)
    dout[real] = torch.randn(real.numel(), HQ, D, generator=g, dtype=torch.float64)
    return cu, real, q, k, v, dout


def _rank_results(rank: int, world: int) -> dict:
    cu, _, q, k, v, dout = _inputs(world)
    shard = lambda t: shard_packed(t, cu, world, rank, dim=0)
    ql, kl, vl = (shard(t).float().requires_grad_() for t in (q, k, v))
    out, lse = hf_ring.ring_flash_attn_varlen_func(ql, kl, vl, cu, return_lse=True)
    out.backward(shard(dout).float())
    return {"out": out, "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}


def _per_document_reference(q, k, v, dout, cu, real):
    """Float64 attention on each unpadded document separately, scattered back."""
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for i, n in enumerate(REAL_LENS):
        idx = torch.arange(n) + int(cu[i])
        qd, kd, vd = (t[idx].unsqueeze(0).clone().requires_grad_() for t in (q, k, v))
        o, l = full_attention(qd, kd, vd, causal=True)
        o.backward(dout[idx].unsqueeze(0))
        out[idx], lse[:, idx] = o.detach()[0], l[0]
        for g, t in zip(grads, (qd, kd, vd)):
            g[idx] = t.grad[0]
    return {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_packed_ring_matches_per_document_attention(world):
    cu, real, q, k, v, dout = _inputs(world)
    ref = _per_document_reference(q, k, v, dout, cu, real)
    if world == 1:
        per_rank = [_rank_results(0, 1)]
    else:
        per_rank = run_world(world, _rank_results)
    for name in ref:
        dim = 1 if name == "lse" else 0
        full = unshard_packed([r[name] for r in per_rank], cu, dim=dim)
        got, want = full.index_select(dim, real), ref[name].index_select(dim, real)
        assert rel_err(got, want) <= 1e-5, (name, rel_err(got, want))


def test_varlen_input_errors():
    q = torch.randn(8, 4, 16)
    with pytest.raises(ValueError, match="total_local, n_heads, head_dim"):
        hf_ring.ring_flash_attn_varlen_func(q.unsqueeze(0), q.unsqueeze(0), q.unsqueeze(0), torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="q holds 8 local tokens"):
        hf_ring.ring_flash_attn_varlen_func(q, q, q, torch.tensor([0, 6]))
