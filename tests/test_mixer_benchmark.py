"""benchmarks/mixer_efficiency.py runs end to end in its tiny mode and prints well-formed
JSON lines, one per (layout, pass), whose figures are consistent with each other; the CP
op it times is exact (its virtual ranks reassemble to the one-process scan's output and
input gradients) and sends what its two all-gathers carry.

Tiny problems are dominated by per-call overhead: the efficiencies are not asserted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mixer_efficiency_tiny_json():
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "mixer_efficiency.py"), "--tiny", "--json",
           "--threads", "1", "--clock", "process"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert {(r["layout"], r["pass"]) for r in rows} == {
        (lay, p) for lay in ("zigzag", "contiguous") for p in ("forward", "forward+backward")}
    for r in rows:
        assert r["cp"] == 2 and r["seq_per_rank"] == 64
        assert r["t_slowest_rank_s"] == max(r["t_ranks_s"])
        assert r["t_full_s"] == min(r["t_references_s"].values()) == r["t_references_s"][r["reference"]]
        assert math.isclose(r["efficiency"], r["t_full_s"] / (r["cp"] * r["t_slowest_rank_s"]), rel_tol=1e-12)
        assert r["max_rel_err"] < 1e-5, r  # float32 rounding; a missing state is off by O(1)
        # Forward: [S_ext | M] per piece, float32 (b=1, hv=2, dk=dv=16), to the other rank.
        pieces = 2 if r["layout"] == "zigzag" else 1
        summary = pieces * 2 * 16 * (16 + 16) * 4
        # Backward: each piece's share G (dk x dv); no final state was returned, so no gradient of it.
        shares = pieces * 2 * 16 * 16 * 4
        assert r["bytes_sent_per_rank"] == (summary if r["pass"] == "forward" else summary + shares), r
