"""``pattern="auto"``'s rule (hf_ring/patterns/auto.py) and the pattern settings of the state
and the plugin, in one process (no world needed: the rule is a pure function of what every
rank knows alike, which is its point)."""

from __future__ import annotations

import json
import os
import sys

import pytest

import hf_ring
from hf_ring.patterns.auto import ALLGATHER_BELOW, PatternChoice, first_that_runs, pattern_candidates
from closeness import fake_cp_state

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)


def _order(*args, **kwargs) -> list[str]:
    return [c.pattern + (f"/{c.ulysses_size}" if c.ulysses_size else "") for c in pattern_candidates(*args, **kwargs)]


def test_inside_a_node_ulysses_when_the_heads_divide():
    # 32/8 heads, 8 ranks of an 8-process node.
    assert _order(32, 8, 65536, 8, 8) == ["ulysses", "ring", "allgather"]
    # 6 heads do not divide over 4 ranks: the ring for long shards, all-gather for short ones.
    assert _order(6, 2, 4 * ALLGATHER_BELOW, 4, 8) == ["ring", "allgather"]
    assert _order(6, 2, 4 * ALLGATHER_BELOW - 4, 4, 8) == ["allgather", "ring"]


def test_across_nodes_hybrid_with_the_largest_node_local_ulysses_group():
    assert _order(32, 8, 65536, 16, 8) == ["hybrid/8", "ring", "allgather"]
    assert _order(12, 4, 65536, 16, 8) == ["hybrid/4", "ring", "allgather"]  # 8 does not divide 12 heads
    # A group of 4 starting at global rank 6 of 8-process nodes straddles two nodes, and
    # no Ulysses group of 2 consecutive ranks from rank 6 crosses the node boundary (6-7, 8-9).
    assert _order(32, 8, 65536, 4, 8, first_rank=6) == ["hybrid/2", "ring", "allgather"]
    # 3 ranks from rank 3 on 4-process nodes: no group size divides both 3 and the node.
    assert _order(32, 8, 65536, 3, 4, first_rank=3) == ["ring", "allgather"]


def test_one_rank_is_the_ring():
    assert _order(32, 8, 4096, 1, 8) == ["ring"]


def test_refusing_patterns_are_skipped_and_said():
    def attempt(choice: PatternChoice) -> str:
        if choice.pattern == "ulysses":
            raise NotImplementedError("no softcap here")
        return choice.pattern

    result, choice = first_that_runs(pattern_candidates(32, 8, 8192, 4, 4), attempt)
    assert result == choice.pattern == "ring"
    assert "ulysses refused: no softcap here" in choice.describe()
    with pytest.raises(NotImplementedError, match="no context-parallel pattern computes this call"):
        first_that_runs(pattern_candidates(32, 8, 8192, 4, 4), lambda c: (_ for _ in ()).throw(NotImplementedError("x")))


@pytest.mark.parametrize(
    "kwargs,words",
    [({"pattern": "rings"}, "unknown context-parallel pattern"),
     ({"pattern": "hybrid"}, "needs ulysses_size"),
     ({"pattern": "hybrid", "ulysses_size": 3}, "dividing cp_size=2"),
     ({"pattern": "ring", "ulysses_size": 2}, "for pattern='hybrid' only")],
)
def test_bad_pattern_settings_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        hf_ring.RingAttentionPlugin(cp_size=2, **kwargs)
    with pytest.raises(ValueError, match=words):
        fake_cp_state(0, 2, **kwargs)


def test_one_process_state_keeps_the_pattern():
    try:
        state = hf_ring.setup_context_parallel(1, pattern="auto")
        assert (state.pattern, state.ulysses_size) == ("auto", None)
    finally:
        hf_ring.set_context_parallel_state(None)


def _logged_choices(rank: int, world: int) -> list[str]:
    import logging

    import torch

    from hf_ring.patterns import auto
    from hf_ring.patterns.build import build_plan

    auto._LOGGED.clear()  # once per process: an earlier case on this live rank may have logged these kinds
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("hf_ring")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        common = dict(pattern="auto", group=None, rank=rank, world=world, layout="zigzag", causal=True, scale=0.25,
                      backend="reference", device=torch.device("cpu"), dtype=torch.float32, n_heads=4, n_kv_heads=2,
                      head_dim=16, seq=64)
        for local_doc_lens in (None, (8, 24), (16, 16)):  # dense rows, then two packed batches
            build_plan(**common, local_doc_lens=local_doc_lens)
    finally:
        logger.removeHandler(handler)
    return lines


def test_auto_logs_its_choice_for_dense_and_packed_rows():
    """One line per kind of call: the dense rows' choice, and the packed rows' (here the ring
    for both batches: 2 documents each, tiny heads), said once although the documents differ
    by batch, with the cost model's prediction."""
    from distributed import run_world

    for lines in run_world(2, _logged_choices):
        assert len(lines) == 2, lines
        assert "64 tokens over cp=2, 4/2 heads: pattern 'auto' picked" in lines[0], lines
        assert "64 tokens over cp=2, 4/2 heads, packed: pattern 'auto' picked 'ring'" in lines[1], lines
        assert "packed rows (2 documents, 2 runs of one length): predicted per layer" in lines[1], lines


# ---- packed rows: the ring or the all-gather, by a cost model fitted to measured figures ----

COST_RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results",
                            "packed_pattern_cost.jsonl")


def _cost_benchmark():
    sys.path.insert(0, os.path.join(os.path.dirname(COST_RESULTS), ".."))
    try:
        import packed_pattern_cost
    finally:
        sys.path.pop(0)
    with open(COST_RESULTS) as f:
        return packed_pattern_cost, [json.loads(line) for line in f if line.strip()]


def test_the_cpu_cost_model_is_the_fit_of_the_committed_figures():
    """PACKED_COSTS['cpu'] is what benchmarks/packed_pattern_cost.py fits to its committed
    rows (the coefficients are kept to 4 significant digits: 1e-3 relative)."""
    from hf_ring.patterns.auto import PACKED_COSTS

    bench, rows = _cost_benchmark()
    fitted = bench.fit(rows, "test").per_pattern
    for pattern, terms in PACKED_COSTS["cpu"].per_pattern.items():
        assert set(terms) == set(fitted[pattern]), (pattern, terms, fitted[pattern])
        for term, value in terms.items():
            assert abs(value - fitted[pattern][term]) <= 1e-3 * abs(fitted[pattern][term]), (pattern, term)


def test_auto_picks_the_faster_pattern_on_the_measured_mixes():
    """On the issue's two rows at cp 4 (the mixed documents, 64 documents of 128 tokens) the
    model picks the pattern measured faster; on every measured row, a pick that is not the
    faster one costs at most 10 % (the two are then within the measurement's noise)."""
    from hf_ring.patterns.auto import PACKED_COSTS

    bench, rows = _cost_benchmark()
    report = bench.report(rows, PACKED_COSTS["cpu"])
    assert len(report) == len(rows) // 2 >= 12
    for r in report:
        if r["cp"] == 4 and r["mix"] in ("default", "equal:64"):
            assert r["picked"] == r["faster"], r
        slower = r["measured_s"][r["picked"]] / r["measured_s"][r["faster"]] - 1
        assert slower <= 0.10, r


def test_packed_rows_without_figures_for_the_device_take_the_ring_and_say_so():
    from hf_ring.patterns.auto import packed_candidates

    choices = packed_candidates((64, 64, 32), 4, 32, 8, 128, "cuda")
    assert [c.pattern for c in choices] == ["ring", "allgather"]
    assert "no figures measured on cuda" in choices[0].reason
    many = packed_candidates(tuple(range(8, 72)), 4, 8, 2, 128, "cpu")  # 64 uneven documents: calls dominate
    assert [c.pattern for c in many] == ["allgather", "ring"], many[0].reason
