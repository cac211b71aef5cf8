"""The N-D cost model's ring bytes (benchmarks/nd_cost_model.py) against what the ring sends.

A tiny Llama (3 layers, 4 query / 2 K/V heads of 16, 128 tokens) through ``ring_flash`` at
cp 2 on 2 gloo ranks, one forward and one backward, in float32 and bfloat16, with and
without gradient checkpointing. Each rank wraps the transport the ring opens
(``hf_ring.patterns.plan.process_group_transport``) and adds up ``send.nbytes``; the bytes
per layer must equal ``ring_bytes_per_layer`` exactly (integers: nothing to tolerate). The
model's other terms are arithmetic on stated assumptions (docs/parallelism_costs.md).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch

from distributed import run_world

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import nd_cost_model  # noqa: E402

LAYERS, HIDDEN, HEADS, KV_HEADS, SEQ, VOCAB, CP = 3, 64, 4, 2, 128, 64, 2


class _Counting:
    """An exchange of the ring's transport that counts what it sends."""

    def __init__(self, inner, sent: Counter) -> None:
        self.inner, self.sent = inner, sent

    def start(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        self.sent["bytes"] += send.nbytes
        self.inner.start(send, recv)

    def wait(self) -> None:
        self.inner.wait()


def _ring_bytes(rank: int, world: int) -> dict[str, int]:
    """Bytes this rank's ring sent per layer, by dtype and checkpointing."""
    import hf_ring
    import hf_ring.patterns.plan as plan_module
    from transformers import AutoModelForCausalLM, LlamaConfig

    sent: Counter = Counter()
    real = plan_module.process_group_transport
    plan_module.process_group_transport = lambda group, stats=None: (
        lambda channel, inner=real(group, stats): _Counting(inner(channel), sent))
    try:
        hf_ring.setup_context_parallel(CP, pattern="ring")
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            for checkpointing in (False, True):
                torch.manual_seed(0)
                config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                     num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                     num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ)
                model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_flash").to(dtype).train()
                if checkpointing:
                    model.gradient_checkpointing_enable()
                ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
                sent.clear()
                logits = model(hf_ring.shard_sequence(ids, CP, rank),
                               position_ids=hf_ring.shard_sequence(torch.arange(SEQ)[None], CP, rank)).logits
                logits.float().sum().backward()
                out[f"{dtype}, checkpointing {checkpointing}"] = sent["bytes"] // LAYERS
        return out
    finally:
        plan_module.process_group_transport = real


def test_the_cost_models_ring_bytes_are_what_the_ring_sends():
    measured = run_world(2, _ring_bytes)
    assert measured[0] == measured[1]
    tokens = SEQ // CP
    for case, got in measured[0].items():
        act = 4 if "float32" in case else 2
        kv = nd_cost_model.kv_block_bytes(tokens, KV_HEADS, HIDDEN // HEADS, act)
        forwards = 2 if case.endswith("True") else 1
        assert got == nd_cost_model.ring_bytes_per_layer(kv, CP, forwards, act, 4), (case, got)


def test_the_cost_model_runs_and_reports_every_axis():
    """The script's tables come from one function per axis; a layout's axes that do not exist
    send nothing, and the CP terms vanish at cp 1."""
    m, a = nd_cost_model.MODELS["llama3_8b"], nd_cost_model.Assumptions()
    tp_only = nd_cost_model.communication(m, nd_cost_model.parse_layout("tp8"), a)
    cp_only = nd_cost_model.communication(m, nd_cost_model.parse_layout("cp8"), a)
    assert tp_only["cp"] == 0 and tp_only["tp"] > 0
    assert cp_only["tp"] == 0 and cp_only["cp"] > 0 and cp_only["fsdp"] > 0


def test_the_pipeline_lines_follow_their_stated_terms():
    """benchmarks/pp_cost_model.py (modelled): the bubbles are the formulas benchmarks/pipeline.py
    measures the schedules against; under 1F1B the first rank's checkpoints in flight (min(m, p)
    micro-batches of L / p layers) are the whole model's for one micro-batch at every pp <= m;
    the state per rank falls with pp; the p2p bytes are m x 4 x n x hidden a step; a 1F1B step
    is (m + p - 1) micro-batch stage times."""
    import pipeline
    import pp_cost_model

    m, a = pp_cost_model.MODELS["llama3_70b"], nd_cost_model.Assumptions()
    rows = {p: pp_cost_model.evaluate(m, "tp8xcp4", p, 16, a) for p in (1, 2, 4, 8)}
    for p, row in rows.items():
        for name, v in (("1F1B", 1), ("Interleaved1F1B", 2)):
            assert abs(row.bubble[name] - (pipeline.FORMULA[name](p, 16, v) if p > 1 else 0)) < 1e-12
        assert abs(row.memory_gib["checkpoints_1f1b"] - rows[1].memory_gib["checkpoints_1f1b"]) < 1e-9
        assert abs(row.seconds["1F1B"] - (16 + p - 1) * row.seconds["micro_batch_stage"]) < 1e-9
    assert rows[8].p2p_gb["1F1B"] == 16 * 4 * (131072 // 4) * 8192 / nd_cost_model.GB and rows[1].p2p_gb["1F1B"] == 0
    states = [rows[p].memory_gib["state"] for p in (1, 2, 4, 8)]
    assert states == sorted(states, reverse=True) and states[3] < states[0] / 7
    assert rows[2].memory_gib["GPipe"] > rows[2].memory_gib["Interleaved1F1B"] > rows[2].memory_gib["1F1B"]
