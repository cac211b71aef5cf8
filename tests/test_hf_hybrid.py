"""Hybrid and recurrent models under context parallelism on gloo worlds of 2 and 4, zigzag,
transformers 5.24: gated delta nets (Qwen3.5 dense and MoE, Qwen3-Next, OLMo hybrid,
LARA-mini), short convolutions (LFM2, LFM2-MoE, LFM3), Mamba-2 (Granite 4 hybrid,
Nemotron-H, Falcon-H1, Bamba, Zamba2, Mamba-2), Mamba-1 (Jamba, Zamba, Mamba,
Falcon-Mamba) and Kimi delta attention (Kimi Linear, Bailing hybrid).

Each model is the sweep's tiny config: token-mixer layers, and full-attention layers
where the family has them. Each rank feeds its zigzag shard with the global ``position_ids``; the
ranks' logits, put back in order, must match one process running "sdpa" on the full
sequence within 1e-4 relative error (float32), and every parameter's gradient, summed over
the ranks, within 1e-4; the loss is a fixed random weighting of the logits (its sum over
ranks is the full-sequence loss). The gradients of a gated delta net's decay parameters
and of an SSM's (``A_log``, ``dt_bias``, ``D``: a few entries, sums over every token that
nearly cancel) are ~1e-3 apart between float32 and float64 even in one process, so each
gradient is also measured against a float64 run of the full sequence (its recurrences
hf_ring's ops in one process: transformers' own compute in float32 whatever the input):
CP's error there must stay within 1e-4 or within twice the float32 single process's own. Packed rows (each document zigzag-sharded on its own)
are compared with the documents run one by one, at cp 2 and 4 and without CP. The world of 2 also checks that a layer
whose mixer bypasses hf_ring's CP ops is refused after the forward.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch

import hf_ring
from distributed import run_world
from hf_ring.mixers import (
    context_parallel_gated_delta_rule,
    context_parallel_kimi_delta_attention,
    context_parallel_selective_scan,
    context_parallel_ssd,
)
from hf_ring.patches.transformers import release_line
from hf_ring.sharding import shard_packed
from model_sweep_configs import build_config
from closeness import grads, rel_err
from test_hf_attention import tiny_model

pytestmark = pytest.mark.skipif(
    release_line(__import__("transformers").__version__) != "5",
    reason="token mixers are routed to hf_ring's CP mixers on transformers 5.x only",
)

TOL = 1e-4
BATCH = 2
FAMILIES = (
    "qwen3_5_text", "qwen3_next", "olmo_hybrid", "qwen3_5_moe_text", "lara_mini",  # gated delta nets
    "lfm2", "lfm2_moe", "lfm3",  # short convolutions
    "granitemoehybrid", "nemotron_h", "falcon_h1", "bamba", "zamba2", "mamba2",  # Mamba-2
    "jamba", "zamba", "mamba", "falcon_mamba",  # Mamba-1
    "kimi_linear", "bailing_hybrid",  # Kimi delta attention
)
# Packed rows, one family per kind of mixer.
PACKED = ("qwen3_next", "lfm2", "granitemoehybrid", "jamba", "kimi_linear", "mamba")


def _plain_model(config, state_dict=None, seed: int = 0):
    """The one-process reference: SDPA, or eager for a family without it (pure Mamba)."""
    try:
        return tiny_model(config, "sdpa", state_dict, seed=seed)
    except ValueError:
        return tiny_model(config, "eager", state_dict, seed=seed)


def _case(family: str, world: int, seed: int, doc_lens=None) -> dict:
    config = build_config(family)
    vocab = config.vocab_size
    g = torch.Generator().manual_seed(seed)
    rows, seq = (1, sum(doc_lens)) if doc_lens else (BATCH, 16 * world)
    return {
        "config": config,
        "state_dict": _plain_model(config, seed=seed).state_dict(),
        "ids": torch.randint(3, vocab, (rows, seq), generator=g),
        "weights": torch.randn(rows, seq, vocab, generator=g),
        "doc_lens": doc_lens,
    }


def _on_rank(case: dict, rank: int, world: int) -> dict:
    model = tiny_model(case["config"], "ring_flash", case["state_dict"])
    dtype = case.get("dtype", torch.float32)
    if dtype != torch.float32 and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # grouped_mm takes no float64
    model = model.to(dtype).train()
    if case["doc_lens"]:
        lens = case["doc_lens"]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        shard = lambda x: shard_packed(x, cu, world, rank)  # noqa: E731
        positions = torch.cat([torch.arange(n) for n in lens])[None]
        extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))
    else:
        shard = lambda x: hf_ring.shard_sequence(x, world, rank)  # noqa: E731
        positions = torch.arange(case["ids"].shape[1]).expand(BATCH, -1)
        extra = {}
    logits = model(shard(case["ids"]), position_ids=shard(positions), **extra).logits
    (logits * shard(case["weights"]).to(dtype)).sum().backward()
    return {"logits": logits.detach(), "grads": grads(model)}


def _bypass(case: dict, rank: int, world: int) -> str:
    """A gated delta net layer whose forward no longer calls the routed functions."""
    model = tiny_model(case["config"], "ring_flash", case["state_dict"])
    layer = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    layer.forward = types.MethodType(lambda self, hidden_states, **kwargs: hidden_states, layer)
    ids = hf_ring.shard_sequence(case["ids"], world, rank)
    positions = hf_ring.shard_sequence(torch.arange(case["ids"].shape[1]).expand(BATCH, -1), world, rank)
    try:
        model(ids, position_ids=positions)
    except RuntimeError as e:
        return str(e)
    return "no error"


def _rank_main(rank: int, world: int, cases: dict) -> dict:
    hf_ring.setup_context_parallel(world)
    result = {name: _on_rank(case, rank, world) for name, case in cases.items()}
    if world == 2:
        result["qwen3_next_float64"] = _on_rank({**cases["qwen3_next"], "dtype": torch.float64}, rank, world)
        result["bypass"] = _bypass(cases["qwen3_next"], rank, world)
    return result


def _reference(case: dict, dtype: torch.dtype = torch.float32) -> dict:
    model = _plain_model(case["config"], case["state_dict"])
    if dtype != torch.float32 and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # grouped_mm takes no float64
    model = model.to(dtype).train()
    module = importlib.import_module(type(model).__module__)
    swapped = {name: fn for name, fn in _FLOAT64.items() if name in vars(module)} if dtype == torch.float64 else {}
    routed = {name: getattr(module, name) for name in swapped}
    vars(module).update(swapped)
    try:
        return _reference_logits(model, case, dtype)
    finally:
        vars(module).update(routed)


# hf_ring's one-process ops in float64, in place of transformers' recurrences (float32 inside).
_FLOAT64 = {
    "torch_chunk_gated_delta_rule": lambda q, k, v, g, beta, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, **kw: context_parallel_gated_delta_rule(
        q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel),
    "chunk_kimi_delta_attention": lambda q, k, v, g, beta, chunk_size=64, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, **kw: context_parallel_kimi_delta_attention(
        q, k, v, g, beta, chunk_size=chunk_size, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel),
    "mamba2_chunk_scan": lambda x, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
    dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kw: context_parallel_ssd(
        x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)[0],
    "mamba_selective_scan": lambda u, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
    return_last_state=False, **kw: context_parallel_selective_scan(
        u, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)[0],
}


def _reference_logits(model, case: dict, dtype: torch.dtype) -> dict:
    if case["doc_lens"]:
        cu = [0] + torch.tensor(case["doc_lens"]).cumsum(0).tolist()
        logits = torch.cat([model(case["ids"][:, a:b]).logits for a, b in zip(cu[:-1], cu[1:])], dim=1)
    else:
        logits = model(case["ids"]).logits
    (logits * case["weights"].to(dtype)).sum().backward()
    return {"logits": logits.detach(), "grads": grads(model)}


_RUNS: dict[int, tuple] = {}


def _run(world: int) -> tuple:
    """One spawn per world size, shared by every test of this module."""
    if world not in _RUNS:
        cases = {family: _case(family, world, seed=i) for i, family in enumerate(FAMILIES)}
        for family in PACKED:
            cases[f"{family}_packed"] = _case(family, world, seed=9, doc_lens=[2 * world, 6 * world, 4 * world])
        _RUNS[world] = (cases, run_world(world, _rank_main, cases))
    return _RUNS[world]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world_run(request):
    return request.param, *_run(request.param)


@pytest.mark.parametrize("name", (*FAMILIES, *(f"{family}_packed" for family in PACKED)))
def test_logits_and_grads_match_full_sequence(world_run, name):
    world, cases, ranks = world_run
    case = cases[name]
    reference = _reference(case)
    mine = [r[name] for r in ranks]
    if case["doc_lens"]:
        lens = case["doc_lens"]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        pieces = [shard_packed(reference["logits"], cu, world, r) for r in range(world)]
        errors = {"logits": max(rel_err(m["logits"], p) for m, p in zip(mine, pieces))}
    else:
        errors = {"logits": rel_err(hf_ring.unshard_sequence([m["logits"] for m in mine]), reference["logits"])}
    exact = _reference(case, torch.float64)["grads"]
    for n, ref in reference["grads"].items():
        cp = sum(r["grads"][n] for r in mine)
        errors[n] = rel_err(cp, ref)
        if errors[n] > TOL:
            single = rel_err(ref.double(), exact[n])
            mine64 = rel_err(cp.double(), exact[n])
            assert mine64 <= max(TOL, 2 * single), (n, errors[n], mine64, single)
            errors[n] = 0.0
    worst = max(errors, key=errors.get)
    print(f"{name} world {world}: logits {errors['logits']:.1e}, worst {worst} {errors[worst]:.1e}")
    assert max(errors.values()) <= TOL, errors


def test_float64_decay_gradients_are_exact():
    """In float64 the decay parameters' gradients match too (within the float32 that attention
    accumulates in): their float32 misses are rounding."""
    cases, ranks = _run(2)
    exact = _reference(cases["qwen3_next"], torch.float64)
    mine = [r["qwen3_next_float64"] for r in ranks]
    errors = {n: rel_err(sum(r["grads"][n] for r in mine), ref) for n, ref in exact["grads"].items()}
    assert max(errors.values()) <= 1e-6, sorted(errors.items(), key=lambda e: -e[1])[:3]


def test_bypassed_mixer_is_refused_after_the_forward():
    _, ranks = _run(2)
    for r in ranks:
        assert "token mixer was bypassed" in r["bypass"] and "linear_attn" in r["bypass"], r["bypass"]


def _assert_packed_row_matches_its_documents(family: str, checkpointed: bool = False) -> None:
    """A packed row of 3 documents without CP: logits and every gradient as the documents
    run one by one (each mixer must run once per document)."""
    case = _case(family, 1, seed=3, doc_lens=[6, 10, 8])
    reference = _reference(case)
    model = tiny_model(case["config"], "ring_flash", case["state_dict"]).train()
    if checkpointed:
        model.gradient_checkpointing_enable()
    cu = torch.tensor([0, 6, 16, 24], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in case["doc_lens"]])[None]
    logits = model(case["ids"], position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                   max_length_q=10, max_length_k=10).logits
    (logits * case["weights"]).sum().backward()
    assert rel_err(logits.detach(), reference["logits"]) <= TOL
    errors = {n: rel_err(p.grad, reference["grads"][n]) for n, p in model.named_parameters() if p.grad is not None}
    assert max(errors.values()) <= TOL, errors


@pytest.mark.parametrize("family", ("qwen3_next", "olmo_hybrid", *PACKED[1:]))
def test_packed_rows_without_cp_run_each_document_alone(family):
    _assert_packed_row_matches_its_documents(family)


def test_gradient_checkpointing_of_pure_mamba_blocks_is_refused():
    """MambaModel calls its blocks without keyword arguments: a block recomputed in the
    backward would not know it runs on packed rows (or under CP), so checkpointing is refused
    there, naming the fix; without it (or on dense rows without CP) the model runs."""
    case = _case("mamba", 1, seed=3, doc_lens=[6, 10, 8])
    model = tiny_model(case["config"], "ring_flash", case["state_dict"]).train()
    cu = torch.tensor([0, 6, 16, 24], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in case["doc_lens"]])[None]
    packed = dict(position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=10, max_length_k=10)
    model.gradient_checkpointing_enable()
    with pytest.raises(NotImplementedError, match="gradient_checkpointing_disable"):
        model(case["ids"], **packed)
    model(case["ids"])  # dense rows without CP: nothing is routed, checkpointing works
    model.gradient_checkpointing_disable()
    model(case["ids"], **packed)


def test_gradient_checkpointing_of_jamba_runs_each_document_alone():
    """Jamba's mixers get their context from their decoder layer, which gradient checkpointing
    reruns with its keyword arguments: checkpointed, packed rows still match the documents
    run one by one, gradients included."""
    _assert_packed_row_matches_its_documents("jamba", checkpointed=True)
