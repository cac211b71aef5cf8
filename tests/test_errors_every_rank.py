"""A set-up refused on one rank is raised on every rank (issue 22), within seconds.

Gloo world of 2, spawned. ``hf_ring.distributed.errors.raise_together`` with a check that fails
on rank 1 only: rank 1 raises its own error, rank 0 an error of the same type naming rank 1
and quoting the message (before, rank 0 went on to its next collective and died with the
transport's "connection closed by peer"). Then the case users met: ``RingTrainer`` given a
``RingDataCollator`` built by hand with ``cp_size=2`` and no ``cp_rank`` (so 0 on both ranks):
rank 1's collator shards for rank 0, and both ranks raise the collator error. Last, a LoRA
model whose base carries the markers transformers sets when it loads one with bitsandbytes
4-bit (``is_quantized``, ``quantization_method``, ``is_loaded_in_4bit``, ``hf_quantizer``,
``config.quantization_config``), on rank 1 only: QLoRA under CP is refused on both ranks; and
``torch_compile=True`` beside gradient checkpointing, and beside FSDP2 with the whole model
compiled, is refused on both.
"""

from __future__ import annotations

import os

import torch

import pytest
import transformers
from packaging.version import Version

from distributed import free_port, run_world

TRANSFORMERS_5 = Version(transformers.__version__) >= Version("5")

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)


def _check_on_rank_one(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank one's inputs are wrong")


def _tiny_ring_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("ring_flash")
    return model


def mark_as_bnb_4bit(model: torch.nn.Module) -> None:
    """What transformers' bitsandbytes 4-bit quantizer sets on a model it loads (transformers
    5.24, quantizers/base.py and quantizer_bnb_4bit.py), without bitsandbytes."""
    from types import SimpleNamespace

    from transformers.utils.quantization_config import QuantizationMethod

    model.is_quantized = True
    model.quantization_method = QuantizationMethod.BITS_AND_BYTES
    model.is_loaded_in_4bit = True
    model.hf_quantizer = SimpleNamespace(is_trainable=True, is_qat_trainable=False)
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}


def _trainer(tmp: str, model: torch.nn.Module, collator, **options) -> None:
    from transformers import TrainingArguments

    import hf_ring

    args = TrainingArguments(output_dir=tmp, report_to=[], use_cpu=True, max_steps=1, **options)
    hf_ring.RingTrainer(model=model, args=args, ring_plugin=hf_ring.RingAttentionPlugin(cp_size=2),
                        data_collator=collator)


def _quantised_lora_on_rank_one(rank: int, tmp: str) -> None:
    from peft import LoraConfig, get_peft_model

    import hf_ring

    model = _tiny_ring_llama()
    if rank == 1:
        mark_as_bnb_4bit(model)
    model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    _trainer(tmp, model, hf_ring.RingDataCollator(0, cp_size=2, cp_rank=rank))


def _rank_main(rank: int, world: int, tmp: str, port: int) -> dict:
    from hf_ring.distributed.errors import raise_together

    out = {}
    try:
        raise_together(lambda: _check_on_rank_one(rank))
    except ValueError as e:
        out["generic"] = str(e)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import hf_ring

    try:
        _trainer(tmp, _tiny_ring_llama(), hf_ring.RingDataCollator(0, cp_size=2))  # cp_rank 0 on both ranks
        out["trainer"] = "no error"
    except ValueError as e:
        out["trainer"] = str(e)
    try:
        # Compiled under CP, but not with gradient checkpointing (its recompute outlives the forward's context).
        _trainer(tmp, _tiny_ring_llama(), hf_ring.RingDataCollator(0, cp_size=2, cp_rank=rank), torch_compile=True,
                 gradient_checkpointing=True)
        out["compiled"] = "no error"
    except NotImplementedError as e:
        out["compiled"] = str(e)
    try:
        # FSDP2 with the whole model compiled: refused, pointing to per-layer (regional) compilation.
        from hf_ring.training.weight_sharding import fsdp_training_arguments
        _trainer(tmp, _tiny_ring_llama(), hf_ring.RingDataCollator(0, cp_size=2, cp_rank=rank), torch_compile=True,
                 ddp_find_unused_parameters=False, **fsdp_training_arguments("full_shard", 2, world))
        out["compiled_fsdp"] = "no error"
    except NotImplementedError as e:
        out["compiled_fsdp"] = str(e)
    try:
        _quantised_lora_on_rank_one(rank, tmp)
        out["quantised"] = "no error"
    except NotImplementedError as e:
        out["quantised"] = str(e)
    return out


def test_one_ranks_refusal_is_raised_on_every_rank(tmp_path):
    ranks = run_world(2, _rank_main, str(tmp_path), free_port())
    assert ranks[1]["generic"] == "rank one's inputs are wrong"
    assert "rank(s) [1]" in ranks[0]["generic"] and "rank one's inputs are wrong" in ranks[0]["generic"]
    assert "the data collator shards for cp_size=2, cp_rank=0" in ranks[1]["trainer"], ranks[1]["trainer"]
    assert "rank(s) [1]" in ranks[0]["trainer"] and "cp_rank=0" in ranks[0]["trainer"], ranks[0]["trainer"]
    for r in ranks:  # refused where every rank sees it, so on every rank at once
        assert "TrainingArguments(torch_compile=True) under context parallelism" in r["compiled"], r["compiled"]
        assert "not with gradient_checkpointing=True" in r["compiled"], r["compiled"]
        if TRANSFORMERS_5:  # FSDP2 through TrainingArguments (on 4.x refused before, by weight_sharding)
            assert "FSDP2 with the whole model compiled" in r["compiled_fsdp"], r["compiled_fsdp"]
            assert "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1" in r["compiled_fsdp"], r["compiled_fsdp"]
    refusal = ranks[1]["quantised"]
    for words in ("quantization_method='bitsandbytes'", "is_loaded_in_4bit", "not tested under context parallelism",
                  "cp_size=2", "cp_size=1", "load it unquantised"):
        assert words in refusal, (words, refusal)
    assert "rank(s) [1]" in ranks[0]["quantised"] and "bitsandbytes" in ranks[0]["quantised"], ranks[0]["quantised"]
