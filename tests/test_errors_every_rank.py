"""A set-up refused on one rank is raised on every rank (issue 22), within seconds.

Gloo world of 2, spawned. ``hf_ring.distributed.errors.raise_together`` with a check that fails
on rank 1 only: rank 1 raises its own error, rank 0 an error of the same type naming rank 1
and quoting the message (before, rank 0 went on to its next collective and died with the
transport's "connection closed by peer"). Then the case users met: ``RingTrainer`` given a
``RingDataCollator`` built by hand with ``cp_size=2`` and no ``cp_rank`` (so 0 on both ranks):
rank 1's collator shards for rank 0, and both ranks raise the collator error.
"""

from __future__ import annotations

import os

import torch

from distributed import run_world


def _check_on_rank_one(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank one's inputs are wrong")


def _trainer_with_a_hand_made_collator(tmp: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    import hf_ring

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("ring_flash")
    args = TrainingArguments(output_dir=tmp, report_to=[], use_cpu=True, max_steps=1)
    hf_ring.RingTrainer(model=model, args=args, ring_plugin=hf_ring.RingAttentionPlugin(cp_size=2),
                        data_collator=hf_ring.RingDataCollator(0, cp_size=2))


def _rank_main(rank: int, world: int, tmp: str) -> dict:
    from hf_ring.distributed.errors import raise_together

    out = {}
    try:
        raise_together(lambda: _check_on_rank_one(rank))
    except ValueError as e:
        out["generic"] = str(e)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    try:
        _trainer_with_a_hand_made_collator(tmp)
        out["trainer"] = "no error"
    except ValueError as e:
        out["trainer"] = str(e)
    return out


def test_one_ranks_refusal_is_raised_on_every_rank(tmp_path):
    ranks = run_world(2, _rank_main, str(tmp_path))
    assert ranks[1]["generic"] == "rank one's inputs are wrong"
    assert "rank(s) [1]" in ranks[0]["generic"] and "rank one's inputs are wrong" in ranks[0]["generic"]
    assert "the data collator shards for cp_size=2, cp_rank=0" in ranks[1]["trainer"], ranks[1]["trainer"]
    assert "rank(s) [1]" in ranks[0]["trainer"] and "cp_rank=0" in ranks[0]["trainer"], ranks[0]["trainer"]
