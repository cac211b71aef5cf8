"""``ring_flash`` under each context-parallel pattern on the models whose attention has
windows, logit softcapping or sinks, in one spawned gloo world of 2 (cp=2, zigzag).

Models (the model sweep's tiny configs, tests/model_sweep_configs.py): Gemma 2 (softcap on
every layer, an 8-token window on its sliding layers), Gemma 3 (sliding and full layers),
Mistral (an 8-token window), GPT-OSS (sinks and a window). Each rank feeds its shard with
the global positions; its logits, put back in order, and every parameter's gradient,
summed over the ranks, must match one process running transformers' eager attention on
the full 32-token sequence within 1e-4 relative (float32; the patterns only reorder the
softmax sums; measured < 4.3e-7 logits, < 8.1e-7 gradients), or the pattern refuses on every rank with an error that
names the feature. Gemma 2's q/k projections are sharpened and its softcap set to 1 so
that the capping matters (without it the logits move by ~1e-2); GPT-OSS's sinks are drawn
large for the same reason. ``"auto"`` must log one line per kind of layer, the same on
both ranks, and compute the same.
"""

from __future__ import annotations

import logging

import pytest
import torch

import hf_ring
from distributed import run_world
from model_sweep_configs import build_config
from closeness import rel_err
from test_hf_attention import sharpen_attention, tiny_model

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

TOL = 1e-4
SEQ, BATCH = 32, 2
MODELS = ("gemma2", "gemma3_text", "mistral", "gpt_oss")
# Every pattern (hybrid with one Ulysses group of 2 here: the plumbing of ulysses_size;
# its ring across groups needs a world of 4, tests/test_cp_patterns.py runs it on the op).
PATTERNS = ("ring", "allgather", "ulysses", "hybrid", "auto")


def _config(name: str):
    config = build_config(name)
    if name == "gemma2":
        config.attn_logit_softcapping = 1.0
    return config


def _model(name: str, implementation: str, state_dict=None):
    model = tiny_model(_config(name), implementation, state_dict).train()
    if state_dict is None:
        torch.manual_seed(1)
        if name == "gemma2":
            sharpen_attention(model)
        if name == "gpt_oss":
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def _case(name: str) -> dict:
    g = torch.Generator().manual_seed(7)
    vocab = _config(name).vocab_size
    return {"state_dict": _model(name, "eager").state_dict(),
            "ids": torch.randint(3, vocab, (BATCH, SEQ), generator=g),
            "weights": torch.randn(BATCH, SEQ, vocab, generator=g)}


def _run(model, ids, positions, weights) -> dict:
    logits = model(ids, position_ids=positions).logits
    (logits * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits.detach(), "grads": grads}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _rank_main(rank: int, world: int, cases: dict) -> dict:
    lines = _Lines()
    logger = logging.getLogger("hf_ring")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    shard = lambda x: hf_ring.shard_sequence(x, world, rank)  # noqa: E731
    positions = shard(torch.arange(SEQ).expand(BATCH, -1))
    results = {}
    for pattern in PATTERNS:
        hf_ring.setup_context_parallel(world, pattern=pattern, ulysses_size=world if pattern == "hybrid" else None)
        for name, case in cases.items():
            before = len(lines.lines)
            try:
                model = _model(name, "ring_flash", case["state_dict"])
                out = _run(model, shard(case["ids"]), positions, shard(case["weights"]))
                for g in out["grads"].values():
                    torch.distributed.all_reduce(g)
            except NotImplementedError as e:
                out = {"refused": str(e)}
            out["log"] = lines.lines[before:]
            results[(pattern, name)] = out
    # Ranks that see other node sizes would let auto pick apart: refused on every rank.
    state = hf_ring.setup_context_parallel(world, pattern="auto")
    hf_ring.set_context_parallel_state(state.with_attention(local_world_size=1 + rank))
    try:
        _run(_model("mistral", "ring_flash", cases["mistral"]["state_dict"]), shard(cases["mistral"]["ids"]),
             positions, shard(cases["mistral"]["weights"]))
        results["node_sizes_differ"] = None
    except ValueError as e:
        results["node_sizes_differ"] = str(e)
    finally:
        hf_ring.set_context_parallel_state(state)
    return results


@pytest.fixture(scope="module")
def cases():
    return {name: _case(name) for name in MODELS}


@pytest.fixture(scope="module")
def results(cases):
    return run_world(2, _rank_main, cases)


@pytest.fixture(scope="module")
def references(cases):
    """One process, eager attention, the full sequence: each model once."""
    positions = torch.arange(SEQ).expand(BATCH, -1)
    return {name: _run(_model(name, "eager", c["state_dict"]), c["ids"], positions, c["weights"])
            for name, c in cases.items()}


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("name", MODELS)
def test_pattern_matches_one_process(references, results, pattern, name):
    want = references[name]
    got = [r[(pattern, name)] for r in results]
    assert all("refused" not in g for g in got), got[0].get("refused")
    logits = hf_ring.unshard_sequence([g["logits"] for g in got], dim=1)
    assert rel_err(logits, want["logits"]) <= TOL
    largest = max(g.norm() for g in want["grads"].values())
    for param, g in want["grads"].items():
        if g.norm() > 1e-3 * largest:  # a gradient ~0 has no meaningful relative error
            assert rel_err(got[0]["grads"][param], g) <= TOL, param


def test_auto_logs_its_choice_once_alike_on_every_rank(results):
    # Each kind of layer call (heads, length, features) is logged once per process, the
    # first time a model meets it; the ranks pick, and say, the same.
    for name in MODELS:
        assert results[0][("auto", name)]["log"] == results[1][("auto", name)]["log"], name
    lines = [line for name in MODELS for line in results[0][("auto", name)]["log"]]
    assert lines and all("pattern 'auto' picked" in line for line in lines), lines


def test_ranks_that_see_other_node_sizes_are_refused(results):
    for r in results:
        assert r["node_sizes_differ"] is not None and "local_world_size" in r["node_sizes_differ"]
