"""``group=None`` in the public ops means the active state's CP group (docs/ops.md).

The defect this guards against: after ``setup_context_parallel(2)`` in a world of 4,
``ring_flash_attn_func(q, k, v)`` rang over all 4 ranks and mixed the two CP groups'
sequences (outputs 0.85-1.99 off, no error). Here the two CP groups hold *different*
sequences (drawn from the group's dp rank), so any op that runs over the world instead of
the pair returns another sequence's attention. Each rank compares its shard against the
float64 reference of its own group's full sequence: 1e-10 relative (float64 on both sides,
only the order of the softmax sums differs). Covered: ``ring_flash_attn_func``,
``ring_flash_attn_varlen_func``, ``context_parallel_attn_func`` (all-gather),
``hf_ring.mixers.context_parallel_causal_conv1d`` and ``ContextParallel.wrap`` without a
group; with the state deactivated ``None`` is the default group again (the world of 4), and
a state whose default group is not the current one is refused on every rank.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

import hf_ring
import hf_ring.mixers
from closeness import rel_err
from distributed import run_world
from reference_attention import full_attention

TOL = 1e-10
SEQ, HEADS, KV_HEADS, DIM = 16, 4, 2, 8


def _qkv(seed: int, batch: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, SEQ, h, DIM, generator=g, dtype=torch.float64)
                 for h in (HEADS, KV_HEADS, KV_HEADS))


class _SDPABlock(nn.Module):
    def forward(self, q, k, v):  # (batch, heads, seq, dim) each
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _errors(rank: int, world: int) -> dict:
    state = hf_ring.setup_context_parallel(2)
    assert state.cp_size == 2 and state.dp_size == 2
    shard = lambda x: hf_ring.shard_sequence(x, 2, state.cp_rank, dim=1)  # noqa: E731
    q, k, v = _qkv(100 + state.dp_rank)
    ref = shard(full_attention(q, k, v, causal=True)[0])
    err = {"ring": rel_err(hf_ring.ring_flash_attn_func(shard(q), shard(k), shard(v)), ref),
           "allgather": rel_err(hf_ring.context_parallel_attn_func(shard(q), shard(k), shard(v),
                                                                  pattern="allgather"), ref)}

    # A packed row of two documents, each zigzag-sharded over the pair on its own.
    bounds = [0, 8, SEQ]
    doc_shard = lambda x: torch.cat([hf_ring.shard_sequence(x[:, a:b], 2, state.cp_rank, dim=1)  # noqa: E731
                                     for a, b in zip(bounds, bounds[1:])], dim=1)
    doc_ids = torch.repeat_interleave(torch.arange(2), torch.tensor([8, SEQ - 8]))
    packed_ref = doc_shard(full_attention(q, k, v, causal=True, doc_ids=doc_ids)[0])
    out = hf_ring.ring_flash_attn_varlen_func(doc_shard(q)[0], doc_shard(k)[0], doc_shard(v)[0], bounds)
    err["varlen"] = rel_err(out, packed_ref[0])

    # The conv halo: with the world as the group, the first rank of the second pair would
    # take its halo from the first pair's tokens.
    g = torch.Generator().manual_seed(200 + state.dp_rank)
    x = torch.randn(1, 3, SEQ, generator=g, dtype=torch.float64)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64)
    conv_ref = F.conv1d(F.pad(x, (3, 0)), w.unsqueeze(1), groups=3)
    conv = hf_ring.mixers.context_parallel_causal_conv1d(hf_ring.shard_sequence(x, 2, state.cp_rank, dim=2), w)
    err["conv"] = rel_err(conv, hf_ring.shard_sequence(conv_ref, 2, state.cp_rank, dim=2))

    wrapped = hf_ring.ContextParallel.wrap(_SDPABlock())
    t = lambda x: shard(x).transpose(1, 2)  # noqa: E731
    err["wrap"] = rel_err(wrapped(t(q), t(k), t(v)).transpose(1, 2), ref)

    # No state: None is the default group, here the world of 4, one sequence over it.
    hf_ring.set_context_parallel_state(None)
    q4, k4, v4 = _qkv(300)
    shard4 = lambda x: hf_ring.shard_sequence(x, world, rank, dim=1)  # noqa: E731
    err["world_without_state"] = rel_err(hf_ring.ring_flash_attn_func(shard4(q4), shard4(k4), shard4(v4)),
                                         shard4(full_attention(q4, k4, v4, causal=True)[0]))

    # A state over another default group: refused, not replaced by the current world.
    hf_ring.set_context_parallel_state(dataclasses.replace(state, world_group=None))
    try:
        hf_ring.ring_flash_attn_func(shard(q), shard(k), shard(v))
        err["stale_refused"] = "no error"
    except RuntimeError as e:
        err["stale_refused"] = "setup_context_parallel(...) again" in str(e)
    return err


def test_group_none_means_the_active_states_cp_group():
    for rank, err in enumerate(run_world(4, _errors)):
        assert err.pop("stale_refused") is True, (rank, err)
        for name, e in err.items():
            assert e < TOL, (rank, name, e)


def test_timeout_takes_a_timedelta_or_seconds():
    from datetime import timedelta

    from hf_ring.patterns.state import as_timeout

    assert as_timeout(30) == timedelta(seconds=30) and as_timeout(1.5) == timedelta(seconds=1.5)
    assert as_timeout(timedelta(minutes=2)) == timedelta(minutes=2) and as_timeout(None) is None
    for bad in (0, -3, True, "60", timedelta(0)):
        try:
            as_timeout(bad)
        except ValueError as e:
            assert "timedelta or number of seconds" in str(e)
        else:
            raise AssertionError(f"timeout={bad!r} was accepted")


def _hybrid_forward_builds_no_group(rank: int, world: int) -> dict:
    from test_hf_attention import VOCAB, tiny_config, tiny_model
    import torch.distributed as dist

    state = hf_ring.setup_context_parallel(world, pattern="hybrid", ulysses_size=2)
    held = sorted(state.hybrid)
    built = []
    real = dist.new_group
    dist.new_group = lambda *a, **k: built.append(a) or real(*a, **k)
    try:
        config = tiny_config("llama")
        model = tiny_model(config, "ring_flash", tiny_model(config, "sdpa", seed=3).state_dict())
        ids = torch.randint(3, VOCAB, (1, 8 * world), generator=torch.Generator().manual_seed(4))
        shard = lambda x: hf_ring.shard_sequence(x, world, rank)  # noqa: E731
        logits = model(shard(ids), position_ids=shard(torch.arange(ids.shape[1])[None])).logits
        ref = shard(tiny_model(config, "sdpa", seed=3)(ids).logits)
    finally:
        dist.new_group = real
    return {"held": held, "built_in_forward": len(built), "err": rel_err(logits, ref)}


def test_the_hybrid_subgroups_are_built_up_front_not_in_a_forward():
    """setup_context_parallel(pattern="hybrid") builds the Ulysses and ring subgroups and the
    state holds them; a model's forward builds none (1e-4: float32, the softmax reordered)."""
    for r in run_world(4, _hybrid_forward_builds_no_group):
        assert r["held"] == [2] and r["built_in_forward"] == 0 and r["err"] < 1e-4, r
