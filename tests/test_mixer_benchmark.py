"""benchmarks/mixer_efficiency.py runs end to end in its tiny mode and prints well-formed
JSON lines, one per (mixer, layout, pass), whose figures are consistent with each other;
the CP ops it times are exact (their virtual ranks reassemble to the one-process op's
output and input gradients) and send what their exchanges carry (the gated delta rule:
two all-gathers; the SSD: one all-gather and, in the backward, its reduce-scatter).

Tiny problems are dominated by per-call overhead: the efficiencies are not asserted.
"""

from __future__ import annotations

import json
import math
import os
import sys
from subprocess_limits import HANG_GUARD_S
import warm_launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mixer_efficiency_tiny_json():
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "mixer_efficiency.py"), "--tiny", "--json",
           "--threads", "1", "--clock", "process"]
    proc = warm_launch.run(cmd, dict(os.environ), ROOT, HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert sorted((r["mixer"], r["layout"], r["pass"]) for r in rows) == sorted(
        (m, lay, p) for m in ("gated_delta_rule", "ssd") for lay in ("zigzag", "contiguous")
        for p in ("forward", "forward+backward"))
    for r in rows:
        assert r["cp"] == 2 and r["seq_per_rank"] == 64
        assert r["t_slowest_rank_s"] == max(r["t_ranks_s"])
        assert r["t_full_s"] == min(r["t_references_s"].values()) == r["t_references_s"][r["reference"]]
        assert math.isclose(r["efficiency"], r["t_full_s"] / (r["cp"] * r["t_slowest_rank_s"]), rel_tol=1e-12)
        assert r["max_rel_err"] < 1e-5, r  # float32 rounding; a missing state is off by O(1)
        pieces = 2 if r["layout"] == "zigzag" else 1
        if r["mixer"] == "ssd":
            # [S_ext | a] per piece, float32 (b=1, h=4, p=8, n=16); the backward's reduce-scatter
            # sends the other rank its half of the gradient of the gathered pair: as many bytes.
            assert (r["heads"], r["head_dim"], r["state_size"], r["groups"]) == (4, 8, 16, 2)
            summary = pieces * 4 * (8 * 16 + 1) * 4
            assert r["bytes_sent_per_rank"] == (1 if r["pass"] == "forward" else 2) * summary, r
            continue
        # Forward: [S_ext | M] per piece, float32 (b=1, hv=2, dk=dv=16), to the other rank.
        summary = pieces * 2 * 16 * (16 + 16) * 4
        # Backward: each piece's share G (dk x dv); no final state was returned, so no gradient of it.
        shares = pieces * 2 * 16 * 16 * 4
        assert r["bytes_sent_per_rank"] == (summary if r["pass"] == "forward" else summary + shares), r
