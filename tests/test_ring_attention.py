"""The ring op against float64 attention over the full sequence, on gloo worlds of 2-4.

Tolerances: float32 inputs within 1e-5 relative error (norm of the difference over norm
of the reference): the ring reorders the float32 softmax sums, which costs a few ulps per
merge, far below 1e-5. bfloat16 inputs within twice the error that single-process
bfloat16 SDPA makes against the same reference: the ring may not be much worse than what
a user already gets without it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import hf_ring
from distributed import run_world
from closeness import rel_err
from reference_attention import full_attention

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

LAYOUTS = ("zigzag", "stripe", "contiguous")
HEADS = ((8, 8), (8, 2))  # MHA, GQA
HEAD_DIMS = (64, 128)
CHUNK = 5  # tokens per zigzag chunk: sequence lengths 10 * cp_size, not powers of two
BATCH = 2


def _inputs(seq: int, hq: int, hk: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, seq, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(BATCH, seq, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(BATCH, seq, hk, d, generator=g, dtype=torch.float64)
    dout = torch.randn(BATCH, seq, hq, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _reference(q, k, v, dout, causal):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = full_attention(q, k, v, causal)
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def _bf16_sdpa_errors(q, k, v, dout, causal, ref):
    """Relative errors of single-process bfloat16 SDPA (out, dq, dk, dv) vs the reference."""
    group = q.shape[2] // k.shape[2]
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        qb.transpose(1, 2),
        kb.repeat_interleave(group, 2).transpose(1, 2),
        vb.repeat_interleave(group, 2).transpose(1, 2),
        is_causal=causal,
    ).transpose(1, 2)
    out.backward(dout.bfloat16())
    # SDPA's own CPU flash kernel on the same bf16 inputs gives the lse it computes.
    _, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qb.detach().transpose(1, 2),
        kb.detach().repeat_interleave(group, 2).transpose(1, 2),
        vb.detach().repeat_interleave(group, 2).transpose(1, 2),
        0.0,
        causal,
    )
    return {
        "lse": rel_err(lse, ref[1]),
        "out": rel_err(out, ref[0]),
        "dq": rel_err(qb.grad, ref[2]),
        "dk": rel_err(kb.grad, ref[3]),
        "dv": rel_err(vb.grad, ref[4]),
    }


def _cases():
    return list(itertools.product(LAYOUTS, (True, False), HEADS, HEAD_DIMS, (torch.float32, torch.bfloat16)))


def _ring_shards(rank: int, world: int) -> list[dict]:
    """This rank's out, lse, dq, dk, dv for every case, from its shard of the inputs."""
    seq = 2 * world * CHUNK
    results = []
    for i, (layout, causal, (hq, hk), d, dtype) in enumerate(_cases()):
        q, k, v, dout = _inputs(seq, hq, hk, d, seed=1000 + i)
        shard = lambda t: hf_ring.shard_sequence(t, world, rank, dim=1, layout=layout)
        ql, kl, vl = (shard(t).to(dtype).requires_grad_() for t in (q, k, v))
        out, lse = hf_ring.ring_flash_attn_func(ql, kl, vl, causal=causal, layout=layout, return_lse=True)
        out.backward(shard(dout).to(dtype))
        results.append({"out": out, "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad})
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_full_attention(world):
    per_rank = run_world(world, _ring_shards)
    seq = 2 * world * CHUNK
    failures = []
    for i, case in enumerate(_cases()):
        layout, causal, (hq, hk), d, dtype = case
        q, k, v, dout = _inputs(seq, hq, hk, d, seed=1000 + i)
        ref = dict(zip(("out", "lse", "dq", "dk", "dv"), _reference(q, k, v, dout, causal)))
        bf16_sdpa = _bf16_sdpa_errors(q, k, v, dout, causal, tuple(ref.values()))
        for name in ref:
            dim = 2 if name == "lse" else 1
            shards = [per_rank[r][i][name] for r in range(world)]
            want_dtype = torch.float32 if name == "lse" else dtype
            assert all(t.dtype == want_dtype for t in shards), (case, name, [t.dtype for t in shards])
            full = hf_ring.unshard_sequence(shards, dim=dim, layout=layout)
            tol = 1e-5 if dtype == torch.float32 else 2 * bf16_sdpa[name]
            err = rel_err(full, ref[name])
            if not err <= tol:
                failures.append(f"{case} {name}: rel err {err:.3g} > tol {tol:.3g}")
    assert not failures, "\n".join(failures)
