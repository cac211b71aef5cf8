"""Bidirectional spans (Gemma 3's image tokens) under every pattern, against float64
attention over the full sequence with transformers' mask written out
(``window AND (causal OR same block)``, tests/reference_attention.py), forward and the
gradients of q, k and v, on spawned gloo worlds of 2 and 4 (one world runs every case).

The spans are placed to cut the layouts' chunk boundaries (32 tokens: zigzag chunks of 8
at cp=2, of 4 at cp=4), to lie on one rank only, to touch (adjacent spans, which must not
see each other), to cover half a row, and to differ between the two batch rows; windows
are shorter than some spans (cutting their earlier keys) and longer. GQA: 4 query heads
on 2 K/V heads, and on 1. Ranks whose spans differ, or are invalid on one rank only, must
raise alike (no rank left waiting in a transfer).

Tolerances: float64 inputs within 1e-9 (the ring's merges add rounding of ~1e-16 per
step; 1e-9 fails on any masking or gradient mistake); float32 inputs within 1e-5 (as in
test_cp_patterns.py: float32 accumulation over 32 keys is off by ~1e-7). A wrong span
mask (the spans dropped, or seen one-way only) is off by > 1e-2, checked below.
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from distributed import run_world
from hf_ring.patterns.ring.spans import BidirectionalSpans
from closeness import rel_err
from reference_attention import feature_attention

B, S, HQ, HK, D = 2, 32, 4, 2, 8
# Row 0: a span across the chunk boundary at 8, one adjacent to it, one across 24;
# row 1: a span inside the first chunk (one rank), and the whole second half.
SPANS = [[(5, 12), (12, 14), (20, 29)], [(0, 3), (16, 32)]]
# Both rows' spans the same: the blocks run once for the two rows.
SHARED = [[(3, 11), (11, 13), (22, 30)]] * 2


def block_ids(spans, seq: int = S) -> torch.Tensor:
    """transformers' ``block_sequence_ids`` for ``spans``: int64 ``(batch, seq)``."""
    ids = torch.full((len(spans), seq), -1)
    for r, row in enumerate(spans):
        for n, (a, b) in enumerate(row):
            ids[r, a:b] = n
    return ids


def _inputs(case: dict):
    g = torch.Generator().manual_seed(5)
    dtype = case.get("dtype", torch.float32)
    hk = case.get("hk", HK)
    q, dout = (torch.randn(B, S, HQ, D, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, S, hk, D, generator=g, dtype=dtype) for _ in range(2))
    sinks = torch.randn(HQ, generator=g, dtype=dtype)
    return q, k, v, dout, sinks


def _attend(rank: int, world: int, case: dict) -> dict:
    q, k, v, dout, sinks = _inputs(case)
    layout = case.get("layout", "zigzag")
    shard = lambda t: hf_ring.shard_sequence(t, world, rank, layout=layout)  # noqa: E731
    q, k, v = (shard(t).requires_grad_() for t in (q, k, v))
    sinks = sinks.clone().requires_grad_() if case.get("sinks") else None
    out, lse = hf_ring.context_parallel_attn_func(
        q, k, v, pattern=case["pattern"], layout=layout, window=case.get("window"), softcap=case.get("softcap"),
        sinks=sinks, ulysses_size=case.get("ulysses_size"), backend=case.get("backend", "reference"),
        return_lse=True, spans=case.get("spans", SPANS))
    out.backward(shard(dout))
    return {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "dsinks": None if sinks is None else sinks.grad}


def _packed(rank: int, world: int, case: dict) -> dict:
    """One packed row of two documents (16 + 16 tokens), each zigzag-sharded on its own."""
    q, k, v, dout, _ = _inputs(case)
    cu = torch.tensor([0, 16, 32])
    shard = lambda t: hf_ring.sharding.shard_packed(t[0], cu, world, rank, dim=0)  # noqa: E731
    q, k, v = (shard(t).requires_grad_() for t in (q, k, v))
    out, lse = hf_ring.ring_flash_attn_varlen_func(q, k, v, cu, backend=case.get("backend", "reference"),
                                                   return_lse=True, spans=[case["packed_spans"]])
    out.backward(shard(dout))
    return {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _disagree(rank: int, world: int, case: dict) -> dict:
    """Rank 1 passes other spans (or spans that are not valid): every rank must raise."""
    try:
        _attend(rank, world, {**case, "spans": case["rank1_spans"] if rank == 1 else SPANS})
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


def _run_cases(rank: int, world: int, cases: list) -> list:
    run = lambda c: (_packed if "packed_spans" in c else _disagree if "rank1_spans" in c else _attend)  # noqa: E731
    return [run(c)(rank, world, c) for c in cases]


def _want(case: dict) -> dict:
    q, k, v, dout, sinks = _inputs(case)
    if "packed_spans" in case:  # the documents as two rows of one batch, each with its own spans
        doc = lambda t: torch.stack([t[0, :16], t[0, 16:]])  # noqa: E731
        spans = [[(a - 16 * d, b - 16 * d) for a, b in case["packed_spans"] if 16 * d <= a < 16 * (d + 1)]
                 for d in range(2)]
        want = feature_attention(doc(q), doc(k), doc(v), doc(dout), block_ids=block_ids(spans, 16))
        return {n: want[n].reshape(1, 32, *want[n].shape[2:]) for n in ("out", "dq", "dk", "dv")}
    return feature_attention(q, k, v, dout, window=case.get("window"), softcap=case.get("softcap"),
                             sinks=sinks if case.get("sinks") else None,
                             block_ids=block_ids(case.get("spans", SPANS)))


def _check(case: dict, per_rank: list, world: int) -> None:
    if "rank1_spans" in case:
        for r in per_rank:
            assert r["error"] is not None and "spans.hash" in r["error"], r
        return
    tol = 1e-9 if case.get("dtype") == torch.float64 else 1e-5
    want = _want(case)
    if "packed_spans" in case:
        cu = torch.tensor([0, 16, 32])
        idx = torch.cat([hf_ring.sharding.packed.packed_shard_indices(cu, world, r) for r in range(world)])
        for name in ("out", "dq", "dk", "dv"):
            got = torch.empty_like(want[name][0])
            got[idx] = torch.cat([r[name] for r in per_rank]).double()
            assert rel_err(got, want[name][0]) < tol, (case, name)
        return
    layout = case.get("layout", "zigzag")
    join = lambda name, dim: hf_ring.unshard_sequence([r[name] for r in per_rank], dim=dim,  # noqa: E731
                                                      layout=layout)
    for name in ("out", "dq", "dk", "dv"):
        assert rel_err(join(name, 1), want[name]) < tol, (case, name)
    assert rel_err(join("lse", 2), want["lse"]) < tol, (case, "lse")
    if case.get("sinks"):
        assert rel_err(sum(r["dsinks"] for r in per_rank), want["dsinks"]) < tol, (case, "dsinks")


def _cases(pattern: str, layouts=("zigzag", "contiguous", "stripe"), **extra) -> list[dict]:
    windows = ({}, {"window": 3}, {"window": 10})  # shorter than most spans, longer than some
    return [{"pattern": pattern, "layout": lay, **w, **extra} for lay in layouts for w in windows]


WORLD2 = (
    _cases("ring") + _cases("allgather", layouts=("zigzag", "stripe")) + _cases("ulysses", layouts=("zigzag", "stripe"))
    + [
        {"pattern": "ring", "layout": "zigzag", "dtype": torch.float64, "window": 3},
        {"pattern": "allgather", "layout": "contiguous", "dtype": torch.float64},
        {"pattern": "ulysses", "layout": "zigzag", "dtype": torch.float64, "window": 10},
        {"pattern": "ring", "layout": "zigzag", "backend": "torch_cpu_flash", "window": 3},
        {"pattern": "ulysses", "layout": "stripe", "backend": "torch_cpu_flash"},
        {"pattern": "ring", "layout": "zigzag", "spans": SHARED, "window": 10},
        {"pattern": "ring", "layout": "zigzag", "hk": 1, "window": 3, "sinks": True, "softcap": 2.0},
        {"pattern": "ulysses", "layout": "zigzag", "hk": 1, "sinks": True},
        {"pattern": "ring", "layout": "zigzag", "spans": [[], [(6, 7)]]},  # no span, a one-token span
        # Packed rows: spans inside each document, one across a zigzag chunk boundary of the first.
        {"packed_spans": [(2, 9), (9, 12), (20, 31)]},
        {"packed_spans": [(0, 16), (16, 19)], "backend": "torch_cpu_flash", "dtype": torch.float64},
        # Ranks that disagree raise alike, an invalid span on one rank included.
        {"pattern": "ring", "rank1_spans": [[(5, 12), (12, 14), (20, 28)], [(0, 3), (16, 32)]]},
        {"pattern": "ring", "rank1_spans": [[(12, 5)], [(0, 3)]]},
    ]
)


def test_spans_world_2():
    results = run_world(2, _run_cases, WORLD2)
    for i, case in enumerate(WORLD2):
        _check(case, [results[r][i] for r in range(2)], 2)


WORLD4 = (
    _cases("ring", layouts=("zigzag", "stripe")) + _cases("hybrid", layouts=("zigzag", "stripe"), ulysses_size=2)
    + [
        {"pattern": "allgather", "layout": "zigzag", "window": 3},
        {"pattern": "ulysses", "layout": "zigzag", "window": 10},
        {"pattern": "ring", "layout": "contiguous", "dtype": torch.float64, "window": 3},
        {"pattern": "hybrid", "layout": "zigzag", "ulysses_size": 2, "hk": 1, "backend": "torch_cpu_flash"},
        {"packed_spans": [(2, 9), (9, 12), (20, 31)]},
    ]
)


def test_spans_world_4():
    results = run_world(4, _run_cases, WORLD4)
    for i, case in enumerate(WORLD4):
        _check(case, [results[r][i] for r in range(4)], 4)


def test_the_reference_tells_spans_apart():
    """The checks above could not pass with the spans dropped or seen one way only."""
    q, k, v, dout, _ = _inputs({})
    with_spans = feature_attention(q, k, v, dout, block_ids=block_ids(SPANS))
    causal = feature_attention(q, k, v, dout)
    out = hf_ring.context_parallel_attn_func(q, k, v, spans=SPANS, backend="reference")
    assert rel_err(causal["out"], with_spans["out"]) > 1e-2
    assert rel_err(out, with_spans["out"]) < 1e-5


def test_from_runs_reads_maximal_runs():
    inside = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1]]).bool()
    spans = BidirectionalSpans.from_runs(inside)
    assert spans.rows == (((1, 3), (4, 7)), ((0, 8),))
    assert spans.seq == 8
    with pytest.raises(ValueError, match="separate runs"):
        BidirectionalSpans.from_runs(inside, single=True)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"spans": [[(3, 2)]] * B}, ValueError, r"span \(3, 2\) of row 0 is not a non-empty range"),
    ({"spans": [[(0, 5), (4, 8)]] * B}, ValueError, "must be sorted and disjoint"),
    ({"spans": [[(0, 40)]] * B}, ValueError, "inside the 32 tokens"),
    ({"spans": [[(0, 4)]]}, ValueError, "given for 1 batch rows, the call has 2"),
    ({"spans": [[(0, 4)]] * B, "causal": False}, ValueError, "on top of causal attention"),
])
def test_bad_spans_are_refused(kwargs, error, match):
    q, k, v, _, _ = _inputs({})
    with pytest.raises(error, match=match):
        hf_ring.context_parallel_attn_func(q, k, v, backend="reference", **kwargs)


def test_spans_need_a_masked_kernel_and_no_chunks_and_stay_inside_documents():
    from hf_ring.kernels import AttentionBackend, get_backend
    from hf_ring.kernels.reference import reference_backward, reference_forward
    from hf_ring.patterns.plan import AttentionPlan

    unmasked = AttentionBackend(name="unmasked", description="no masked kernel", forward=reference_forward,
                                backward=reference_backward, devices=("cpu",), dtypes=(torch.float32,))
    spans = BidirectionalSpans((((0, 4),),), 8)
    with pytest.raises(NotImplementedError, match="has no masked kernel, which bidirectional spans"):
        AttentionPlan(None, 0, 2, "zigzag", True, 1.0, unmasked, spans=spans)
    ref = get_backend("reference", torch.device("cpu"), torch.float32)
    with pytest.raises(NotImplementedError, match="with chunked attention"):
        AttentionPlan(None, 0, 2, "zigzag", True, 1.0, ref, chunk=4, spans=spans)
    with pytest.raises(ValueError, match="crosses the packed document boundary at 4"):
        AttentionPlan(None, 0, 2, "zigzag", True, 1.0, ref, local_doc_lens=(2, 2),
                      spans=BidirectionalSpans((((2, 6),),), 8))
