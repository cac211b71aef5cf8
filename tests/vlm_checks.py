"""The image-text check, shared by tests/test_cp_vlm.py and the multimodal sweep (tests/vlm_sweep.py).

One rank of a CP group runs the model on the full batch and gets its shard of the logits;
its loss is its share of a fixed random weighting of the logits (the sum over ranks is the
full batch's loss). Against one process on the full batch: the logits put back in order,
and every parameter's gradient summed over the ranks, each as a relative error. A gradient
that is zero in exact arithmetic (a key bias without rotary positions: softmax ignores it)
holds rounding only on both sides: there both norms must stay below ``ZERO`` instead.

Must not import hf_ring's internals (only its public functions).
"""

from __future__ import annotations

from typing import Optional

import torch

import hf_ring
from closeness import grads, rel_err

ZERO = 1e-5  # the norm below which a gradient is zero in exact arithmetic (others are >= 1e-1 here)
# The relative error every float32 image-text check allows: both sides differ only in the
# order of their sums (measured errors are <= 1e-6, each file's docstring gives its own).
TOL = 1e-4
WORLD = 2  # the gloo world of the image-text CP tests: one CP group of 2
# Every forward (each rank's, the reference's) starts from this generator state, as
# transformers.set_seed leaves a process: a family's dropout then draws what one process draws.
FORWARD_SEED = 20261205


def run_shard(model: torch.nn.Module, batch: dict, weights: torch.Tensor, world: int, rank: int) -> dict:
    """This rank's logits ``(rows, seq / world, vocab)`` and gradients for the full ``batch``;
    ``weights`` ``(rows, seq, vocab)`` float32 weight the full batch's logits into its loss."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(FORWARD_SEED)
    logits = model(**batch).logits
    (logits * hf_ring.shard_sequence(weights, world, rank)).sum().backward()
    return {"logits": logits.detach(), "grads": grads(model)}


def run_full(model: torch.nn.Module, batch: dict, weights: torch.Tensor) -> dict:
    """One process on the full batch: logits ``(rows, seq, vocab)`` and gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(FORWARD_SEED)
    logits = model(**batch).logits
    (logits * weights).sum().backward()
    return {"logits": logits.detach(), "grads": grads(model)}


def errors(ranks: list[dict], reference: dict, mask: Optional[torch.Tensor] = None) -> dict[str, float]:
    """Relative error of the unsharded logits (on the real tokens of the 2-D ``mask``: the
    padding's logits are nobody's) and of each gradient summed over the ranks, by name.
    Raises AssertionError when the ranks and the reference disagree on which parameters
    got a gradient, or a zero gradient is not zero."""
    logits = hf_ring.unshard_sequence([r["logits"] for r in ranks])
    real = slice(None) if mask is None else mask.bool()
    out = {"logits": rel_err(logits[real], reference["logits"][real])}
    assert set(ranks[0]["grads"]) == set(reference["grads"]), set(ranks[0]["grads"]) ^ set(reference["grads"])
    for name, ref in reference["grads"].items():
        cp = sum(r["grads"][name] for r in ranks)
        if ref.norm() < ZERO:  # zero in exact arithmetic: both sides hold rounding only
            assert cp.norm() < ZERO, (name, cp.norm().item())
            out[name] = 0.0
        else:
            out[name] = rel_err(cp, ref)
    return out


def tower_names(names) -> tuple[list[str], list[str]]:
    """The vision tower's and the projector's parameters among ``names``."""
    names = list(names)
    tower = [n for n in names if ".visual." in n or ".vision_tower." in n or ".vision_model." in n]
    projector = [n for n in names if "merger" in n or "multi_modal_projector" in n or "connector" in n]
    return tower, projector


def assert_tower_exercised(reference_grads: dict[str, torch.Tensor]) -> None:
    """Some vision tower parameter gets a gradient (norm >= ZERO) in the reference: a tower
    whose features never reach the loss (Gemma 3's projection left at its zero init) would
    make every tower check hold trivially."""
    tower, _ = tower_names(reference_grads)
    assert tower and any(reference_grads[n].norm() >= ZERO for n in tower), "the vision tower gets no gradient"

