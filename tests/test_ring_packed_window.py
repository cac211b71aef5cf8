"""Sliding windows on packed rows: ``ring_flash_attn_varlen_func(window=)`` against float64
attention with the window written out, on each document alone (tests/reference_attention.py
``feature_attention``), forward and the gradients of q, k and v.

Documents of 24, 8, 16 and 40 tokens, each zigzag-sharded on its own (chunks of 6, 2, 4, 10
at cp=2; of 3, 1, 2, 5 at cp=4); windows of 1 (the diagonal only), 3 and 7 (shorter than some
documents' chunks, longer than others'), 20 (longer than all documents but one) and 64 (longer
than every document: the causal ring, nothing cut). Two kernels: the reference's per-block
path (a masked block on each window edge) and a varlen stand-in (tests/varlen_standin.py:
the reference looped over the segments) which batches a step's unmasked blocks into one call
per causal flag and runs the masked ones alone; the call counts show that split. With
spans (Gemma 3's images on a packed row) the window cuts only earlier keys.

Tolerances (relative; absolute for the gradients a window of 1 makes zero): float64 inputs
on the per-block path within 1e-10 (the ring's merges add ~1e-16 per step; a wrong window
edge moves an output by ~1e-1); float32 inputs within 1e-5, as for the other
float32 rings (accumulation over at most 40 keys is off by ~1e-7); the varlen stand-in runs
float32 only, as its contract returns a float32 lse.
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from distributed import run_world
from hf_ring.kernels import AttentionBackend
from hf_ring.kernels.reference import (
    reference_backward, reference_forward, reference_masked_backward, reference_masked_forward,
)
from hf_ring.sharding import shard_packed, unshard_packed
from closeness import rel_err
from reference_attention import feature_attention
from backend_registry import registered
from varlen_standin import counted, looped_varlen_backward, looped_varlen_forward

DOC_LENS = (24, 8, 16, 40)  # multiples of 2 * cp_size for cp 1, 2 and 4
CU = torch.tensor([0, *torch.tensor(DOC_LENS).cumsum(0).tolist()])
HQ, HK, D = 4, 2, 8
WINDOWS = (1, 3, 7, 20, 64)
CALLS = {"varlen": 0, "masked": 0, "plain": 0}


def _counted(kind: str, fn):
    return counted(CALLS, kind, fn)


VARLEN = AttentionBackend(
    name="varlen_masked_standin", description="reference, counted, with a looped varlen kernel",
    forward=_counted("plain", reference_forward), backward=_counted("plain", reference_backward),
    varlen_forward=_counted("varlen", looped_varlen_forward), varlen_backward=_counted("varlen", looped_varlen_backward),
    masked_forward=_counted("masked", reference_masked_forward),
    masked_backward=_counted("masked", reference_masked_backward),
    devices=("cpu",), dtypes=(torch.float32, torch.float64),
)


def _inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(11)
    total = int(CU[-1])
    q, dout = (torch.randn(total, HQ, D, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(total, HK, D, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, dout


def _attend(rank: int, world: int, case: dict) -> dict:
    q, k, v, dout = _inputs(case["dtype"])
    shard = lambda t: shard_packed(t, CU, world, rank, dim=0)  # noqa: E731
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    for key in CALLS:
        CALLS[key] = 0
    out, lse = hf_ring.ring_flash_attn_varlen_func(ql, kl, vl, CU.tolist(), window=case["window"],
                                                   backend=case["backend"], return_lse=True,
                                                   spans=case.get("spans"), pattern=case.get("pattern", "ring"))
    out.backward(shard(dout))
    return {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad, "calls": dict(CALLS)}


def _run_cases(rank: int, world: int, cases: list) -> list:
    with registered(VARLEN):
        return [_attend(rank, world, c) for c in cases]


def _block_ids(spans, length: int) -> torch.Tensor:
    ids = torch.full((1, length), -1)
    for n, (a, b) in enumerate(spans):
        ids[0, a:b] = n
    return ids


def _want(case: dict) -> dict:
    """Each document alone, as a batch row of its own, put back into the packed row."""
    q, k, v, dout = _inputs(case["dtype"])
    want = {"out": torch.empty_like(q, dtype=torch.float64), "dq": torch.empty_like(q, dtype=torch.float64),
            "dk": torch.empty_like(k, dtype=torch.float64), "dv": torch.empty_like(v, dtype=torch.float64),
            "lse": torch.empty(HQ, q.shape[0], dtype=torch.float64)}
    for a, b in zip(CU[:-1].tolist(), CU[1:].tolist()):
        spans = [(s - a, e - a) for s, e in (case.get("spans") or [[]])[0] if a <= s < b]
        doc = feature_attention(q[None, a:b], k[None, a:b], v[None, a:b], dout[None, a:b], window=case["window"],
                                block_ids=_block_ids(spans, b - a) if spans else None)
        for name in ("out", "dq", "dk", "dv"):
            want[name][a:b] = doc[name][0]
        want["lse"][:, a:b] = doc["lse"][0]
    return want


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error; absolute where the reference is zero (a window of 1: each query sees
    only itself, so out = v and dq = dk = 0 exactly, which the ring returns as ~1e-15)."""
    if want.norm() == 0:
        return (got.double() - want).norm().item()
    return rel_err(got, want)


def _check(cases: list, per_rank: list, world: int) -> None:
    for i, case in enumerate(cases):
        tol = 1e-10 if case["dtype"] == torch.float64 else 1e-5
        want = _want(case)
        for name in want:
            dim = 1 if name == "lse" else 0
            got = unshard_packed([r[i][name] for r in per_rank], CU, dim=dim)
            assert _err(got, want[name]) <= tol, (case, name, _err(got, want[name]))
        if case["backend"] == VARLEN.name and "spans" not in case:  # a span's blocks run one by one
            calls = [r[i]["calls"] for r in per_rank]
            assert all(c["plain"] == 0 for c in calls), calls  # unmasked blocks always go batched
            if case["window"] >= max(DOC_LENS):  # nothing cut: one varlen call per step, each way
                assert all(c == {"varlen": 2 * world, "masked": 0, "plain": 0} for c in calls), calls
            elif case["window"] == 3:  # every document's diagonal is on the window's edge
                assert all(c["masked"] > 0 for c in calls), calls


def _cases(dtype: torch.dtype, backends=("reference", VARLEN.name)) -> list[dict]:
    return [{"window": w, "backend": b, "dtype": dtype} for w in WINDOWS for b in backends]


# Spans inside documents (one across the first document's zigzag chunk boundary at cp=2).
SPANS = [[(3, 9), (9, 12), (26, 30), (50, 60)]]
WORLD2 = _cases(torch.float32) + _cases(torch.float64, backends=("reference",)) + [
    {"window": 3, "backend": VARLEN.name, "dtype": torch.float32, "spans": SPANS},
    {"window": 7, "backend": "reference", "dtype": torch.float64, "spans": SPANS},
]
WORLD4 = _cases(torch.float32, backends=(VARLEN.name,)) + [
    {"window": 7, "backend": "reference", "dtype": torch.float64},
    {"window": 3, "backend": VARLEN.name, "dtype": torch.float32, "spans": SPANS},
    # The batched CPU path (a run of equal blocks per call) at windows whose edge masks differ
    # between steps on blocks of one rectangle: a step must not reuse another step's masks.
    {"window": 20, "backend": "reference", "dtype": torch.float64},
    {"window": 20, "backend": "torch_cpu_flash", "dtype": torch.float32},
    {"window": 20, "backend": "reference", "dtype": torch.float64, "pattern": "allgather"},
]


def test_packed_window_single_process():
    cases = _cases(torch.float64, backends=("reference",)) + _cases(torch.float32, backends=(VARLEN.name,))
    _check(cases, [_run_cases(0, 1, cases)], 1)


@pytest.mark.parametrize("world, cases", [(2, WORLD2), (4, WORLD4)], ids=["world2", "world4"])
def test_packed_window_ring(world, cases):
    _check(cases, run_world(world, _run_cases, cases), world)


def test_the_reference_tells_windows_apart():
    """The checks above could not pass with the window ignored or off by one token."""
    q, k, v, dout = _inputs(torch.float64)
    doc = slice(int(CU[3]), int(CU[4]))  # the 40-token document
    args = (q[None, doc], k[None, doc], v[None, doc], dout[None, doc])
    seven = feature_attention(*args, window=7)
    for other in (None, 6, 8):
        assert rel_err(feature_attention(*args, window=other)["out"], seven["out"]) > 1e-3, other


def test_chunked_attention_on_packed_rows_is_refused():
    from hf_ring.kernels import get_backend
    from hf_ring.patterns.plan import AttentionPlan

    ref = get_backend("reference", torch.device("cpu"), torch.float32)
    with pytest.raises(NotImplementedError, match="chunked attention on packed rows"):
        AttentionPlan(None, 0, 2, "zigzag", True, 1.0, ref, local_doc_lens=(4, 4), chunk=4)
