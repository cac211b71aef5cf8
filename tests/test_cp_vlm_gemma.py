"""Gemma 3 (``Gemma3ForConditionalGeneration``) under context parallelism: bidirectional image
spans and sliding windows computed in the ring, transformers 5.24.

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
must stay below 1e-5 there. The images (4 tokens each) straddle the shards' chunk boundaries
and one lies on rank 0 only; the sliding layer's window (3 tokens) is shorter than an image
and than the sequence. Controls: without ``token_type_ids`` the model's own logits move by
far more than 1e-4 (so the spans are exercised), and that causal-only forward is matched
under CP too. Refused on every rank: a mask the model got prepared (4-D), which is not the
one hf_ring computes.
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from distributed import run_world
from hf_ring.patches.transformers import release_line
from reference_attention import rel_err
from vlm_cases import ROWS, SEQ, VOCAB, build, gemma3, gemma3_batch

pytestmark = pytest.mark.skipif(
    release_line(__import__("transformers").__version__) != "5",
    reason="Gemma 3's mask was read and tested on transformers 5.x",
)

TOL = 1e-4
ZERO = 1e-5  # the norm below which a gradient is zero in exact arithmetic
WORLD = 2
PATTERNS = ("ring", "allgather", "ulysses")


def _batches() -> dict[str, dict]:
    batch = gemma3_batch(3)
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    mask[1, -4:] = 0  # right padding after row 1's last image
    return {"images": batch, "padded": {**batch, "attention_mask": mask},
            "causal": {k: v for k, v in batch.items() if k != "token_type_ids"}}


_SETUP: list = []


def _setup() -> tuple:
    """The config, the SDPA model, the batches and the loss weights (made once)."""
    if not _SETUP:
        config = gemma3()
        sdpa = build(config, "sdpa")
        weights = torch.randn(ROWS, SEQ, VOCAB, generator=torch.Generator().manual_seed(7))
        _SETUP.append((config, sdpa, _batches(), weights))
    return _SETUP[0]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _weights(weights: torch.Tensor, batch: dict) -> torch.Tensor:
    mask = batch.get("attention_mask")
    return weights if mask is None else weights * mask[..., None]  # no loss on padding


def _rank_main(rank: int, world: int, config, state_dict, batches: dict, weights: torch.Tensor) -> dict:
    model = build(config, "ring_flash", state_dict)
    result = {}
    for pattern in PATTERNS:
        hf_ring.setup_context_parallel(world, pattern=pattern)
        for name, batch in batches.items():
            model.zero_grad(set_to_none=True)
            logits = model(**batch).logits  # (rows, SEQ / WORLD, vocab): this rank's shard
            (logits * hf_ring.shard_sequence(_weights(weights, batch), world, rank)).sum().backward()
            result[pattern, name] = {"logits": logits.detach(), "grads": _grads(model)}
    four_d = torch.ones(ROWS, 1, SEQ, SEQ, dtype=torch.bool).tril()
    try:
        model(**{**batches["images"], "attention_mask": four_d})
        result["refused"] = "no error"
    except NotImplementedError as e:
        result["refused"] = str(e)
    return result


_RUN: list = []


def _run() -> list[dict]:
    """One spawn for every test of this module."""
    if not _RUN:
        config, sdpa, batches, weights = _setup()
        _RUN.append(run_world(WORLD, _rank_main, config, sdpa.state_dict(), batches, weights))
    return _RUN[0]


_REFERENCES: dict[str, dict] = {}


def _reference(name: str) -> dict:
    if name not in _REFERENCES:
        _, model, batches, weights = _setup()
        model.zero_grad(set_to_none=True)
        logits = model(**batches[name]).logits
        (logits * _weights(weights, batches[name])).sum().backward()
        _REFERENCES[name] = {"logits": logits.detach(), "grads": _grads(model)}
    return _REFERENCES[name]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("name", ("images", "padded", "causal"))
def test_logits_and_every_gradient_match_one_process(pattern, name):
    ranks = _run()
    reference = _reference(name)
    mask = _setup()[2][name].get("attention_mask")
    real = slice(None) if mask is None else mask.bool()
    logits = hf_ring.unshard_sequence([r[pattern, name]["logits"] for r in ranks])
    errors = {"logits": rel_err(logits[real], reference["logits"][real])}
    assert set(ranks[0][pattern, name]["grads"]) == set(reference["grads"])
    for n, ref in reference["grads"].items():
        cp = sum(r[pattern, name]["grads"][n] for r in ranks)
        if ref.norm() < ZERO:  # zero in exact arithmetic (SigLIP's key biases): rounding only on both sides
            assert cp.norm() < ZERO, (n, cp.norm().item())
            errors[n] = 0.0
        else:
            errors[n] = rel_err(cp, ref)
    tower = [n for n in reference["grads"] if ".vision_tower." in n or "multi_modal_projector" in n]
    assert len(tower) > 4, "the vision tower and projector must get gradients"
    worst = max(errors, key=errors.get)
    print(f"gemma3 {pattern} {name}: logits {errors['logits']:.1e}, worst gradient {worst} {errors[worst]:.1e}, "
          f"tower {max(errors[n] for n in tower):.1e} over {len(tower)} tensors")
    assert max(errors.values()) <= TOL, sorted(errors.items(), key=lambda e: -e[1])[:4]


def test_the_spans_are_exercised():
    """Without token_type_ids Gemma 3's own logits differ by far more than the tolerance."""
    assert rel_err(_reference("causal")["logits"], _reference("images")["logits"]) > 10 * TOL


def test_a_prepared_mask_is_refused_on_every_rank():
    for r in _run():
        assert "not the one ring_flash builds under context parallelism" in r["refused"], r["refused"]
