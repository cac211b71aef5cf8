"""The hot path under context parallelism: validated once per forward, then trusted.

One training step (forward and backward) of a tiny Llama at cp=2 must issue the same
number of collectives (other than the ring's P2P transfers) and of host syncs whatever
the number of layers: the model-level check runs once per forward, and no attention
layer repeats a collective or a host sync. The ring's own transfers do grow with the
layers (which shows the counter sees the ring at all). Exact counts, no tolerance.

Also: ranks whose inputs differ in shape, or where only one rank's inputs are refused,
get an error on every rank instead of a gloo abort or a hang; ``labels`` passed to the
model under CP are refused (its loss would be a per-shard mean); and a forward that only
some ranks of a CP group run fails on those ranks within the group's timeout (20 s here;
the bound allows 30 s of slack for a loaded machine), naming the likely cause.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
from transformers import AutoModelForSequenceClassification

import hf_ring
from collective_counter import count_calls
from distributed import run_world
from test_hf_attention import VOCAB, tiny_config, tiny_model

SEQ = 16
LAYERS = (2, 8)
TIMEOUT_S = 10  # also bounds the groups' creation: leave room for a slow start on a busy machine


def _step(model, ids, positions, weights) -> None:
    logits = model(ids, position_ids=positions).logits
    (logits * weights).sum().backward()


def _counts_per_depth(rank: int, world: int) -> dict:
    hf_ring.setup_context_parallel(world)
    g = torch.Generator().manual_seed(0)
    full_ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
    shard = lambda x: hf_ring.shard_sequence(x, world, rank)  # noqa: E731
    ids, positions = shard(full_ids), shard(torch.arange(SEQ).expand(2, -1))
    weights = shard(torch.randn(2, SEQ, VOCAB, generator=g))
    result = {}
    for layers in LAYERS:
        model = tiny_model(tiny_config("llama", num_hidden_layers=layers), "ring_flash").train()
        _step(model, ids, positions, weights)  # first call: one-time set-up is not counted
        with count_calls() as counts:
            _step(model, ids, positions, weights)
        result[layers] = dict(counts)
    return result


def test_collectives_and_host_syncs_do_not_grow_with_layers():
    for per_depth in run_world(2, _counts_per_depth):
        shallow, deep = per_depth[LAYERS[0]], per_depth[LAYERS[1]]
        assert shallow.get("collective", 0) == deep.get("collective", 0), per_depth
        assert shallow.get("host_sync", 0) == deep.get("host_sync", 0), per_depth
        # One model-level header check per forward, nothing per layer.
        assert shallow.get("collective", 0) == 1, per_depth
        # The ring itself runs per layer; at cp=2 per layer: 1 K/V transfer in the forward,
        # 1 K/V and 2 dK/dV transfers in the backward.
        assert deep["p2p"] == 4 * LAYERS[1] and shallow["p2p"] == 4 * LAYERS[0], per_depth


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts on the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _divergent(rank: int, world: int) -> dict:
    hf_ring.setup_context_parallel(world)
    model = tiny_model(tiny_config("llama"), "ring_flash")
    batch = 2 if rank == 0 else 3
    ids = torch.randint(3, VOCAB, (batch, SEQ // world))
    positions = hf_ring.shard_sequence(torch.arange(SEQ).expand(batch, -1), world, rank)
    same_ids = ids[:2]
    return {
        "batch": _error_of(lambda: model(ids, position_ids=positions)),
        # Only rank 1 asks for a cache: refused there, and the other rank must not wait.
        "one_rank_refused": _error_of(
            lambda: model(same_ids, position_ids=positions[:2], use_cache=(rank == 1) or None)
        ),
        "after": _error_of(lambda: model(same_ids, position_ids=positions[:2])),
        # A model's own loss under CP would be a per-shard mean: refused.
        "labels": _error_of(lambda: model(same_ids, position_ids=positions[:2], labels=same_ids)),
        # A head that pools over the sequence would pool over the shard: refused.
        "pooling_head": _error_of(lambda: _classifier()(same_ids, position_ids=positions[:2])),
    }


def _classifier():
    config = tiny_config("llama", num_labels=3)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="ring_flash")


def test_divergent_inputs_fail_on_every_rank():
    r0, r1 = run_world(2, _divergent)
    for r in (r0, r1):
        assert "differ across the ranks" in r["batch"] and "batch: rank 0 2, rank 1 3" in r["batch"], r
        assert r["after"] == "no error", r
    assert "without gradients: a cache is for inference" in r1["one_rank_refused"], r1
    assert "CP rank(s) [1] refused" in r0["one_rank_refused"], r0
    for r in (r0, r1):
        assert "ValueError" in r["labels"] and "mean over this rank's shard" in r["labels"], r
        assert "LlamaForSequenceClassification puts a head" in r["pooling_head"], r


def _subset_forward(rank: int, world: int, done: str) -> str:
    # Through the plugin, as a Trainer user sets it: its timeout is the CP group's.
    state = hf_ring.RingAttentionPlugin(cp_size=world, timeout=TIMEOUT_S).setup()
    assert state.timeout == timedelta(seconds=TIMEOUT_S), state.timeout
    model = tiny_model(tiny_config("llama"), "ring_flash")
    ids = torch.randint(3, VOCAB, (1, SEQ // world))
    positions = hf_ring.shard_sequence(torch.arange(SEQ)[None], world, rank)
    if rank != 0:
        # As if only the main process ran a sanity forward: this rank is busy elsewhere and
        # keeps the group alive until rank 0 is done (bounded, should rank 0 never be).
        deadline = time.monotonic() + TIMEOUT_S + 120
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.2)
        return "did not run"
    start = time.monotonic()
    message = _error_of(lambda: model(ids, position_ids=positions))
    elapsed = time.monotonic() - start
    open(done, "w").close()
    return f"{message} after {elapsed:.1f}s"


def test_forward_on_some_ranks_only_fails_within_the_timeout(tmp_path):
    r0, _ = run_world(2, _subset_forward, str(tmp_path / "rank0_done"))
    assert "RuntimeError" in r0 and "every rank of a CP group must run every forward" in r0, r0
    assert "The timeout is RingAttentionPlugin(timeout=...)" in r0, r0
    seconds = float(r0.rsplit("after ", 1)[1].rstrip("s"))
    assert seconds < TIMEOUT_S + 30, r0


def _packed_counts_per_depth(rank: int, world: int) -> dict:
    """As :func:`_counts_per_depth`, for one packed row of three documents (8, 16 and 8
    tokens, each zigzag-sharded on its own) through the varlen ring."""
    from hf_ring.sharding import shard_packed

    hf_ring.setup_context_parallel(world)
    lens = (8, 16, 8)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (1, sum(lens)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    weights = torch.randn(1, sum(lens), VOCAB, generator=g)
    shard = lambda x: shard_packed(x, cu, world, rank)  # noqa: E731
    documents = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))
    result = {}
    for layers in LAYERS:
        model = tiny_model(tiny_config("llama", num_hidden_layers=layers), "ring_flash").train()

        def step():
            logits = model(shard(ids), position_ids=shard(positions), **documents).logits
            (logits * shard(weights)).sum().backward()

        step()  # first call: one-time set-up is not counted
        with count_calls() as counts:
            step()
        result[layers] = dict(counts)
    return result


def test_packed_rows_sync_the_host_per_forward_not_per_layer():
    """Packed rows: the document boundaries are read on the host once per forward (the
    guard), never in a layer; measured 12 host syncs and 1 collective per training step at
    2 layers and at 8."""
    for per_depth in run_world(2, _packed_counts_per_depth):
        shallow, deep = per_depth[LAYERS[0]], per_depth[LAYERS[1]]
        assert shallow.get("host_sync", 0) == deep.get("host_sync", 0), per_depth
        assert shallow.get("collective", 0) == deep.get("collective", 0) == 1, per_depth
        assert deep["p2p"] == 4 * LAYERS[1] and shallow["p2p"] == 4 * LAYERS[0], per_depth
