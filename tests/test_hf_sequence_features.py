"""Model features computed along the sequence outside the attention function, exact under
context parallelism on gloo worlds of 2 and 4 (hf_ring.hf.sequence_features).

Each was refused before (hf_ring.hf.support bounded it by length): RoPE whose frequencies
depend on the length (dynamic NTK Llama, Phi-3 LongRoPE: the rotary is handed the batch's
largest position), Llama 4's attention temperature tuning on a NoPE layer (queries
rescaled to the tokens' global positions), and the sliding windows Qwen2-MoE and PhiMoE
apply through their mask only and Llama 4's chunked attention (read from the config and
handed to the ring, which cuts its blocks to them). Each case's
thresholds sit between the positions one rank holds and the sequence's, so a rank that
read its own shard would compute another function.

As in test_hf_attention_distributed: every rank feeds its zigzag shard with the global
position_ids; the ranks' logits, put back in order, must match one process running "sdpa"
on the full sequence within 1e-4 relative error, so must the loss (a fixed random
weighting of the logits, summed over the ranks) and every parameter's gradient (summed
over the ranks). Packed rows (per-document zigzag shards) are compared with "sdpa" on the
whole packed row, which transformers masks per document from the position_ids, and whose
RoPE and temperature read the row's positions as a whole. One spawn per world size.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoConfig

import hf_ring
from distributed import run_world
from hf_ring.sharding import shard_packed, unshard_packed
from closeness import grads, rel_err
from test_hf_attention import _COMMON, VOCAB, tiny_model

TRANSFORMERS_5 = Version(transformers.__version__) >= Version("5.0.0.dev0")
TOL = 1e-4
GRAD_FLOOR = 1e-3
BATCH = 2
WINDOW = 4
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_LLAMA4 = dict(head_dim=16, num_local_experts=2, intermediate_size_mlp=128, no_rope_layers=[1, 0],
               attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, attention_chunk_size=8192,
               layer_types=["full_attention", "full_attention"])


def _seq(world: int) -> int:
    return 8 * world  # a zigzag chunk of 4 tokens per rank and half


def _rope(rope_type: str, **parameters) -> dict:
    """RoPE parameters as the installed transformers takes them."""
    if TRANSFORMERS_5:
        return {"rope_parameters": {"rope_type": rope_type, "rope_theta": 10000.0, **parameters}}
    return {"rope_scaling": {"rope_type": rope_type, **parameters}}


def _threshold(world: int, packed: bool) -> int:
    """A length at least the largest position + 1 that rank world - 1 holds, and below the
    sequence's (the longest document's): zigzag gives that rank the two middle chunks,
    positions up to 4 * world + 3 of the dense row (8 * world tokens) and up to 2 * world + 1
    of the longest packed document (4 * world tokens), and gives rank 0 the last chunk."""
    return 4 * world - 2 if packed else _seq(world) - 4


def _config(name: str, threshold: int):
    if name == "llama_dynamic":
        return AutoConfig.for_model("llama", **{**_COMMON, "max_position_embeddings": threshold},
                                    **_rope("dynamic", factor=4.0))
    if name == "phi3_longrope":
        factors = dict(short_factor=[1.0] * 8, long_factor=[1.0 + 0.5 * i for i in range(8)])
        # 4.57's Phi-3 config wants exactly type and the two factors; 5.x reads the threshold
        # from rope_parameters too.
        parameters = (_rope("longrope", original_max_position_embeddings=threshold, **factors) if TRANSFORMERS_5
                      else {"rope_scaling": {"type": "longrope", **factors}})
        return AutoConfig.for_model("phi3", **_COMMON, original_max_position_embeddings=threshold, **parameters)
    if name == "llama4_temperature":
        return AutoConfig.for_model("llama4_text", **_COMMON, **_LLAMA4)
    if name == "llama4_chunked":
        # Layer 0 (RoPE) attends within chunks of 6 tokens, which straddle the zigzag
        # pieces of 4 (blocks on a chunk edge are masked); layer 1 tunes its temperature.
        return AutoConfig.for_model("llama4_text", **_COMMON, **{**_LLAMA4, "attention_chunk_size": 6,
                                                                 "layer_types": None})
    if name == "qwen2_moe_window":
        # Layer 0 slides (layer_types from max_window_layers), layer 1 does not.
        return AutoConfig.for_model("qwen2_moe", **_COMMON, **_MOE, use_sliding_window=True,
                                    sliding_window=WINDOW, max_window_layers=2)
    if name == "phimoe_window":
        # No router jitter: in training, PhiMoE's sparsemixer samples among the experts within
        # it (Gumbel), which no two runs draw alike; at 0 only the top expert is a candidate.
        return AutoConfig.for_model("phimoe", **_COMMON, num_local_experts=4, sliding_window=WINDOW,
                                    router_jitter_noise=0.0)
    raise ValueError(name)


# Qwen2-MoE and PhiMoE pick their attention class from a table in 4.57, which ring_flash
# refuses at creation (test_model_support): their mask-only windows are transformers 5's.
DENSE = ("llama_dynamic", "phi3_longrope", "llama4_temperature", "llama4_chunked",
         *(("qwen2_moe_window", "phimoe_window") if TRANSFORMERS_5 else ()))
PACKED = ("llama_dynamic", "llama4_temperature")


def _case(name: str, world: int, seed: int, packed: bool) -> dict:
    config = _config(name, _threshold(world, packed))
    g = torch.Generator().manual_seed(seed + 100)
    case = {"config": config, "state_dict": tiny_model(config, "sdpa", seed=seed).state_dict()}
    if packed:
        lens = [2 * world, 4 * world, 2 * world]  # each a multiple of 2 * cp_size
        total = sum(lens)
        case["cu"] = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        case["positions"] = torch.cat([torch.arange(n) for n in lens])[None]
        case["ids"] = torch.randint(3, VOCAB, (1, total), generator=g)
    else:
        case["positions"] = torch.arange(_seq(world)).expand(BATCH, -1)
        case["ids"] = torch.randint(3, VOCAB, (BATCH, _seq(world)), generator=g)
    case["weights"] = torch.randn(*case["ids"].shape, VOCAB, generator=g)
    return case


def case_shard(case: dict, rank: int, world: int, layout: str = "zigzag") -> tuple[Callable, dict]:
    """How rank ``rank`` of ``world`` cuts a case's full-row tensors (per document on a packed
    row, ``case["cu"]``; else in ``layout``), and the packed row's keyword arguments."""
    if "cu" not in case:
        return (lambda x: hf_ring.shard_sequence(x, world, rank, layout=layout)), {}
    cu = case["cu"]
    longest = int((cu[1:] - cu[:-1]).max())
    extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return (lambda x: shard_packed(x, cu, world, rank)), extra


def _on_rank(case: dict, rank: int, world: int) -> dict:
    model = tiny_model(case["config"], "ring_flash", case["state_dict"]).train()
    shard, extra = case_shard(case, rank, world)
    logits = model(shard(case["ids"]), position_ids=shard(case["positions"]), **extra).logits
    loss = (logits.double() * shard(case["weights"]).double()).sum()
    loss.backward()
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": grads(model, zeros_for_missing=True)}


def _rank_main(rank: int, world: int, cases: dict) -> dict:
    hf_ring.setup_context_parallel(world)
    return {key: _on_rank(case, rank, world) for key, case in cases.items()}


def _reference(case: dict) -> dict:
    model = tiny_model(case["config"], "sdpa", case["state_dict"]).train()
    # No cache: transformers then reads packed documents from the position_ids.
    logits = model(case["ids"], position_ids=case["positions"], use_cache=False).logits
    loss = (logits.double() * case["weights"].double()).sum()
    loss.backward()
    scale = (logits.double() * case["weights"].double()).abs().sum()
    return {"logits": logits.detach(), "loss": loss.detach(), "scale": scale.detach(), "grads": grads(model, zeros_for_missing=True)}


_RUNS: dict[int, tuple] = {}


def _run(world: int) -> tuple:
    """One spawn per world size, shared by every test of this module."""
    if world not in _RUNS:
        cases = {(name, False): _case(name, world, seed=i, packed=False) for i, name in enumerate(DENSE)}
        cases.update({(name, True): _case(name, world, seed=50 + i, packed=True) for i, name in enumerate(PACKED)})
        _RUNS[world] = (cases, run_world(world, _rank_main, cases))
    return _RUNS[world]


def compare(case: dict, logits: torch.Tensor, loss: torch.Tensor, grads: dict) -> dict[str, float]:
    """Relative errors against "sdpa" on the full sequence of ``logits`` (put back in order),
    ``loss`` (against the sum of its terms' magnitudes: random signs can nearly cancel) and
    the worst parameter gradient of ``grads``."""
    reference = _reference(case)
    largest = max(float(g.norm()) for g in reference["grads"].values())
    worst = 0.0
    for n, ref in reference["grads"].items():
        # A gradient the loss barely reaches (an expert no token picked: 0) is float noise
        # relative to itself; it must then be as small against the largest gradient.
        worst = max(worst, float((grads[n] - ref).double().norm()) / max(float(ref.norm()), GRAD_FLOOR * largest))
    return {
        "logits": rel_err(logits, reference["logits"]),
        "loss": abs(float(loss - reference["loss"])) / float(reference["scale"]),
        "grad": worst,
    }


def errors(world: int, name: str, packed: bool) -> dict[str, float]:
    """The case's errors under CP: logits unsharded, loss and gradients summed over ranks."""
    cases, ranks = _run(world)
    case = cases[(name, packed)]
    mine = [r[(name, packed)] for r in ranks]
    shards = [m["logits"] for m in mine]
    logits = unshard_packed(shards, case["cu"]) if packed else hf_ring.unshard_sequence(shards)
    summed = {n: sum(m["grads"][n] for m in mine) for n in mine[0]["grads"]}
    return compare(case, logits, sum(m["loss"] for m in mine), summed)


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"world{w}")
@pytest.mark.parametrize("name", DENSE)
def test_dense_rows_match_the_full_sequence(world, name):
    found = errors(world, name, packed=False)
    assert max(found.values()) <= TOL, found


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"world{w}")
@pytest.mark.parametrize("name", PACKED)
def test_packed_rows_match_the_whole_packed_row(world, name):
    found = errors(world, name, packed=True)
    assert max(found.values()) <= TOL, found


@pytest.mark.parametrize("name", PACKED)
def test_packed_rows_without_cp_match_the_whole_packed_row(name):
    # One process, no CP state: the varlen ring runs on the whole row, whose rotary and
    # temperature read the row's own positions (no longer bounded by model support).
    case = _case(name, 2, seed=70, packed=True)
    mine = _on_rank(case, 0, 1)
    found = compare(case, mine["logits"], mine["loss"], mine["grads"])
    assert max(found.values()) <= TOL, found
