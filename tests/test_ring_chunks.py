"""Chunked attention inside every pattern (``AttentionPlan.chunk``, hf_ring/patterns/ring/window.py)
against float64 attention with the chunks written out here: key j visible to query i iff
``j <= i`` and ``i // chunk == j // chunk`` (Llama 4's ``attention_chunk_size``).

Worlds 1, 2 and 4 (spawned gloo ranks, one spawn per world), the ring, all-gather,
Ulysses and hybrid patterns, layouts zigzag, stripe and contiguous, chunks of one token,
shorter than a zigzag piece, across pieces, equal to the sequence and longer, alone and
with a sliding window; out, lse, dq, dk, dv within 1e-10 (float64) on the reference and
torch_cpu_flash kernels. A ring step whose keys are all in other chunks runs no kernel.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_world
from hf_ring.kernels import get_backend
from hf_ring.patterns.build import build_plan
from hf_ring.patterns.plan import AttentionPlan
from hf_ring.patterns.run import run_plan
from hf_ring.sharding import shard_sequence

SEQ, HQ, HK, D = 16, 4, 2, 8
LAYOUTS = ("zigzag", "stripe", "contiguous")
# (chunk, window): zigzag pieces are 2-8 tokens for worlds 1-4.
CUTS = ((1, None), (3, None), (4, None), (6, None), (16, None), (40, None), (6, 4), (5, 2))
BACKENDS = ("reference", "torch_cpu_flash")


def _patterns(world: int) -> list[tuple[str, int | None]]:
    """(pattern, ulysses_size) pairs this world runs (one process: the ring's single step)."""
    if world == 1:
        return [("ring", None)]
    return [("ring", None), ("allgather", None), ("ulysses", None), *([("hybrid", 2)] if world == 4 else [])]


def _inputs():
    g = torch.Generator().manual_seed(9)
    q, dout = (torch.randn(2, SEQ, HQ, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, SEQ, HK, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, dout


def chunked_attention(q, k, v, dout, chunk: int, window: int | None) -> dict[str, torch.Tensor]:
    """Float64 causal attention within chunks (and a window), written out."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    qt, kt, vt = (t.transpose(1, 2) for t in leaves)
    kt, vt = (t.repeat_interleave(HQ // HK, dim=1) for t in (kt, vt))  # GQA, reference only
    i, j = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    visible = (j <= i) & (i // chunk == j // chunk)
    if window is not None:
        visible &= i - j < window
    scores = (qt @ kt.transpose(-1, -2) * D ** -0.5).masked_fill(~visible, float("-inf"))
    out = (torch.softmax(scores, -1) @ vt).transpose(1, 2)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    return {"out": out.detach(), "lse": torch.logsumexp(scores, -1).detach(), "dq": dq, "dk": dk, "dv": dv}


def _rank(rank: int, world: int) -> dict:
    q, k, v, dout = _inputs()
    res = {}
    for layout in LAYOUTS:
        shard = lambda t: shard_sequence(t, world, rank, dim=1, layout=layout)  # noqa: E731
        for pattern, ulysses_size in _patterns(world):
            for chunk, window in CUTS:
                for backend in BACKENDS:
                    plan = build_plan(
                        pattern=pattern, group=None, rank=rank, world=world, layout=layout, causal=True,
                        scale=D ** -0.5, backend=backend, device=torch.device("cpu"), dtype=torch.float64,
                        n_heads=HQ, n_kv_heads=HK, head_dim=D, seq=SEQ, window=window, chunk=chunk,
                        ulysses_size=ulysses_size,
                    )
                    ql, kl, vl = (shard(t).clone().requires_grad_() for t in (q, k, v))
                    out, lse = run_plan(ql, kl, vl, plan)
                    out.backward(shard(dout))
                    res[layout, pattern, chunk, window, backend] = {
                        "out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
                    }
    return res


def _check(per_rank: list, world: int) -> None:
    q, k, v, dout = _inputs()
    for chunk, window in CUTS:
        ref = chunked_attention(q, k, v, dout, chunk, window)
        for layout in LAYOUTS:
            for pattern, _ in _patterns(world):
                for backend in BACKENDS:
                    for rank, res in enumerate(per_rank):
                        got = res[layout, pattern, chunk, window, backend]
                        for name in ("out", "lse", "dq", "dk", "dv"):
                            dim = 2 if name == "lse" else 1
                            want = shard_sequence(ref[name], world, rank, dim=dim, layout=layout)
                            err = (got[name] - want).abs().max().item()
                            assert err <= 1e-10, (layout, pattern, chunk, window, backend, rank, name, err)


def test_chunks_single_process():
    _check([_rank(0, 1)], 1)


@pytest.mark.parametrize("world", [2, 4])
def test_chunks_in_every_pattern(world):
    _check(run_world(world, _rank), world)


def test_steps_in_other_chunks_run_nothing():
    """Chunks of 8 over 8 zigzag ranks of 64 tokens (pieces of 4): rank 0 holds tokens 0-3
    and 60-63, whose chunks (0-7, 56-63) it shares with rank 1 only (tokens 4-7, 56-59):
    its own step and rank 1's, 2 of 8 steps, run a kernel."""
    plan = AttentionPlan(None, 0, 8, "zigzag", True, 1.0, get_backend("reference", torch.device("cpu"), torch.float32),
                         chunk=8, transport=lambda channel: None)
    ran = [step for step in range(8) if plan.blocks(step, 8)]
    assert ran == [0, 7], ran


def test_chunk_refusals():
    reference = get_backend("reference", torch.device("cpu"), torch.float32)
    with pytest.raises(NotImplementedError, match="chunked attention on packed rows"):
        AttentionPlan(None, 0, 1, "zigzag", True, 1.0, reference, chunk=4, local_doc_lens=(4, 4))
    with pytest.raises(ValueError, match="causal=True"):
        AttentionPlan(None, 0, 1, "zigzag", False, 1.0, reference, chunk=4)
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="chunk must be a positive int"):
            AttentionPlan(None, 0, 1, "zigzag", True, 1.0, reference, chunk=bad)
