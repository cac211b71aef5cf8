"""Sliding windows inside the ring (hf_ring/patterns/ring/window.py) against float64 attention with
the window written out here: key j visible to query i iff ``0 <= i - j < window``.

Worlds 1, 2 and 4 (spawned gloo ranks), layouts zigzag, stripe and contiguous, windows
smaller than a chunk, equal to one, spanning several chunks, and at least the sequence;
out, lse, dq, dk, dv. The kernels are the reference's and torch_cpu_flash's, the first
through a counting stand-in so that skipped blocks are seen to be skipped: per ring step,
one kernel call exactly when the step's keys hold any key visible to a local query
(computed here from the layout's positions, not from the plan), none otherwise.
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from distributed import run_world
from hf_ring.kernels import AttentionBackend, get_backend
from hf_ring.kernels.reference import (
    reference_backward, reference_forward, reference_masked_backward, reference_masked_forward,
)
from hf_ring.patterns.plan import AttentionPlan
from hf_ring.sharding import shard_indices, shard_sequence
from backend_registry import registered

SEQ, HQ, HK, D = 16, 4, 2, 8
LAYOUTS = ("zigzag", "stripe", "contiguous")
# Chunks are 2-8 tokens long for worlds 1-4: below a chunk, equal to one, several, >= SEQ.
WINDOWS = (1, 2, 3, 4, 5, 7, 9, 16, 40)
CALLS = {"forward": 0, "backward": 0, "masked_forward": 0, "masked_backward": 0}


def _counted(name, fn):
    def wrapped(*args):
        CALLS[name] += 1
        return fn(*args)
    return wrapped


COUNTING = AttentionBackend(
    name="counting_reference", description="the reference kernels, counted",
    forward=_counted("forward", reference_forward), backward=_counted("backward", reference_backward),
    masked_forward=_counted("masked_forward", reference_masked_forward),
    masked_backward=_counted("masked_backward", reference_masked_backward),
    devices=("cpu",), dtypes=(torch.float64, torch.float32),
)
UNMASKED = AttentionBackend(name="unmasked_reference", description="no masked kernel",
                            forward=reference_forward, backward=reference_backward,
                            devices=("cpu",), dtypes=(torch.float64, torch.float32))


def _inputs():
    g = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(2, SEQ, HQ, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, SEQ, HK, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, dout


def window_attention(q, k, v, dout, window):
    """Float64 causal attention with a sliding window, written out: out, lse, dq, dk, dv."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    qt, kt, vt = (t.transpose(1, 2) for t in leaves)
    kt, vt = (t.repeat_interleave(HQ // HK, dim=1) for t in (kt, vt))  # GQA, reference only
    i = torch.arange(SEQ)[:, None]
    j = torch.arange(SEQ)[None, :]
    visible = (i - j >= 0) & (i - j < window)
    scores = (qt @ kt.transpose(-1, -2) * D ** -0.5).masked_fill(~visible, float("-inf"))
    out = (torch.softmax(scores, -1) @ vt).transpose(1, 2)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    return {"out": out.detach(), "lse": torch.logsumexp(scores, -1).detach(), "dq": dq, "dk": dk, "dv": dv}


def _expected_calls(layout: str, world: int, rank: int, window: int) -> int:
    """Ring steps whose keys hold a key visible to one of this rank's queries."""
    mine = shard_indices(SEQ, world, rank, layout)
    steps = 0
    for step in range(world):
        theirs = shard_indices(SEQ, world, (rank - step) % world, layout)
        dist = mine[:, None] - theirs[None, :]
        steps += int(bool(((dist >= 0) & (dist < window)).any()))
    return steps


def _rank(rank: int, world: int) -> dict:
    with registered(COUNTING):
        return _windows(rank, world)


def _windows(rank: int, world: int) -> dict:
    q, k, v, dout = _inputs()
    res = {}
    for layout in LAYOUTS:
        shard = lambda t: shard_sequence(t, world, rank, dim=1, layout=layout)
        for window in WINDOWS:
            for backend in ("counting_reference", "torch_cpu_flash"):
                for key in CALLS:
                    CALLS[key] = 0
                ql, kl, vl = (shard(t).clone().requires_grad_() for t in (q, k, v))
                out, lse = hf_ring.ring_flash_attn_func(ql, kl, vl, layout=layout, backend=backend,
                                                        window=window, return_lse=True)
                fwd = dict(CALLS)
                out.backward(shard(dout))
                res[layout, window, backend] = {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad,
                                                "dv": vl.grad, "fwd": fwd, "all": dict(CALLS)}
    if world == 2:  # ranks that disagree on the window raise on every rank
        ql, kl, vl = (shard_sequence(t, world, rank, dim=1) for t in (q, k, v))
        try:
            hf_ring.ring_flash_attn_func(ql, kl, vl, backend="torch_cpu_flash", window=3 + rank)
        except ValueError as e:
            res["disagree"] = str(e)
    return res


def _check(per_rank: list, world: int) -> None:
    q, k, v, dout = _inputs()
    for window in WINDOWS:
        ref = window_attention(q, k, v, dout, window)
        for layout in LAYOUTS:
            for rank, res in enumerate(per_rank):
                for backend in ("counting_reference", "torch_cpu_flash"):
                    got = res[layout, window, backend]
                    for name in ("out", "lse", "dq", "dk", "dv"):
                        dim = 2 if name == "lse" else 1
                        want = shard_sequence(ref[name], world, rank, dim=dim, layout=layout)
                        err = (got[name] - want).abs().max().item()
                        assert err <= 1e-10, (layout, window, backend, rank, name, err)
                calls = res[layout, window, "counting_reference"]
                steps = _expected_calls(layout, world, rank, window)
                fwd = calls["fwd"]
                # One block per step at most here, so one call per step that sees any key.
                assert fwd["forward"] + fwd["masked_forward"] == steps, (layout, window, rank, fwd, steps)
                bwd = {n: calls["all"][n] - fwd[n] for n in CALLS}
                assert bwd["backward"] + bwd["masked_backward"] == steps, (layout, window, rank, bwd)
                if window >= SEQ:  # masks nothing: the causal ring, no masked call
                    assert fwd["masked_forward"] == 0 and steps == _expected_calls(layout, world, rank, SEQ)
                if window == 1:  # only the diagonal, and it is masked
                    assert fwd == {"forward": 0, "backward": 0, "masked_forward": 1, "masked_backward": 0}
    if world == 2:
        for res in per_rank:
            assert "window" in res["disagree"] and "rank 0 3, rank 1 4" in res["disagree"], res["disagree"]


def test_window_single_process():
    _check([_rank(0, 1)], 1)


@pytest.mark.parametrize("world", [2, 4])
def test_window_ring(world):
    _check(run_world(world, _rank), world)


def test_window_skips_most_of_a_long_ring():
    """A window of one chunk on 8 zigzag ranks: rank 7 (chunks 7 and 8) needs only the
    diagonal and the previous rank's keys: 2 of 8 steps run a kernel."""
    plan = AttentionPlan(None, 7, 8, "zigzag", True, 1.0, get_backend("reference", torch.device("cpu"), torch.float32),
                    window=4, transport=lambda channel: None)
    ran = [step for step in range(8) if plan.blocks(step, 8)]
    assert ran == [0, 1], ran


def _plan(**changes):
    fields = dict(group=None, rank=0, world=1, layout="zigzag", causal=True, scale=1.0,
                  backend=get_backend("reference", torch.device("cpu"), torch.float32), window=4)
    return AttentionPlan(**{**fields, **changes})


def test_window_refusals():
    with pytest.raises(NotImplementedError, match="'unmasked_reference' has no masked kernel.*torch_cpu_flash"):
        _plan(backend=UNMASKED)
    with pytest.raises(NotImplementedError, match="chunked attention on packed rows"):
        _plan(local_doc_lens=(4, 4), window=None, chunk=4)  # windows on packed rows: test_ring_packed_window.py
    with pytest.raises(ValueError, match="causal=True"):
        _plan(causal=False)
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="positive int"):
            _plan(window=bad)


@pytest.mark.parametrize("backend", ["reference", "torch_cpu_flash"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_masked_kernel_with_a_row_that_sees_nothing(backend, dtype):
    """The masked entry point against float64 math, with an arbitrary mask and one row
    that sees no key: out 0, lse -inf, zero gradients, no nan (also when the row's final
    lse is -inf, as in the backward of a row no block ever reached)."""
    kernel = get_backend(backend, torch.device("cpu"), dtype)
    g = torch.Generator().manual_seed(9)
    q, dout = (torch.randn(2, 6, HQ, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 7, HK, D, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(6, 7, generator=g) > 0.4
    mask[:, 0] = True
    mask[2] = False  # row 2 sees nothing
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    qt, kt, vt = (t.transpose(1, 2) for t in leaves)
    kt, vt = (t.repeat_interleave(HQ // HK, dim=1) for t in (kt, vt))
    scores = (qt @ kt.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    want_lse = torch.logsumexp(scores, -1)
    want_out = (torch.softmax(scores, -1).nan_to_num(0.0) @ vt).transpose(1, 2)
    want = torch.autograd.grad(want_out, leaves, dout)
    out, lse = kernel.masked_forward(*(t.to(dtype) for t in (q, k, v)), mask, 0.3)
    grads = kernel.masked_backward(*(t.to(dtype) for t in (dout, q, k, v)), out, lse, mask, 0.3)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert torch.equal(lse.isinf(), want_lse.isinf()) and bool(lse[:, :, 2].eq(float("-inf")).all())
    assert (lse - want_lse).nan_to_num(0.0, 0.0, 0.0).abs().max() <= tol
    assert (out.double() - want_out).abs().max() <= tol and bool(out[:, 2].eq(0).all())
    for got, ref in zip(grads, want):
        assert not got.isnan().any() and (got.double() - ref).abs().max() <= tol
