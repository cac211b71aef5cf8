"""Image-text models under context parallelism, at the model level (issue 21), transformers 5.24.

Every rank of a gloo world of 2 (one CP group, zigzag) gets the same full batch (token ids
with image / video placeholders, ``pixel_values``, grids); the model runs its own code on
it up to its language model (embeddings, vision tower, feature merge, Qwen's 3-D M-RoPE
positions), hf_ring shards the language model's inputs at its entry
(``hf_ring.hf.multimodal``), and the logits come out sharded like the tokens. Against one
process running the same weights with ``attn_implementation="sdpa"`` on the full batch:

- logits, put back in order: within 1e-4 relative error (float32);
- every parameter's gradient, vision tower and projector included, summed over the ranks
  (each rank's loss is its share: a fixed random weighting of its shard's logits, whose
  sum over ranks is the full batch's loss), within 1e-4 relative error.

1e-4 because both sides run float32 and differ only in the order of the sums (the ring's
online softmax against SDPA's one pass, a tower gradient summed from two shards); measured
errors are ~1e-7 to ~1e-6. A gradient that is zero in exact arithmetic (CLIP's key biases:
without rotary positions a key bias shifts every score of a query alike, and softmax
ignores it) holds rounding only on both sides (~1e-7): there both norms must stay below
1e-5 instead. Families (every one ``hf_ring.hf.multimodal.families`` lists): Qwen2.5-VL
(two images in one row, a video in the other; and with right padding, compared on the real
tokens), Qwen2-VL, Qwen3-VL and Qwen3-VL-MoE (deepstack features, a video of two frames),
LLaVA, LLaVA-OneVision (anyres views with newlines), Mistral 3 (Pixtral), InternVL (pixel
shuffle). Without context parallelism the same ``ring_flash`` models give SDPA's logits
bit for bit. Controls: each rank's vision-tower gradient alone
is far from the full one (the images straddle the shards, so the sum is what matches), and
the test's positions matter (dropping M-RoPE moves the logits by 4e-3, over 10 x 1e-4).
Refusals, each raised on every rank: labels, a cache, ``logits_to_keep``, a length the
layout cannot split, ranks holding different batches, left padding and a family hf_ring has
not checked (LFM2-VL). Gemma 3 and PaliGemma (bidirectional spans): tests/test_cp_vlm_gemma.py.
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from distributed import run_world
from hf_ring.patches.transformers import release_line
from closeness import rel_err
from vlm_cases import (
    FAMILIES, ROWS, SEQ, VOCAB, assert_refused_on_every_rank, assert_tower_gradient_split, build,
)
from vlm_checks import TOL, WORLD, errors, run_full, run_shard, tower_names

pytestmark = pytest.mark.skipif(
    release_line(__import__("transformers").__version__) != "5",
    reason="the multimodal families were read and tested on transformers 5.x",
)

PADDED = "qwen2_5_vl_padded"
REFUSALS = ("labels", "cache", "logits_to_keep", "length", "ranks_differ", "left_padding", "unchecked")


# The single-process SDPA models, by case (the ranks get their weights).
_SDPA: dict[str, torch.nn.Module] = {}


def _cases() -> dict[str, dict]:
    cases = {}
    for i, (name, (config, batch)) in enumerate(FAMILIES.items()):
        c = config()
        _SDPA[name] = build(c, "sdpa")
        cases[name] = {"config": c, "state_dict": _SDPA[name].state_dict(), "batch": batch(i)}
    padded = dict(cases["qwen2_5_vl"])
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    mask[1, -6:] = 0  # right padding after row 1's video
    padded["batch"] = {**padded["batch"], "attention_mask": mask}
    cases[PADDED] = padded
    _SDPA[PADDED] = build(padded["config"], "sdpa", padded["state_dict"])
    g = torch.Generator().manual_seed(7)
    for case in cases.values():
        weights = torch.randn(ROWS, SEQ, VOCAB, generator=g)
        mask = case["batch"].get("attention_mask")
        case["weights"] = weights if mask is None else weights * mask[..., None]  # no loss on padding
    return cases


def _error(call) -> str:
    try:
        call()
    except (ValueError, NotImplementedError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _tiny_unchecked():
    """LFM2-VL, a family hf_ring has not read (the multimodal sweep's tiny config)."""
    from vlm_sweep_configs import build_config

    return build(build_config("lfm2_vl"), "ring_flash")


def _refusals(model, batch: dict, rank: int) -> dict[str, str]:
    ids = batch["input_ids"]
    left = torch.ones_like(ids)
    left[1, :3] = 0  # before row 1's video
    other = FAMILIES["qwen2_5_vl"][1](11)  # another full batch, given to rank 1 only
    short = {**batch, "input_ids": ids[:, :30], "mm_token_type_ids": batch["mm_token_type_ids"][:, :30]}
    text_only = {"input_ids": ids}
    return {
        "labels": _error(lambda: model(**batch, labels=ids)),
        "cache": _error(lambda: model(**batch, use_cache=True)),
        "logits_to_keep": _error(lambda: model(**batch, logits_to_keep=1)),
        "length": _error(lambda: model(**short)),
        "ranks_differ": _error(lambda: model(**(other if rank == 1 else batch))),
        "left_padding": _error(lambda: model(**batch, attention_mask=left)),
        "unchecked": _error(lambda: _tiny_unchecked()(**text_only)),
    }


def _rank_main(rank: int, world: int, cases: dict) -> dict:
    state = hf_ring.setup_context_parallel(world)
    models = {name: build(cases[name]["config"], "ring_flash", cases[name]["state_dict"]) for name in FAMILIES}
    models[PADDED] = models["qwen2_5_vl"]
    result = {name: run_shard(models[name], case["batch"], case["weights"], WORLD, rank) for name, case in cases.items()}
    result["refusals"] = _refusals(models["qwen2_5_vl"], cases["qwen2_5_vl"]["batch"], rank)
    if rank == 0:  # the same models without context parallelism: transformers' SDPA through ring_flash
        hf_ring.set_context_parallel_state(None)
        with torch.no_grad():
            result["without_cp"] = {name: models[name](**cases[name]["batch"]).logits for name in FAMILIES}
        hf_ring.set_context_parallel_state(state)
    return result


_REFERENCES: dict[str, dict] = {}


def _reference(name: str) -> dict:
    """One process, SDPA, the full batch (computed once per case)."""
    if name not in _REFERENCES:
        case, model = _run()[0][name], _SDPA[name]
        _REFERENCES[name] = {**run_full(model, case["batch"], case["weights"]), "model": model}
    return _REFERENCES[name]


_RUN: list = []


def _run() -> tuple[dict, list[dict]]:
    """One spawn for every test of this module."""
    if not _RUN:
        cases = _cases()
        _RUN.append((cases, run_world(WORLD, _rank_main, cases)))
    return _RUN[0]


@pytest.mark.parametrize("name", (*FAMILIES, PADDED))
def test_logits_and_every_gradient_match_one_process(name):
    cases, ranks = _run()
    case, reference = cases[name], _reference(name)
    errs = errors([r[name] for r in ranks], reference, case["batch"].get("attention_mask"))
    tower, projector = tower_names(reference["grads"])
    assert tower and projector, "the vision tower and projector must get gradients"
    worst = max(errs, key=errs.get)
    print(f"{name}: logits {errs['logits']:.1e}, worst gradient {worst} {errs[worst]:.1e}, "
          f"tower {max(errs[n] for n in tower):.1e} over {len(tower)} tensors")
    assert max(errs.values()) <= TOL, sorted(errs.items(), key=lambda e: -e[1])[:4]


def test_each_rank_holds_part_of_the_tower_gradient():
    """The images straddle the shards: neither rank's tower gradient alone is the full one."""
    assert_tower_gradient_split([r["qwen2_5_vl"]["grads"] for r in _run()[1]], _reference("qwen2_5_vl")["grads"])


def test_the_positions_are_exercised():
    """Qwen2.5-VL without its 3-D positions (no mm_token_type_ids: 1-D ones) computes other logits."""
    cases, _ = _run()
    batch = cases["qwen2_5_vl"]["batch"]
    reference = _reference("qwen2_5_vl")
    with torch.no_grad():
        flat = reference["model"](**{k: v for k, v in batch.items() if k != "mm_token_type_ids"}).logits
    assert rel_err(flat, reference["logits"]) > 10 * TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_without_cp_ring_flash_is_sdpa(name):
    ranks = _run()[1]
    assert torch.equal(ranks[0]["without_cp"][name], _reference(name)["logits"])


_EXPECTED = {
    "labels": "labels under context parallelism",
    "cache": "KV cache / generate() is not supported",
    "logits_to_keep": "logits_to_keep=1",
    "length": "pad every row to a multiple of 4",
    "ranks_differ": "full_batch_digest",
    "left_padding": "accepts only right padding",
    "unchecked": "Lfm2VlModel is an image-text model hf_ring has not checked",
}


@pytest.mark.parametrize("what", REFUSALS)
def test_refused_on_every_rank(what):
    assert_refused_on_every_rank(_run()[1], what, _EXPECTED[what])
