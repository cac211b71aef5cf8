"""Attention sinks (one extra logit per query head in every row's softmax, GPT-OSS's
``s_aux``) through the ring: out, dq, dk, dv and the sinks' gradient against float64
attention with the sink written out (a column appended to the scores), in one process
and on a gloo world of 2 (zigzag and stripe), causal, GQA 4/2.

The sinks' gradient is per rank the part from its own rows; summed over the ranks it
must equal the full-sequence gradient. float32 inputs: 1e-5 relative (the ring's
float32 accumulation against float64; measured ~1e-7).
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from distributed import run_world
from closeness import rel_err

B, S, HQ, HK, D = 2, 16, 4, 2, 16
TOL = 1e-5


def _inputs():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, S, HQ, D, generator=g)
    k = torch.randn(B, S, HK, D, generator=g)
    v = torch.randn(B, S, HK, D, generator=g)
    dout = torch.randn(B, S, HQ, D, generator=g)
    sinks = torch.randn(HQ, generator=g) * 2
    return q, k, v, dout, sinks


def _reference(q, k, v, dout, sinks):
    """float64, written out: causal scores, a sink column, softmax, drop the column."""
    q, k, v, sinks = (t.double().requires_grad_() for t in (q, k, v, sinks))
    kr, vr = (t.repeat_interleave(HQ // HK, dim=2) for t in (k, v))
    scores = torch.einsum("bshd,bthd->bhst", q, kr) / D**0.5
    scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    with_sink = torch.cat([scores, sinks.view(1, HQ, 1, 1).expand(B, HQ, S, 1)], dim=-1)
    probs = torch.softmax(with_sink, dim=-1)[..., :-1]
    out = torch.einsum("bhst,bthd->bshd", probs, vr)
    out.backward(dout.double())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "dsinks": sinks.grad}


def _ring(rank: int, world: int, layout: str) -> dict:
    q, k, v, dout, sinks = _inputs()
    shard = lambda t: hf_ring.shard_sequence(t, world, rank, layout=layout)  # noqa: E731
    q, k, v = (shard(t).requires_grad_() for t in (q, k, v))
    sinks = sinks.clone().requires_grad_()
    out = hf_ring.ring_flash_attn_func(q, k, v, layout=layout, sinks=sinks)
    out.backward(shard(dout))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "dsinks": sinks.grad}


def _check(results: list[dict], layout: str) -> None:
    want = _reference(*_inputs())
    join = lambda name: hf_ring.unshard_sequence([r[name] for r in results], layout=layout)  # noqa: E731
    for name in ("out", "dq", "dk", "dv"):
        assert rel_err(join(name), want[name]) < TOL, name
    assert rel_err(sum(r["dsinks"] for r in results), want["dsinks"]) < TOL


def test_sinks_one_process():
    _check([_ring(0, 1, "zigzag")], "zigzag")


@pytest.mark.parametrize("layout", ["zigzag", "stripe"])
def test_sinks_through_the_ring(layout):
    _check(run_world(2, _ring, layout), layout)


def test_sinks_of_the_wrong_shape_are_refused():
    q, k, v, _, _ = _inputs()
    with pytest.raises(ValueError, match=r"sinks must be a float tensor of shape \(n_heads,\)"):
        hf_ring.ring_flash_attn_func(q, k, v, sinks=torch.zeros(HK))
