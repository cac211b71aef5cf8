"""benchmarks/model_state_memory.py: its arithmetic, and its measurement on a 2-rank world.

The parameter count formula is checked against a model transformers builds; the projection
against Llama-3-8B's published size (8.03 B) and bytes-per-parameter x count / ranks; the
measurement (one spawned gloo world of 2 running DDP, FSDP2 and ZeRO-3 in turn on a tiny
Llama) against what each strategy must hold in float32 with AdamW: DDP the whole model
three times over plus its gradients (4 + 4 + 8 bytes per parameter, and AdamW's 4-byte
step counter per tensor), FSDP2 half of that per rank and ZeRO-3 half of that plus its
fp32 master copy, up to the padding that makes each tensor divisible by the number of ranks.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("model_state_memory",
                                                  os.path.join(ROOT, "benchmarks", "model_state_memory.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look their module up there
    spec.loader.exec_module(module)
    return module


def test_parameter_count_matches_transformers(bench):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = bench.ModelShape(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(LlamaConfig(**vars(shape)))
    assert shape.num_parameters() == sum(p.numel() for p in model.parameters())


def test_llama3_8b_projection(bench):
    projection = bench.project(bench.ModelShape(**bench.LLAMA3_8B), [8, 16, 64])
    params = projection["num_parameters"]
    assert params == 8_030_261_248  # Llama-3-8B's published parameter count
    rows = {(r["strategy"], r["ranks"]): r for r in projection["rows"]}
    for n in (8, 16, 64):
        assert rows["ddp", n]["bytes_per_rank"] == 16 * params  # replicated: no fall with n
        for strategy in ("fsdp2", "zero3"):
            assert rows[strategy, n]["bytes_per_param"] == 16
            assert rows[strategy, n]["bytes_per_rank"] == 16 * params / n
    assert rows["ddp", 8]["gib_per_rank"] == pytest.approx(119.66, abs=0.01)
    assert rows["zero3", 64]["gib_per_rank"] == pytest.approx(1.87, abs=0.01)


def test_measured_bytes_per_rank(bench):
    shape = bench.ModelShape(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
    world = 2
    got = bench.measure(list(bench.STRATEGIES), world, shape, seq_len=16)
    elements = shape.num_parameters()
    tensors = 2 * 9 + 3  # per layer: 7 linear weights and 2 norms; embeddings, final norm, head
    full = 4 * elements
    for rank in got["ddp"]:
        assert (rank["parameters"], rank["gradients"]) == (full, full)
        assert rank["optimizer"] == 2 * full + 4 * tensors  # AdamW's moments and step counters
    # Each tensor padded to a multiple of world: ZeRO-3 by elements, FSDP2 by rows of dim 0.
    padding = 4 * world * tensors * max(shape.hidden_size, shape.intermediate_size)
    # float32 copies of the model each holds, sharded: FSDP2 weights, gradients and two
    # moments; ZeRO-3 also a master copy of the weights.
    for strategy, copies in (("fsdp2", 4), ("zero3", 5)):
        ranks = got[strategy]
        for kind in ("parameters", "gradients"):
            assert full <= sum(r[kind] for r in ranks) <= full + padding, (strategy, kind)
        for r in ranks:
            assert r["model_state"] <= copies * (full / world + padding) + 4 * tensors, (strategy, r)
    for r in got["zero3"]:
        # The fp32 master partition is a copy of its own beside the parameter partition.
        assert r["optimizer"] == 3 * r["parameters"] + 4, r
