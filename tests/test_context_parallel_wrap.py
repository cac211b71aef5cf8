"""``hf_ring.ContextParallel.wrap`` on a self-written GQA attention block with RoPE from
global positions (``examples/context_parallel_wrap.py``'s ``GQAttention``), in one spawned
gloo world of 2.

Each rank runs the wrapped block on its shard of the hidden states with the shard's
global positions; its output and input gradient must match the shard of the unwrapped
block's on the full sequence in one process, and the weight gradients summed over the
ranks must match the full-sequence ones, within 1e-5 relative (norm of the difference
over the norm of the reference): both sides are float32 attention, the CP side sums the
softmax in another order (measured < 2.9e-7). Covered: K/V with their own head count
(``enable_gqa``) and repeated to the query heads, zigzag / stripe / contiguous, causal and
not; every pattern (hybrid with one Ulysses group of 2: its ring across groups needs a
world of 4, which tests/test_cp_patterns.py runs on the op) and ``"auto"``. Refusals (a
mask, dropout, ``is_causal`` against ``causal=``, cross-attention, a forward that never
calls SDPA) raise on every rank; SDPA calls outside the wrapped forward
or on another thread during it are not routed; a wrapper nested in another routes once.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hf_ring
from distributed import run_world
from closeness import rel_err

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from context_parallel_wrap import GQAttention  # noqa: E402

TOL = 1e-5
SEQ, BATCH, HIDDEN = 16, 2, 32
# (pattern, layout, causal, repeat_kv)
CASES = [("ring", "zigzag", True, False), ("allgather", "stripe", True, True), ("ulysses", "contiguous", False, False),
         ("hybrid", "zigzag", True, True), ("auto", "zigzag", True, False)]


def _block(causal: bool, repeat_kv: bool) -> GQAttention:
    torch.manual_seed(0)
    return GQAttention(HIDDEN, n_heads=4, n_kv_heads=2, head_dim=8, causal=causal, repeat_kv=repeat_kv)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=g), torch.randn(BATCH, SEQ, HIDDEN, generator=g)


def _run(block: nn.Module, x: torch.Tensor, positions: torch.Tensor, grad_out: torch.Tensor) -> dict:
    x = x.clone().requires_grad_()
    out = block(x, positions)
    out.backward(grad_out)
    return {"out": out.detach(), "dx": x.grad, "grads": {n: p.grad.clone() for n, p in block.named_parameters()}}


def _exactness(rank: int, world: int) -> dict:
    x, grad_out = _inputs()
    results = {}
    for pattern, layout, causal, repeat_kv in CASES:
        wrapped = hf_ring.ContextParallel.wrap(_block(causal, repeat_kv), pattern=pattern, causal=causal, layout=layout,
                                               ulysses_size=world if pattern == "hybrid" else None)
        got = _run(wrapped, wrapped.shard(x), wrapped.positions(SEQ), wrapped.shard(grad_out))
        for g in got["grads"].values():
            torch.distributed.all_reduce(g)
        results[(pattern, layout, causal, repeat_kv)] = got
    return results


class _NoSDPA(nn.Module):
    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x @ x.transpose(1, 2), dim=-1) @ x  # attention by hand: never routed


class _Calls(nn.Module):
    """Calls SDPA with the given arguments on (batch, heads, seq, head_dim) views of x."""

    def __init__(self, keys: int = 0, **sdpa_kwargs) -> None:
        super().__init__()
        self.keys, self.sdpa_kwargs = keys, sdpa_kwargs

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = _heads(x)
        k = q[:, :, : self.keys] if self.keys else q
        return F.scaled_dot_product_attention(q, k, k, **self.sdpa_kwargs)


def _heads(x: torch.Tensor) -> torch.Tensor:
    """(batch, seq, hidden) -> (batch, 4 heads, seq, hidden // 4)."""
    return x.view(x.shape[0], x.shape[1], 4, -1).transpose(1, 2)


def _local_causal(q: torch.Tensor) -> torch.Tensor:
    """Causal attention of q over itself, written out: what an unrouted SDPA call gives."""
    scores = (q @ q.transpose(-1, -2)) / q.shape[-1] ** 0.5
    visible = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ q


class _OtherThread(nn.Module):
    """Calls SDPA on another thread during its forward: that call must run as plain SDPA."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = _heads(x)
        box = {}
        thread = threading.Thread(target=lambda: box.update(out=F.scaled_dot_product_attention(q, q, q, is_causal=True)))
        thread.start()
        thread.join()
        box["routed"] = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        self.box = box
        return box["routed"]


def _scoping_and_refusals(rank: int, world: int) -> dict:
    x, _ = _inputs()
    local = hf_ring.shard_sequence(x, world, rank, dim=1)
    positions = hf_ring.sharding.shard_indices(SEQ, world, rank, "zigzag")
    errors = {}
    refused = {
        "mask": _Calls(attn_mask=torch.ones(SEQ // world, SEQ // world, dtype=torch.bool)),
        "dropout": _Calls(dropout_p=0.1),
        "is_causal": _Calls(is_causal=False),
        "cross": _Calls(is_causal=True, keys=2),
        "no_sdpa": _NoSDPA(),
    }
    for name, module in refused.items():
        try:
            hf_ring.ContextParallel.wrap(module)(local, positions)
            errors[name] = None
        except (ValueError, NotImplementedError, RuntimeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    other = _OtherThread()
    hf_ring.ContextParallel.wrap(other)(local, positions)
    q = _heads(local)
    block = _block(True, False)
    nested = hf_ring.ContextParallel.wrap(hf_ring.ContextParallel.wrap(block))
    once = hf_ring.ContextParallel.wrap(block)
    local_causal = _local_causal(q)
    return {
        "errors": errors,
        # The other thread's call saw the local shard only, as plain SDPA does; the
        # forward's own call ran across the ranks, which differs from it.
        "thread_local": rel_err(other.box["out"], local_causal),
        "forward_local": rel_err(other.box["routed"], local_causal),
        # After the wrapped forwards, a call on this thread is plain SDPA again.
        "after_local": rel_err(F.scaled_dot_product_attention(q, q, q, is_causal=True), local_causal),
        "nested": rel_err(nested(local, positions), once(local, positions)),
    }


def _world(rank: int, world: int) -> dict:
    return {"exactness": _exactness(rank, world), "scoping": _scoping_and_refusals(rank, world)}


@pytest.fixture(scope="module")
def results():
    return run_world(2, _world)


@pytest.mark.parametrize("pattern,layout,causal,repeat_kv", CASES)
def test_wrapped_block_matches_full_sequence(results, pattern, layout, causal, repeat_kv):
    x, grad_out = _inputs()
    block = _block(causal, repeat_kv)
    want = _run(block, x, torch.arange(SEQ), grad_out)
    for rank, r in enumerate(results):
        got = r["exactness"][(pattern, layout, causal, repeat_kv)]
        shard = lambda t: hf_ring.shard_sequence(t, 2, rank, dim=1, layout=layout)  # noqa: E731
        assert rel_err(got["out"], shard(want["out"])) <= TOL
        assert rel_err(got["dx"], shard(want["dx"])) <= TOL
        for name, g in want["grads"].items():
            assert rel_err(got["grads"][f"module.{name}"], g) <= TOL, name
    # The keys are the module's: the wrapper adds "module." in front of them.
    assert set(hf_ring.ContextParallel.wrap(block).state_dict()) == {f"module.{k}" for k in block.state_dict()}


@pytest.mark.parametrize(
    "name,words",
    [("mask", "attn_mask"), ("dropout", "dropout_p=0.1"), ("is_causal", "causal=True"),
     ("cross", "self-attention"), ("no_sdpa", "made no call")],
)
def test_refusals_on_every_rank(results, name, words):
    for r in results:
        assert r["scoping"]["errors"][name] is not None and words in r["scoping"]["errors"][name]


def test_interception_is_scoped_to_the_wrapped_forward(results):
    for r in results:
        s = r["scoping"]
        assert s["thread_local"] <= TOL and s["after_local"] <= TOL
        assert s["forward_local"] > 1e-2  # routed: the shard's queries saw the other rank's keys
        assert s["nested"] == 0.0
