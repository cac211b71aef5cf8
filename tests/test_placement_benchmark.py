"""benchmarks/placement.py runs end to end in its tiny mode (a 256-token row, cp 2, small
heads, one repeat) and writes well-formed results: the cost model's fit, and per mix and
placement an attention row (virtual and over gloo) and a training-step row, whose figures
agree with each other. Both placements compute the same attention (checked against one
process inside the benchmark, reported here) and the same loss. Times are not asserted:
tiny rows are dominated by per-call overhead, and the machine is shared.
"""

from __future__ import annotations

import json
import math
import os
import sys

from subprocess_limits import HANG_GUARD_S
import warm_launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIXES = {"short", "five", "long_tail", "one_long"}
PLACEMENTS = {"sharded", "by_length", "auto"}


def test_placement_benchmark_tiny(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "placement.py"), "--tiny", "--json", "--out", str(tmp_path)]
    proc = warm_launch.run(cmd, dict(os.environ), ROOT, HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    written = [json.loads(line) for line in (tmp_path / "placement.jsonl").read_text().splitlines()]
    assert rows == written
    costs = json.loads((tmp_path / "placement_costs.json").read_text())
    fit = costs["fit_model"]
    assert len(costs["model_s"]) == len(costs["lengths"]) == 3 and all(t > 0 for t in costs["model_s"])
    # Tiny lengths on a loaded machine may fit no quadratic term (b <= 0): then no crossover.
    if fit["b_s_per_token2"] > 0:
        assert math.isclose(costs["crossover"], fit["a_s_per_token"] / (2 * fit["b_s_per_token2"]), rel_tol=1e-12)
    else:
        assert costs["crossover"] == math.inf

    keys = {(r["part"], r["mode"], r["mix"], r["placement"]) for r in rows}
    assert keys == {(part, mode, mix, pl) for part, mode in (("attention", "virtual"), ("attention", "spawn"),
                                                             ("step", "spawn"))
                    for mix in MIXES for pl in PLACEMENTS}
    for r in rows:
        assert r["cp"] == 2 and r["date"] and r["command"].startswith("python benchmarks/placement.py"), r
        if r["part"] == "attention":
            assert r["t_slowest_rank_s"] == max(r["t_ranks_s"]), r
            assert math.isclose(r["efficiency"], r["t_ideal_s"] / r["t_slowest_rank_s"], rel_tol=1e-12), r
            assert r["max_rel_err"] < 1e-4, r  # both placements compute one process's attention
            assert sum(r["tokens_ranks"]) == 256 and len(r["work_ranks"]) == 2, r
            mean = sum(r["work_ranks"]) / 2
            assert math.isclose(r["work_imbalance"], max(r["work_ranks"]) / mean - 1, abs_tol=1e-12), r
        else:
            assert r["loss_rel_diff"] <= 1e-5 and r["first_loss"] > 0, r  # the same loss under both
            assert r["t_step_s"] == max(r["t_ranks_s"]), r
            assert math.isclose(r["tokens_per_s_per_process"], 256 / r["t_step_s"] / 2, rel_tol=1e-12), r
    by = {(r["part"], r["mode"], r["mix"], r["placement"]): r for r in rows}
    for mix in MIXES:
        sharded = by[("attention", "spawn", mix, "sharded")]
        assert sharded["work_imbalance"] < 1e-9
        for pl in ("by_length", "auto"):
            placed = by[("attention", "spawn", mix, pl)]
            # The ring carries only the sharded documents' K/V: never more bytes than sharding all.
            assert all(p <= s for p, s in zip(placed["bytes_sent_per_layer_ranks"],
                                              sharded["bytes_sent_per_layer_ranks"]))
            assert placed["work_imbalance"] <= 0.10 + 1e-9  # auto is the by-length plan or sharded's
        for pl in PLACEMENTS:  # the virtual ring counts what the real one sends
            assert by[("attention", "virtual", mix, pl)]["bytes_sent_per_layer_ranks"] == \
                by[("attention", "spawn", mix, pl)]["bytes_sent_per_layer_ranks"]
        assert by[("step", "spawn", mix, "sharded")]["throughput_vs_sharded"] == 1.0
    # 64-token documents stay whole: nothing is sent; one long document is sharded either way.
    assert by[("attention", "spawn", "short", "by_length")]["bytes_sent_per_layer_ranks"] == [0, 0]
    one = [by[("attention", "spawn", "one_long", pl)]["bytes_sent_per_layer_ranks"] for pl in PLACEMENTS]
    assert all(o == one[0] for o in one) and min(one[0]) > 0


def test_ring_overhead_fit_recovers_its_coefficients():
    """benchmarks/ring_overhead.py's fit: rows made from known coefficients give them back;
    a term the rows make negative is dropped and the other refitted (never a negative cost)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from ring_overhead import fit

    a = 4e-5
    made = lambda step, token: [  # noqa: E731
        {"cp": cp, "n": n, "overhead_per_doc_s": cp * step + (cp - 1) / cp * n * token}
        for cp in (2, 4) for n in (64, 256, 1024)]
    got = fit(made(2e-4, 3e-6), a)
    assert math.isclose(got["ring_doc_step"], 2e-4 / a, rel_tol=1e-9)
    assert math.isclose(got["ring_token"], 3e-6 / a, rel_tol=1e-9) and got["max_abs_residual_s"] < 1e-12
    rows = made(0.0, 3e-6)
    rows[0]["overhead_per_doc_s"] -= 1e-3  # noise that drives the per-step term below 0
    got = fit(rows, a)
    assert got["ring_doc_step"] == 0.0 and got["ring_token"] > 0


def test_headline_placement_plot_draws_the_committed_rows(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import headline_plots

    results = os.path.join(ROOT, "benchmarks", "results")
    drawn = headline_plots.plot_placement(results, str(tmp_path))
    assert (tmp_path / "packed_placement.png").stat().st_size > 0
    with open(os.path.join(results, headline_plots.PLACEMENT_SOURCE)) as f:
        rows = [json.loads(line) for line in f]
    want = {(r["mix"], r["cp"], r["placement"]): r["efficiency"] for r in rows
            if r["part"] == "attention" and r["mode"] == "virtual"}
    assert {(m, c, pl): e for (m, c), by_pl in drawn.items() for pl, e in by_pl.items()} == want
    with open(os.path.join(ROOT, "README.md")) as f:
        assert "(benchmarks/results/packed_placement.png)" in f.read()
