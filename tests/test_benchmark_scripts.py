"""The memory and speed benchmarks run end to end in their quick mode and write the JSON
and PNG the README shows (figures are checked for shape and sanity, not for speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, out: str) -> None:
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick", "--cp-sizes", "1", "2", "--out", out],
        check=True, cwd=ROOT, timeout=600,
    )


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
