"""Packed rows through a backend's varlen kernel: one kernel call per ring step for all
documents (hf_ring/patterns/ring/packed_step.py) instead of one call per document.

The varlen kernel here is a CPU stand-in that loops the reference kernel over the
``cu_seqlens`` segments, so both paths run the same arithmetic per document and must agree
within 1e-6 relative (float32 inputs); what differs is the gathering, boundaries and
putting back, which is what this checks. Both paths are also checked against float64
attention computed document by document independently of hf_ring
(``reference_attention.segment_attention``), within 1e-5 relative as for other float32
rings, so a wrong reference kernel fails here too. It also checks the varlen path was
taken: one varlen call per ring step in the forward and one in the backward, no
per-block calls.
"""

from __future__ import annotations

import functools

import pytest
import torch

import hf_ring
from distributed import run_world
from hf_ring.kernels import AttentionBackend
from hf_ring.kernels.reference import reference_backward, reference_forward
from hf_ring.sharding import shard_packed
from closeness import rel_err
from reference_attention import segment_attention
from backend_registry import registered
from varlen_standin import looped_varlen_backward, looped_varlen_forward

DOC_LENS = (8, 4, 12, 4)  # multiples of 2 * cp_size for cp_size 1 and 2
HQ, HK, D = 4, 2, 16
CALLS = {"forward": 0, "backward": 0, "varlen_forward": 0, "varlen_backward": 0}


def _counted_forward(q, k, v, causal, scale):
    CALLS["forward"] += 1
    return reference_forward(q, k, v, causal, scale)


def _counted_backward(*args):
    CALLS["backward"] += 1
    return reference_backward(*args)


def _varlen_forward(*args, **kwargs):
    CALLS["varlen_forward"] += 1
    return looped_varlen_forward(*args, **kwargs)


def _varlen_backward(*args, **kwargs):
    CALLS["varlen_backward"] += 1
    return looped_varlen_backward(*args, **kwargs)


_STANDIN_FIELDS = dict(forward=_counted_forward, backward=_counted_backward, devices=("cpu",),
                       dtypes=(torch.float32,))
STANDINS = (
    AttentionBackend(name="per_doc_standin", description="reference, counted", **_STANDIN_FIELDS),
    AttentionBackend(name="varlen_standin", description="reference, counted, with a looped varlen kernel",
                     varlen_forward=_varlen_forward, varlen_backward=_varlen_backward, **_STANDIN_FIELDS),
)


def _inputs():
    cu = torch.tensor([0, *torch.tensor(DOC_LENS).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    total = int(cu[-1])
    q, dout = (torch.randn(total, HQ, D, generator=g) for _ in range(2))
    k, v = (torch.randn(total, HK, D, generator=g) for _ in range(2))
    return cu, q, k, v, dout


def _rank(rank: int, world: int, causal: bool) -> dict:
    with registered(*STANDINS):
        return _both_paths(rank, world, causal)


def _both_paths(rank: int, world: int, causal: bool) -> dict:
    assert all(n % (2 * world) == 0 for n in DOC_LENS)
    cu, q, k, v, dout = _inputs()
    shard = lambda t: shard_packed(t, cu, world, rank, dim=0)
    res = {}
    for name in ("per_doc_standin", "varlen_standin"):
        for key in CALLS:
            CALLS[key] = 0
        ql, kl, vl = (shard(t).clone().requires_grad_() for t in (q, k, v))
        out, lse = hf_ring.ring_flash_attn_varlen_func(ql, kl, vl, cu, causal=causal, backend=name, return_lse=True)
        calls_fwd = dict(CALLS)
        out.backward(shard(dout))
        calls_bwd = {key: CALLS[key] - calls_fwd[key] for key in CALLS}
        res[name] = {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
                     "calls_fwd": calls_fwd, "calls_bwd": calls_bwd}
    return res


def _check(per_rank: list, world: int, causal: bool) -> None:
    cu, q, k, v, dout = _inputs()
    ref = segment_attention(q, k, v, dout, cu, cu, causal, D ** -0.5)
    for rank, res in enumerate(per_rank):
        per_doc, varlen = res["per_doc_standin"], res["varlen_standin"]
        for name in ("out", "lse", "dq", "dk", "dv"):
            assert rel_err(varlen[name], per_doc[name]) <= 1e-6, (name, rel_err(varlen[name], per_doc[name]))
            want = shard_packed(ref[name], cu, world, rank, dim=1 if name == "lse" else 0)
            for path in (per_doc, varlen):
                assert rel_err(path[name], want) <= 1e-5, (name, rel_err(path[name], want))
        # One varlen call per ring step, and the per-block kernel never called.
        assert varlen["calls_fwd"] == {"forward": 0, "backward": 0, "varlen_forward": world, "varlen_backward": 0}
        assert varlen["calls_bwd"] == {"forward": 0, "backward": 0, "varlen_forward": 0, "varlen_backward": world}
        # The per-document path: one block call per document per step.
        assert per_doc["calls_fwd"]["forward"] == world * len(DOC_LENS)
        assert per_doc["calls_bwd"]["backward"] == world * len(DOC_LENS)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_step_single_process(causal):
    _check([_rank(0, 1, causal)], 1, causal)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_step_world_2(causal):
    _check(run_world(2, _rank, causal), 2, causal)


# ---- the all-gather pattern on a varlen kernel that takes bottom-right causal blocks ----

# Documents of uneven lengths at cp 3 (each a multiple of 6): no two runs alike.
ALLGATHER_LENS = (12, 6, 24, 18, 6)
BOTTOM_RIGHT = AttentionBackend(
    name="bottom_right_standin", description="reference, counted, varlen with bottom-right causal blocks",
    varlen_forward=functools.partial(_varlen_forward, bottom_right=True),
    varlen_backward=functools.partial(_varlen_backward, bottom_right=True), varlen_causal_bottom_right=True,
    **_STANDIN_FIELDS)


def _allgather_rank(rank: int, world: int) -> dict:
    cu = torch.tensor([0, *torch.tensor(ALLGATHER_LENS).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    total = int(cu[-1])
    q, dout = (torch.randn(total, HQ, D, generator=g) for _ in range(2))
    k, v = (torch.randn(total, HK, D, generator=g) for _ in range(2))
    shard = lambda t: shard_packed(t, cu, world, rank, dim=0)  # noqa: E731
    with registered(BOTTOM_RIGHT):
        for key in CALLS:
            CALLS[key] = 0
        ql, kl, vl = (shard(t).clone().requires_grad_() for t in (q, k, v))
        out, lse = hf_ring.ring_flash_attn_varlen_func(ql, kl, vl, cu, backend=BOTTOM_RIGHT.name, return_lse=True,
                                                       pattern="allgather")
        calls_fwd = dict(CALLS)
        out.backward(shard(dout))
    ref = segment_attention(q, k, v, dout, cu, cu, True, D ** -0.5)
    errors = {name: rel_err(got, shard_packed(ref[name], cu, world, rank, dim=1 if name == "lse" else 0))
              for name, got in (("out", out.detach()), ("lse", lse), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad))}
    return {"errors": errors, "calls_fwd": calls_fwd, "calls_bwd": {k: CALLS[k] - calls_fwd[k] for k in CALLS}}


def test_allgather_on_a_bottom_right_varlen_kernel_makes_two_calls_per_layer():
    """Each local chunk of every document against its document's prefix, one varlen call per
    chunk (ring/chunk_varlen.py): 2 calls in the forward and 2 in the backward on every rank,
    whatever the documents; exact against float64 attention document by document (1e-5)."""
    for r in run_world(3, _allgather_rank):
        assert max(r["errors"].values()) <= 1e-5, r["errors"]
        assert r["calls_fwd"] == {"forward": 0, "backward": 0, "varlen_forward": 2, "varlen_backward": 0}, r
        assert r["calls_bwd"] == {"forward": 0, "backward": 0, "varlen_forward": 0, "varlen_backward": 2}, r


def test_a_varlen_kernel_without_bottom_right_blocks_keeps_the_ring_steps():
    """The plain varlen stand-in (top-left or equal blocks only) runs the all-gather as the
    ring's per-step varlen calls: the two-call schedule needs bottom-right causal blocks."""
    from hf_ring.patterns.plan import AttentionPlan
    from hf_ring.patterns.ring.chunk_varlen import chunk_varlen_runs_here

    plans = {b.name: AttentionPlan(None, 0, 3, "zigzag", True, 0.25, b, pattern="allgather", local_doc_lens=(4, 2))
             for b in (STANDINS[1], BOTTOM_RIGHT)}
    assert not chunk_varlen_runs_here(plans["varlen_standin"]) and chunk_varlen_runs_here(plans[BOTTOM_RIGHT.name])
    with pytest.raises(ValueError, match="varlen_causal_bottom_right describes a varlen kernel"):
        AttentionBackend(name="x", description="x", varlen_causal_bottom_right=True, **_STANDIN_FIELDS)
