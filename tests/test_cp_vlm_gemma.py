"""Gemma 3 (``Gemma3ForConditionalGeneration``) and PaliGemma under context parallelism:
bidirectional image spans (PaliGemma: its prefix) and sliding windows computed in the ring,
transformers 5.24.

Every rank of a gloo world of 2 (one CP group, zigzag) gets the same full batch (token ids
with image placeholders, ``pixel_values``, ``token_type_ids``); Gemma 3 builds its mask by
layer type from the token types (full layers ``causal OR same image``, sliding layers
``window AND (causal OR same image)``), hf_ring replaces it by the spans of the full batch
(``hf_ring.hf.multimodal``), and every attention layer's plan computes them
(``hf_ring.patterns.ring.spans``). Against one process running the same weights with
``attn_implementation="sdpa"`` on the full batch, for the patterns ``ring``, ``allgather``
and ``ulysses`` (4 query / 2 K/V heads over 2 ranks), with right padding too:

- logits, put back in order: within 1e-4 relative error (float32), on the real tokens;
- every parameter's gradient, the SigLIP tower and the projector included, summed over
  the ranks (each rank's loss a fixed random weighting of its shard's logits), within 1e-4.

1e-4 as in test_cp_vlm.py: float32 on both sides, differing only in the order of sums
(measured ~1e-7 to 1e-6). A gradient that is zero in exact arithmetic (SigLIP's key
biases: a key bias shifts every score of a query alike) holds rounding only: both norms
must stay below 1e-5 there. The images (4 tokens each) straddle the shards' chunk
boundaries and one lies on rank 0 only; the sliding layer's window (3 tokens) is shorter
than an image and than the sequence.
PaliGemma's prefix (the image and the prompt, type 0) is 12 and 20 tokens, across the
boundaries. Controls: without ``token_type_ids`` each model's own logits move by far more
than 1e-4 (so the spans are exercised), and that causal-only forward is matched under CP
too (Gemma 3). Refused on every rank: a mask the model got prepared (4-D), which is not the
one hf_ring computes; a PaliGemma prefix split in two runs; PaliGemma with a sliding window
(PaliGemma 2's sliding layers OR the prefix in, which the ring does not compute); PaliGemma
without token_type_ids (its layers are flagged bidirectional: its mask decides).
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from distributed import run_world
from hf_ring.patches.transformers import release_line
from closeness import grads, rel_err
from vlm_checks import TOL, WORLD, ZERO, assert_tower_exercised
from vlm_cases import (
    ROWS, SEQ, VOCAB, assert_refused_on_every_rank, build, gemma3, gemma3_batch,
    paligemma, paligemma_batch,
)

pytestmark = pytest.mark.skipif(
    release_line(__import__("transformers").__version__) != "5",
    reason="Gemma 3's mask was read and tested on transformers 5.x",
)

PATTERNS = ("ring", "allgather", "ulysses")


MODELS = {"gemma3": (gemma3, gemma3_batch), "paligemma": (paligemma, paligemma_batch)}


def _batches(make) -> dict[str, dict]:
    batch = make(3)
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    mask[1, -4:] = 0  # right padding after row 1's last image / prefix
    return {"images": batch, "padded": {**batch, "attention_mask": mask},
            "causal": {k: v for k, v in batch.items() if k != "token_type_ids"}}


# PaliGemma without token_type_ids is refused under CP (its layers are flagged bidirectional).
CASES = [("gemma3", "images"), ("gemma3", "padded"), ("gemma3", "causal"), ("paligemma", "images"),
         ("paligemma", "padded")]
_SETUP: dict = {}


def _setup(model: str) -> tuple:
    """The config, the SDPA model, the batches and the loss weights (made once a model)."""
    if model not in _SETUP:
        config_of, batch_of = MODELS[model]
        config = config_of()
        weights = torch.randn(ROWS, SEQ, VOCAB, generator=torch.Generator().manual_seed(7))
        _SETUP[model] = (config, build(config, "sdpa"), _batches(batch_of), weights)
    return _SETUP[model]


def _weights(weights: torch.Tensor, batch: dict) -> torch.Tensor:
    mask = batch.get("attention_mask")
    return weights if mask is None else weights * mask[..., None]  # no loss on padding


def _error(call) -> str:
    try:
        call()
    except (ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _refusals(models: dict, setups: dict) -> dict[str, str]:
    gemma_batch, pali_batch = setups["gemma3"][2]["images"], setups["paligemma"][2]["images"]
    four_d = torch.ones(ROWS, 1, SEQ, SEQ, dtype=torch.bool).tril()
    split = pali_batch["token_type_ids"].clone()
    split[0, -2:] = 0  # type 0 again after the suffix: a block that is no span
    pali = models["paligemma"]
    out = {"prepared_mask": _error(lambda: models["gemma3"](**{**gemma_batch, "attention_mask": four_d})),
           "split_prefix": _error(lambda: pali(**{**pali_batch, "token_type_ids": split})),
           "paligemma_no_types": _error(lambda: pali(**{k: v for k, v in pali_batch.items() if k != "token_type_ids"}))}
    pali.config.text_config.sliding_window = 8  # PaliGemma 2's kind of language model
    out["paligemma_window"] = _error(lambda: pali(**pali_batch))
    pali.config.text_config.sliding_window = None
    return out


def _rank_main(rank: int, world: int, setups: dict) -> dict:
    models = {m: build(setups[m][0], "ring_flash", setups[m][1]) for m in MODELS}
    result = {}
    for pattern in PATTERNS:
        hf_ring.setup_context_parallel(world, pattern=pattern)
        for m, name in CASES:
            batch, weights = setups[m][2][name], setups[m][3]
            models[m].zero_grad(set_to_none=True)
            logits = models[m](**batch).logits  # (rows, SEQ / WORLD, vocab): this rank's shard
            (logits * hf_ring.shard_sequence(_weights(weights, batch), world, rank)).sum().backward()
            result[pattern, m, name] = {"logits": logits.detach(), "grads": grads(models[m])}
    result["refusals"] = _refusals(models, setups)
    return result


_RUN: list = []


def _run() -> list[dict]:
    """One spawn for every test of this module."""
    if not _RUN:
        setups = {m: _setup(m) for m in MODELS}
        sent = {m: (c, sdpa.state_dict(), batches, w) for m, (c, sdpa, batches, w) in setups.items()}
        _RUN.append(run_world(WORLD, _rank_main, sent))
    return _RUN[0]


_REFERENCES: dict = {}


def _reference(m: str, name: str) -> dict:
    if (m, name) not in _REFERENCES:
        _, model, batches, weights = _setup(m)
        model.zero_grad(set_to_none=True)
        logits = model(**batches[name]).logits
        (logits * _weights(weights, batches[name])).sum().backward()
        _REFERENCES[m, name] = {"logits": logits.detach(), "grads": grads(model)}
    return _REFERENCES[m, name]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("m, name", CASES)
def test_logits_and_every_gradient_match_one_process(pattern, m, name):
    ranks = _run()
    reference = _reference(m, name)
    mask = _setup(m)[2][name].get("attention_mask")
    real = slice(None) if mask is None else mask.bool()
    logits = hf_ring.unshard_sequence([r[pattern, m, name]["logits"] for r in ranks])
    errors = {"logits": rel_err(logits[real], reference["logits"][real])}
    assert set(ranks[0][pattern, m, name]["grads"]) == set(reference["grads"])
    for n, ref in reference["grads"].items():
        cp = sum(r[pattern, m, name]["grads"][n] for r in ranks)
        if ref.norm() < ZERO:  # zero in exact arithmetic (SigLIP's key biases): rounding only on both sides
            assert cp.norm() < ZERO, (n, cp.norm().item())
            errors[n] = 0.0
        else:
            errors[n] = rel_err(cp, ref)
    tower = [n for n in reference["grads"] if ".vision_tower." in n or "multi_modal_projector" in n]
    assert len(tower) > 4, "the vision tower and projector must get gradients"
    assert_tower_exercised(reference["grads"])
    worst = max(errors, key=errors.get)
    print(f"{m} {pattern} {name}: logits {errors['logits']:.1e}, worst gradient {worst} {errors[worst]:.1e}, "
          f"tower {max(errors[n] for n in tower):.1e} over {len(tower)} tensors")
    assert max(errors.values()) <= TOL, sorted(errors.items(), key=lambda e: -e[1])[:4]


@pytest.mark.parametrize("m", MODELS)
def test_the_spans_are_exercised(m):
    """Without token_type_ids the model's own logits differ by far more than the tolerance."""
    assert rel_err(_reference(m, "causal")["logits"], _reference(m, "images")["logits"]) > 10 * TOL


_EXPECTED = {
    "prepared_mask": "NotImplementedError: Gemma3TextModel under context parallelism (cp_size=2): Gemma 3's language "
                     "model got a mask that is not the one ring_flash builds",
    "split_prefix": "row 0's bidirectional block is 2 separate runs",
    "paligemma_window": "PaliGemma's sliding layers let a block's tokens see each other beyond the window",
    "paligemma_no_types": "PaliGemma needs token_type_ids under context parallelism",
}


@pytest.mark.parametrize("what", _EXPECTED)
def test_refused_on_every_rank(what):
    assert_refused_on_every_rank(_run(), what, _EXPECTED[what])

