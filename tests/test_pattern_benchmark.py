"""benchmarks/pattern_efficiency.py runs end to end in its tiny mode and its figures are
consistent: every pattern has forward and forward+backward rows at cp 2 and 4 (hybrid at
4 only), the efficiency is the reference over cp times the slowest rank, and the bytes
each rank sends are the collectives' volumes worked out here by hand; gpu_check.py's
pattern sections (benchmarks/gpu_patterns.py) run on the CPU backend.

Tiny blocks are dominated by per-call overhead, so the efficiencies are not asserted.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
from subprocess_limits import HANG_GUARD_S
import warm_launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# --tiny: 4 query / 2 KV heads, head_dim 16, float32, 32 tokens per rank, batch 1.
HQ, HK, D, S, F32 = 4, 2, 16, 32, 4


def expected_bytes(pattern: str, cp: int, pass_: str) -> int:
    """What one rank sends in one call, from the patterns' algorithms."""
    kv = 2 * S * HK * D * F32  # this rank's K and V
    q = S * HQ * D * F32
    if pattern == "ring":  # K/V hop cp - 1 times; backward: again, plus cp hops of dK/dV
        return (cp - 1) * kv if pass_ == "forward" else (cp - 1) * kv + (cp - 1) * kv + cp * kv
    if pattern == "allgather":  # all-gather; backward: all-gather again and reduce-scatter dK/dV
        return (cp - 1) * kv if pass_ == "forward" else 3 * (cp - 1) * kv

    def a2a(u: int) -> int:  # q, K/V (repeated up to u heads), out: (u - 1) / u of each
        kv_u = kv * max(HK, u) // HK
        return (q + kv_u + q) * (u - 1) // u

    if pattern == "ulysses":  # backward: dout, dq, dK/dV: the same volumes
        return a2a(cp) * (1 if pass_ == "forward" else 2)
    u = cp // 2  # hybrid: Ulysses over cp/2, a ring of 2 over the group's K/V for its heads
    ring_kv = kv * max(HK, u) // HK  # u * s tokens x max(hk, u) / u heads
    if pass_ == "forward":
        return a2a(u) + ring_kv
    return 2 * a2a(u) + ring_kv + ring_kv + 2 * ring_kv


def test_pattern_efficiency_tiny_json():
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "pattern_efficiency.py"), "--tiny", "--json",
           "--threads", "1", "--clock", "process"]
    proc = warm_launch.run(cmd, dict(os.environ), ROOT, HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    timed = [r for r in rows if "skipped" not in r]
    got = {(r["pattern"], r["cp"], r["pass"]) for r in timed}
    want = {(p, cp, ps) for p in ("ring", "allgather", "ulysses", "hybrid") for cp in (2, 4)
            for ps in ("forward", "forward+backward") if not (p == "hybrid" and cp == 2)}
    assert got == want
    assert [(r["pattern"], r["cp"]) for r in rows if "skipped" in r] == [("hybrid", 2)]
    for r in timed:
        assert math.isclose(r["efficiency"], r["t_full_s"] / (r["cp"] * r["t_slowest_rank_s"]), rel_tol=1e-12), r
        assert r["bytes_sent_per_rank"] == expected_bytes(r["pattern"], r["cp"], r["pass"]), r


def test_gpu_pattern_sections_on_cpu(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import gpu_patterns

    rows = []
    check = lambda what, errors: rows.append((what, errors))  # noqa: E731
    gpu_patterns.patterns_virtual(torch.device("cpu"), "torch_cpu_flash", torch.float32, check)
    # The reference against itself in float32: the section's plumbing (softcap reaches both).
    gpu_patterns.softcap_blocks(torch.device("cpu"), ["reference"], torch.float32, check)
    kinds = [w["kind"] for w, _ in rows]
    assert kinds == ["allgather pattern"] * 3 + ["softcap block"] * 3
    # zigzag, stripe and a packed row of mixed documents (each document alone as the reference)
    assert [w["layout"] for w, _ in rows[:3]] == ["zigzag", "stripe", "packed"]
    for what, errors in rows:
        # float32 against float64: ~1e-6; a wrong mask or a dropped softcap is off by > 1e-2.
        assert max(errors.values()) < 1e-4, (what, errors)
