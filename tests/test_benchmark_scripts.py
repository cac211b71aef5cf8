"""The memory and speed benchmarks run end to end in their quick mode and write the JSON
and PNG the README shows (figures are checked for shape and sanity, not for speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from subprocess_limits import HANG_GUARD_S
import warm_launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check_run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = warm_launch.run(cmd, dict(os.environ), ROOT, HANG_GUARD_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc


def _run(script: str, out: str) -> None:
    _check_run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick", "--cp-sizes", "1", "2",
                "--out", out])


def test_memory_scaling_quick(tmp_path):
    _run("memory_scaling.py", str(tmp_path))
    result = json.loads((tmp_path / "memory_scaling.json").read_text())
    assert (tmp_path / "memory_scaling.png").stat().st_size > 0
    assert {p["cp_size"] for p in result["points"]} == {1, 2}
    assert all(p["peak_mb_per_process"] > 0 for p in result["points"])
    for cp in ("1", "2"):
        assert result["longest"][cp]["mb_per_token"] > 0


def test_training_speed_quick(tmp_path):
    _run("training_speed.py", str(tmp_path))
    result = json.loads((tmp_path / "training_speed.json").read_text())
    assert (tmp_path / "training_speed.png").stat().st_size > 0
    assert [r["cp_size"] for r in result["rows"]] == [1, 2]
    for r in result["rows"]:
        assert r["tokens_per_second_per_process"] == r["seq_len"] / r["step_seconds"] / r["cp_size"], r
    one, two = result["rows"]
    # The wait sink reaches the ring's transfers: none without CP, some at cp=2.
    assert one["comm_wait_share"] == 0.0, one
    assert 0.0 < two["comm_wait_share"] < 1.0, two


def test_hybrid_step_quick(tmp_path):
    """Qwen3.5 at cp 1 and 2: every figure present and consistent; the mixers' saved bytes
    per rank about halve (tests/test_hybrid_activation_memory.py checks it closely, for
    Qwen3.5 and LFM2). One family keeps this smoke test short: the script's code is
    the same for each."""
    script = os.path.join(ROOT, "benchmarks", "hybrid_step.py")
    _check_run([sys.executable, script, "--quick", "--families", "qwen3_5_text", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "hybrid_step.json").read_text())
    assert (tmp_path / "hybrid_step.png").stat().st_size > 0
    rows = {(r["family"], r["cp"], r["mixer_impl"]): r for r in result["rows"]}
    assert set(rows) == {("qwen3_5_text", cp, impl) for cp, impl in ((1, "hf_ring"), (1, "transformers"), (2, "hf_ring"))}
    for (family, cp, impl), r in rows.items():
        assert r["efficiency"] == r["ideal_seconds"] / r["seconds"] > 0, r
        assert abs(sum(r["kind_share"].values()) - 1) < 1e-9, r["kind_share"]
        assert abs(sum(r["kind_seconds"].values()) - r["seconds"]) < 1e-9, r  # the split is of the timed step
        assert r["kind_seconds"]["mixers"] > 0 and r["kind_seconds"]["attention"] > 0, r["kind_seconds"]
        assert r["mixer_storages_top"] and r["saved_bytes"]["mixers"] > 0, r
    one, two = rows[("qwen3_5_text", 1, "hf_ring")], rows[("qwen3_5_text", 2, "hf_ring")]
    assert one["ideal_seconds"] == one["seconds"] and two["ideal_seconds"] == one["seconds"] / 2
    assert one["comm_wait_seconds"] == 0.0 < two["comm_wait_seconds"]
    assert 0.4 < two["saved_ratio_to_cp1"]["mixers"] < 0.6, two["saved_ratio_to_cp1"]
    # cp=1 with hf_ring's ops really ran them: Qwen3.5's scan saves other tensors than transformers'
    qwen = {impl: rows[("qwen3_5_text", 1, impl)]["saved_bytes"]["mixers"] for impl in ("hf_ring", "transformers")}
    assert qwen["hf_ring"] != qwen["transformers"], qwen


def test_step_world_family_config_scales_the_sweep_config():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from step_world import StepConfig, family_config

    cfg = StepConfig(cp_size=2, seq_lens=(4096,), family="qwen3_5_text", hidden_size=256, intermediate_size=512,
                     num_layers=4)
    config = family_config(cfg)
    assert config.layer_types == ["linear_attention", "full_attention"] * 2
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (256, 512, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 4, 32)
    # the mixers' head sizes scale with the hidden size (64 -> 256), their head counts stay
    assert (config.linear_key_head_dim, config.linear_value_head_dim) == (64, 64)
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (2, 4)
    assert config.max_position_embeddings == 4096 and not config.use_cache
    assert family_config(StepConfig(cp_size=1, seq_lens=(8,), family="lfm2")).layer_types == ["conv", "full_attention"]
    for bad in (dict(family="not_a_family"), dict(family="lfm2", num_layers=1), dict(family="lfm2", hidden_size=96),
                dict(family="lfm2", mixer_impl="hf_ring", cp_size=2), dict(mixer_impl="hf_ring"),
                dict(family="lfm2", mixer_impl="torch")):
        with pytest.raises(ValueError):
            StepConfig(**{"cp_size": 1, "seq_lens": (8,), **bad})


def test_rl_logprob_memory_tiny():
    """A GRPO step's peak per process at a 128,256 vocabulary, chunked head against full logits,
    cp 1 and 2: the four configurations compute one loss and gradient (float32, 1e-5 relative:
    the chunked head's online logsumexp sums in another order than the full logits'), and
    resident-set peaks (deterministic, not timings) order as the tensors they hold do."""
    script = os.path.join(ROOT, "benchmarks", "rl_logprob_memory.py")
    run = subprocess.run([sys.executable, script, "--tiny", "--json"], cwd=ROOT, timeout=HANG_GUARD_S,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    out = run.stdout
    rows = {(r["cp"], r["head"]): r for r in map(json.loads, out.splitlines())}
    assert set(rows) == {(cp, head) for cp in (1, 2) for head in ("chunked", "full")}
    assert not [r for r in rows.values() if "skipped" in r]
    first = rows[(1, "full")]
    for r in rows.values():
        assert abs(r["loss"] - first["loss"]) <= 1e-5 * abs(first["loss"]), (r, first)
        assert abs(r["grad_norm"] - first["grad_norm"]) <= 1e-5 * first["grad_norm"], (r, first)
        assert 0 < r["reference_peak_mb"] <= r["peak_mb"] <= r["estimate_mb"], r
    for cp in (1, 2):
        # 512 (256) tokens x 128,256 float32 logits: 250 (125) MB each, resident while the full head runs
        assert rows[(cp, "full")]["peak_mb"] > rows[(cp, "full")]["analytic_mb"] / 2
        assert rows[(cp, "chunked")]["peak_mb"] < rows[(cp, "full")]["peak_mb"], rows
    for head in ("chunked", "full"):
        assert rows[(2, head)]["peak_mb"] < rows[(1, head)]["peak_mb"], rows  # half the tokens per process


def test_headline_plots_draw_the_committed_results(tmp_path):
    """The README's plots (benchmarks/headline_plots.py) are drawn from the committed results:
    each line is the file's forward+backward efficiency, and the README shows the committed PNGs."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import headline_plots

    results = os.path.join(ROOT, "benchmarks", "results")
    for name, (source, key) in headline_plots.SOURCES.items():
        drawn = headline_plots.plot(name, results, str(tmp_path))
        assert (tmp_path / name).stat().st_size > 0 and os.path.exists(os.path.join(results, name))
        with open(os.path.join(results, source)) as f:
            rows = [json.loads(line) for line in f]
        want = {(r[key], r["cp"]): r["efficiency"] for r in rows if r.get("pass") == "forward+backward"}
        assert {(label, cp): e for label, by_cp in drawn.items() for cp, e in by_cp.items()} == want
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for png in (*headline_plots.SOURCES, "memory_scaling.png"):
        assert f"(benchmarks/results/{png})" in readme, png
