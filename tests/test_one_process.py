"""The ring of one process run as the reference runs it (hf_ring/patterns/ring/one_process.py).

A rank's whole documents under ``placement="by_length"`` and every call at ``cp_size == 1``
go through it. Checked here on one process, no group:

- against float64 attention computed independently of hf_ring, document by document
  (``reference_attention.feature_attention`` on each document alone, sinks included):
  out, lse and every gradient within 1e-5 relative in float32 (the CPU flash kernel's
  float32 accumulation over rows of a few hundred keys: errors of ~1e-7 observed);
- against the ring's own passes on the same plan (what ran before this path), bitwise in
  float32 and bfloat16 without sinks: the same kernel calls on the same rows, whose results
  the ring's first step takes as its accumulators unchanged; with sinks within 1e-6;
- the path taken (and only where it may be): mixed runs of equal documents, a dense batch
  of two, non-causal rows, a varlen kernel (one call forward, one backward); a window that
  cuts a document, or spans, send the plan to the ring's passes.
"""

from __future__ import annotations

import pytest
import torch

from hf_ring.kernels import AttentionBackend, get_backend
from hf_ring.kernels.reference import reference_backward, reference_forward
from hf_ring.patterns import AttentionPlan, run_plan
from hf_ring.patterns.ring.attention import ring_attention
from hf_ring.patterns.ring.one_process import one_process_calls
from backend_registry import registered
from closeness import rel_err
from reference_attention import feature_attention
from varlen_standin import counted, looped_varlen_backward, looped_varlen_forward

HQ, HK, D = 4, 2, 16
# Runs of equal documents between single ones: 3 x 8, then 12, then 2 x 4, then 20.
MIXED = (8, 8, 8, 12, 4, 4, 20)


def _plan(doc_lens, *, causal=True, backend="torch_cpu_flash", dtype=torch.float32, window=None):
    be = get_backend(backend, torch.device("cpu"), dtype)
    return AttentionPlan(group=None, rank=0, world=1, layout="zigzag", causal=causal, scale=D ** -0.5,
                         backend=be, local_doc_lens=doc_lens, window=window)


def _inputs(batch: int, seq: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(batch, seq, HQ, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(batch, seq, HK, D, generator=g).to(dtype) for _ in range(2))
    sinks = torch.randn(HQ, generator=g)
    return q, k, v, dout, sinks


def _run(fn, q, k, v, dout, sinks=None):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    s = sinks.detach().clone().requires_grad_() if sinks is not None else None
    out, lse = fn(*leaves, s)
    out.backward(dout)
    res = {"out": out.detach(), "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    if s is not None:
        res["dsinks"] = s.grad
    return res


def _per_document_reference(q, k, v, dout, doc_lens, causal, sinks=None) -> dict:
    """Float64, each document alone (packed row: batch 1), then side by side."""
    parts, start = [], 0
    for n in doc_lens:
        rows = slice(start, start + n)
        parts.append(feature_attention(q[:, rows], k[:, rows], v[:, rows], dout[:, rows], causal=causal,
                                       sinks=sinks))
        start += n
    ref = {name: torch.cat([p[name] for p in parts], dim=2 if name == "lse" else 1)
           for name in ("out", "lse", "dq", "dk", "dv")}
    if sinks is not None:
        ref["dsinks"] = sum(p["dsinks"] for p in parts)
    return ref


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_mixed_runs_equal_each_document_alone(causal, sinks):
    plan = _plan(MIXED, causal=causal)
    seq = sum(MIXED)
    assert one_process_calls(plan, seq) is not None
    q, k, v, dout, s = _inputs(1, seq)
    s = s if sinks else None
    got = _run(lambda *t: run_plan(*t[:3], plan, t[3]), q, k, v, dout, s)
    ref = _per_document_reference(q, k, v, dout, MIXED, causal, s)
    for name, want in ref.items():
        assert rel_err(got[name], want) < 1e-5, name
    ring = _run(lambda *t: ring_attention(*t[:3], plan, t[3]), q, k, v, dout, s)
    for name, want in ring.items():
        if sinks:
            assert rel_err(got[name], want) < 1e-6, name
        else:
            assert torch.equal(got[name], want), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_batch_equals_the_ring_passes(dtype):
    plan = _plan(None, dtype=dtype)
    q, k, v, dout, _ = _inputs(2, 24, dtype)
    assert one_process_calls(plan, 24) is not None
    got = _run(lambda *t: run_plan(*t[:3], plan), q, k, v, dout)
    ring = _run(lambda *t: ring_attention(*t[:3], plan), q, k, v, dout)
    for name in got:
        assert torch.equal(got[name], ring[name]), name
    assert got["out"].dtype == dtype and got["dk"].dtype == dtype


def test_varlen_kernel_one_call_each_way():
    calls = {"forward": 0, "backward": 0, "varlen_forward": 0, "varlen_backward": 0}
    standin = AttentionBackend(
        name="one_process_varlen_standin", description="reference with a looped varlen kernel, counted",
        forward=counted(calls, "forward", reference_forward), backward=counted(calls, "backward", reference_backward),
        devices=("cpu",), dtypes=(torch.float32,),
        varlen_forward=counted(calls, "varlen_forward", looped_varlen_forward),
        varlen_backward=counted(calls, "varlen_backward", looped_varlen_backward))
    with registered(standin):
        plan = _plan(MIXED, backend=standin.name)
        q, k, v, dout, _ = _inputs(1, sum(MIXED))
        got = _run(lambda *t: run_plan(*t[:3], plan), q, k, v, dout)
    assert calls == {"forward": 0, "backward": 0, "varlen_forward": 1, "varlen_backward": 1}
    ref = _per_document_reference(q, k, v, dout, MIXED, True)
    for name, want in ref.items():
        assert rel_err(got[name], want) < 1e-5, name


def test_window_cutting_a_document_runs_the_ring_passes():
    # The 20-token document is longer than the window: its diagonal is masked, so the
    # plan is not a tiling of whole documents; shorter windows than every document too.
    assert one_process_calls(_plan(MIXED, window=16), sum(MIXED)) is None
    # A window no document reaches cuts nothing.
    assert one_process_calls(_plan(MIXED, window=32), sum(MIXED)) is not None
    plan = _plan(MIXED, window=16)
    q, k, v, dout, _ = _inputs(1, sum(MIXED))
    got = _run(lambda *t: run_plan(*t[:3], plan), q, k, v, dout)
    parts, start = [], 0
    for n in MIXED:
        rows = slice(start, start + n)
        parts.append(feature_attention(q[:, rows], k[:, rows], v[:, rows], dout[:, rows], window=16))
        start += n
    for name in ("out", "dq", "dk", "dv"):
        assert rel_err(got[name], torch.cat([p[name] for p in parts], dim=1)) < 1e-5, name


def test_a_plan_over_several_ranks_is_never_taken():
    plan = AttentionPlan(group=None, rank=0, world=2, layout="zigzag", causal=True, scale=D ** -0.5,
                         backend=get_backend("torch_cpu_flash", torch.device("cpu"), torch.float32),
                         local_doc_lens=(4, 4), transport=object())
    assert one_process_calls(plan, 8) is None
