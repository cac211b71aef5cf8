"""attn_implementation="ring_flash" under context parallelism, on gloo worlds of 2 and 4.

Each rank of one CP group (``hf_ring.setup_context_parallel(world)``) feeds its zigzag
shard of the batch with the global ``position_ids``; the ranks' logits, put back in order,
must match one process running "sdpa" on the full sequence within 1e-4 relative error
(norm of the difference over norm of the reference; float32, the ring only reorders the
softmax sums), and every parameter's gradient, summed over the ranks, must match the
full-sequence gradient within 1e-4. The loss is a fixed random weighting of the logits,
so that its sum over ranks is the full-sequence loss. Covered: tiny Llama, Qwen2 and
Mistral (GQA), Mistral with a 4-token sliding window (computed inside the ring: 16 tokens
at cp=2, 32 at cp=4), with and without a right-padding mask, packed rows (the varlen ring and
the all-gather pattern; Llama, and Mistral's window inside documents of 4 to 16 tokens),
and gradient checkpointing (the ring recomputed in the backward). The world of 2 also
checks that what the ring cannot serve is refused on every rank.
One spawn per world size.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

import hf_ring
from distributed import run_world
from hf_ring.sharding import shard_packed
from closeness import grads, rel_err
from test_hf_attention import FAMILIES, VOCAB, tiny_config, tiny_model

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

TOL = 1e-4
BATCH = 2
PAD = 5  # right padding of row 0 in the padded run


def _seq(world: int) -> int:
    return 8 * world  # zigzag needs a multiple of 2 * world; 4 or 8 tokens per rank


def _doc_lens(world: int) -> list[int]:
    return [2 * world, 4 * world, 2 * world]  # each a multiple of 2 * cp_size


# The dense cases: the families, and Mistral with a window far shorter than the sequence.
CASES = (*FAMILIES, "mistral_window4")
WINDOW = 4
# Packed rows: documents of 2, 4 and 2 chunks, so the window cuts the longer ones.
PACKED_CASES = ("llama", "mistral_window4")


def _case(family: str, world: int, seed: int) -> dict:
    """Config, weights, inputs and loss weights of one family, shared by ranks and parent."""
    config = tiny_config("mistral", sliding_window=WINDOW) if family == "mistral_window4" else tiny_config(family)
    state_dict = tiny_model(config, "sdpa", seed=seed).state_dict()
    g = torch.Generator().manual_seed(seed + 100)
    seq = _seq(world)
    return {
        "config": config,
        "state_dict": state_dict,
        "ids": torch.randint(3, VOCAB, (BATCH, seq), generator=g),
        "weights": torch.randn(BATCH, seq, VOCAB, generator=g),
    }


def _packed_case(world: int, family: str) -> dict:
    lens = _doc_lens(world)
    case = _case(family, world, seed=7)
    g = torch.Generator().manual_seed(8)
    total = sum(lens)
    case["ids"] = torch.randint(3, VOCAB, (1, total), generator=g)
    case["weights"] = torch.randn(1, total, VOCAB, generator=g)
    case["cu"] = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    case["positions"] = torch.cat([torch.arange(n) for n in lens])[None]
    return case


def _dense_on_rank(case: dict, rank: int, world: int, checkpointing: bool = False) -> dict:
    model = tiny_model(case["config"], "ring_flash", case["state_dict"]).train()
    if checkpointing:
        # The backward recomputes each layer, ring included, outside the guarded forward.
        # (transformers 5 renamed gradient_checkpointing_enable.)
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    shard = lambda x: hf_ring.shard_sequence(x, world, rank)  # noqa: E731
    ids = shard(case["ids"])
    positions = shard(torch.arange(case["ids"].shape[1]).expand(BATCH, -1))
    logits = model(ids, position_ids=positions).logits
    (logits * shard(case["weights"])).sum().backward()
    result = {"logits": logits.detach(), "grads": grads(model)}
    if not checkpointing:
        mask = torch.ones_like(case["ids"])
        mask[0, -PAD:] = 0
        with torch.no_grad():
            result["padded"] = model(ids, attention_mask=shard(mask), position_ids=positions).logits
    return result


def _packed_on_rank(case: dict, rank: int, world: int) -> dict:
    model = tiny_model(case["config"], "ring_flash", case["state_dict"]).train()
    cu = case["cu"]
    shard = lambda x: shard_packed(x, cu, world, rank)  # noqa: E731
    longest = int((cu[1:] - cu[:-1]).max())
    packed = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    logits = model(shard(case["ids"]), position_ids=shard(case["positions"]), **packed).logits
    (logits * shard(case["weights"])).sum().backward()
    return {"logits": logits.detach(), "grads": grads(model)}


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts on the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _refusals(rank: int, world: int) -> dict[str, str]:
    """Everything ring_flash must refuse under CP, each raised on every rank."""
    seq = _seq(world)
    case = _case("llama", world, seed=11)
    model = tiny_model(case["config"], "ring_flash", case["state_dict"])
    ids = hf_ring.shard_sequence(case["ids"], world, rank)
    positions = hf_ring.shard_sequence(torch.arange(seq).expand(BATCH, -1), world, rank)
    left = torch.ones(BATCH, seq, dtype=torch.long)
    left[1, :3] = 0
    local = ids.shape[1]
    out = {
        "left_padding": _error_of(
            lambda: model(ids, attention_mask=hf_ring.shard_sequence(left, world, rank), position_ids=positions)
        ),
        "mask_4d": _error_of(
            lambda: model(ids, attention_mask=torch.ones(BATCH, 1, local, local), position_ids=positions)
        ),
        "no_position_ids": _error_of(lambda: model(ids)),
        "local_position_ids": _error_of(lambda: model(ids, position_ids=torch.arange(local).expand(BATCH, -1))),
        "use_cache": _error_of(lambda: model(ids, position_ids=positions, use_cache=True)),
        "generate": _error_of(lambda: model.generate(ids, max_new_tokens=2, do_sample=False)),
    }
    sliding = tiny_model(tiny_config("mistral", sliding_window=4), "ring_flash", case["state_dict"])
    out["sliding_window"] = _error_of(lambda: sliding(ids, position_ids=positions))

    # A layer whose attention no longer goes through ring_flash (as if an upgrade routed it
    # to SDPA) must make the forward fail, and the next, intact forward must pass again.
    attn = model.model.layers[1].self_attn
    routed = copy.deepcopy(attn.config)
    routed._attn_implementation = "sdpa"
    original, attn.config = attn.config, routed
    out["bypass"] = _error_of(lambda: model(ids, position_ids=positions))
    attn.config = original
    out["after_bypass"] = _error_of(lambda: model(ids, position_ids=positions))
    # A copy (a reference model, say) stays guarded and runs the ring.
    out["deep_copy"] = _error_of(lambda: copy.deepcopy(model)(ids, position_ids=positions))
    model.set_attn_implementation("sdpa")
    out["switched_to_sdpa"] = _error_of(lambda: model(ids, position_ids=positions))
    return out


def _rank_main(rank: int, world: int, cases: dict, packed: dict) -> dict:
    hf_ring.setup_context_parallel(world)
    result = {family: _dense_on_rank(case, rank, world) for family, case in cases.items()}
    result["packed"] = {family: _packed_on_rank(case, rank, world) for family, case in packed.items()}
    for pattern in ("allgather", "ulysses"):
        hf_ring.setup_context_parallel(world, pattern=pattern)
        result[f"packed_{pattern}"] = {family: _packed_on_rank(case, rank, world) for family, case in packed.items()}
    if world == 4:  # the hybrid proper: Ulysses inside 2 groups of 2, the ring across them
        hf_ring.setup_context_parallel(world, pattern="hybrid", ulysses_size=2)
        result["packed_hybrid"] = {family: _packed_on_rank(case, rank, world) for family, case in packed.items()}
    hf_ring.setup_context_parallel(world)
    if world == 2:
        result["checkpointed"] = _dense_on_rank(cases["llama"], rank, world, checkpointing=True)
        result["refusals"] = _refusals(rank, world)
    return result


def _reference(case: dict) -> dict:
    model = tiny_model(case["config"], "sdpa", case["state_dict"]).train()
    logits = model(case["ids"]).logits
    (logits * case["weights"]).sum().backward()
    mask = torch.ones_like(case["ids"])
    mask[0, -PAD:] = 0
    with torch.no_grad():
        padded = model(case["ids"], attention_mask=mask).logits
    return {"logits": logits.detach(), "grads": grads(model), "padded": padded}


def _packed_reference(case: dict) -> dict:
    model = tiny_model(case["config"], "sdpa", case["state_dict"]).train()
    cu = case["cu"].tolist()
    logits = torch.cat([model(case["ids"][:, a:b]).logits for a, b in zip(cu[:-1], cu[1:])], dim=1)
    (logits * case["weights"]).sum().backward()
    return {"logits": logits.detach(), "grads": grads(model)}


_RUNS: dict[int, tuple] = {}


def _run(world: int) -> tuple:
    """One spawn per world size, shared by every test of this module."""
    if world not in _RUNS:
        cases = {family: _case(family, world, seed=i) for i, family in enumerate(CASES)}
        packed = {family: _packed_case(world, family) for family in PACKED_CASES}
        _RUNS[world] = (world, cases, packed, run_world(world, _rank_main, cases, packed))
    return _RUNS[world]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world_run(request):
    return _run(request.param)


def _summed_grad_errors(ranks: list[dict], reference: dict) -> dict[str, float]:
    return {
        name: rel_err(sum(r["grads"][name] for r in ranks), ref)
        for name, ref in reference["grads"].items()
    }


@pytest.mark.parametrize("family", CASES)
def test_logits_and_grads_match_full_sequence_sdpa(world_run, family):
    world, cases, _, ranks = world_run
    reference = _reference(cases[family])
    mine = [r[family] for r in ranks]
    logits = hf_ring.unshard_sequence([m["logits"] for m in mine])
    assert rel_err(logits, reference["logits"]) <= TOL
    errors = _summed_grad_errors(mine, reference)
    assert max(errors.values()) <= TOL, errors
    # Right padding: the real tokens' logits are those of SDPA with the same mask.
    padded = hf_ring.unshard_sequence([m["padded"] for m in mine])
    real = torch.ones(BATCH, _seq(world), dtype=torch.bool)
    real[0, -PAD:] = False
    assert rel_err(padded[real], reference["padded"][real]) <= TOL


def test_gradient_checkpointing_recomputes_the_ring():
    _, cases, _, ranks = _run(2)
    reference = _reference(cases["llama"])
    errors = _summed_grad_errors([r["checkpointed"] for r in ranks], reference)
    assert max(errors.values()) <= TOL, errors


def _assert_packed_matches(ranks: list[dict], packed: dict, family: str, key: str) -> None:
    reference = _packed_reference(packed[family])
    logits = hf_ring.sharding.unshard_packed([r[key][family]["logits"] for r in ranks], packed[family]["cu"])
    assert rel_err(logits, reference["logits"]) <= TOL
    errors = _summed_grad_errors([r[key][family] for r in ranks], reference)
    assert max(errors.values()) <= TOL, errors


@pytest.mark.parametrize("pattern", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize("family", PACKED_CASES)
def test_packed_rows_match_each_document_alone(world_run, family, pattern):
    _, _, packed, ranks = world_run
    _assert_packed_matches(ranks, packed, family, "packed" if pattern == "ring" else f"packed_{pattern}")


@pytest.mark.parametrize("family", PACKED_CASES)
def test_packed_rows_under_the_hybrid_match_each_document_alone(family):
    _, _, packed, ranks = _run(4)
    _assert_packed_matches(ranks, packed, family, "packed_hybrid")


EXPECTED_REFUSALS = {
    "left_padding": "ValueError: .*accepts only right padding",
    "mask_4d": "ValueError: .*takes no 4-D attention_mask",
    "no_position_ids": "ValueError: .*needs the global position_ids",
    "local_position_ids": "ValueError: position_ids on CP rank\\(s\\) \\[0, 1\\] are not the global positions",
    # A forward with a cache holds the full sequence on every rank (generation, test_generate.py):
    # with gradients it is refused, and ranks that hold other prompts (here shards) disagree.
    "use_cache": "NotImplementedError: generation under context parallelism .*runs without gradients",
    "generate": "ValueError: .*full_batch_digest",
    # Mistral passes its window to the attention function: computed inside the ring.
    "sliding_window": "no error",
    "bypass": "RuntimeError: ring attention was bypassed: .* layers.1.self_attn\\. ",
    "after_bypass": "no error",
    "deep_copy": "no error",
    "switched_to_sdpa": "RuntimeError: .*config now says 'sdpa'",
}


@pytest.mark.parametrize("what", sorted(EXPECTED_REFUSALS))
def test_unsupported_inputs_are_refused_on_every_rank(what):
    _, _, _, ranks = _run(2)
    for rank, result in enumerate(ranks):
        message = result["refusals"][what]
        assert re.match(EXPECTED_REFUSALS[what], message, flags=re.S), (rank, message)
