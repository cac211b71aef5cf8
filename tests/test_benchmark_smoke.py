"""benchmarks/ring_efficiency.py runs end to end in its tiny mode and prints well-formed
JSON lines: one per (layout, cp, seq_per_rank, pass), whose figures are consistent with
each other (the efficiency is the reference over cp times the slowest rank, the reference
the fastest exact way without CP, the kernel-only efficiency no lower than the whole);
the ring it times is exact (its virtual ring reassembles to full attention); and
benchmarks/gpu_check.py's sections run, pointed at the CPU backend.

Tiny blocks are dominated by per-call overhead, so the efficiencies themselves are low
(~0.1-0.3) and not asserted. One thread and the process clock keep it stable on a machine
shared with other work.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from reference_attention import full_attention, rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = {"layout", "cp", "seq_per_rank", "pass", "efficiency"}


def test_ring_efficiency_tiny_json():
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "ring_efficiency.py"), "--tiny", "--json",
           "--threads", "1", "--clock", "process"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert {(r["layout"], r["pass"]) for r in rows} == {
        (lay, p) for lay in ("zigzag", "stripe", "contiguous", "packed") for p in ("forward", "forward+backward")
    }
    for r in rows:
        assert REQUIRED <= set(r), r
        assert r["cp"] == 2 and r["seq_per_rank"] == 64
        assert r["t_slowest_rank_s"] == max(r["t_ranks_s"]), r
        assert r["t_full_s"] == min(r["t_references_s"].values()) == r["t_references_s"][r["reference"]], r
        assert math.isclose(r["efficiency"], r["t_full_s"] / (r["cp"] * r["t_slowest_rank_s"]), rel_tol=1e-12), r
        # Per repeat the kernels' time is part of the rank's, so their medians keep that order.
        assert r["kernel_only_efficiency"] >= r["efficiency"], r
    packed = {r["pass"]: r for r in rows if r["layout"] == "packed"}
    # Packed rows are compared with the fastest exact way to run them without CP.
    assert set(packed["forward"]["t_references_s"]) == {"per-document calls", "one masked SDPA call"}


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("ring_efficiency", os.path.join(ROOT, "benchmarks", "ring_efficiency.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("layout,cp", [("zigzag", 4), ("stripe", 3), ("contiguous", 2), ("packed", 2)])
def test_virtual_ring_computes_attention(layout, cp):
    """The ring the benchmark times is exact: reassembled over all ranks, its out, lse and
    dq are full attention's (float64, within 1e-10 of the plain-math reference)."""
    bench = _load_benchmark()
    cfg = bench.BenchConfig(heads=4, kv_heads=2, head_dim=16, dtype="float64")
    pb = bench.make_problem(layout, cp, 24, cfg)
    got = bench.virtual_ring(pb, cfg.kernel(), 1 / math.sqrt(16))
    doc_ids = None
    if pb.doc_lens:
        doc_ids = torch.repeat_interleave(torch.arange(len(pb.doc_lens)), torch.tensor(pb.doc_lens))
    q, k, v = (t.clone().requires_grad_() for t in (pb.q, pb.k, pb.v))
    out, lse = full_attention(q, k, v, True, doc_ids)
    out.backward(pb.dout)
    assert set(got) == {"out", "lse", "dq"}
    for name, want in (("out", out), ("lse", lse), ("dq", q.grad)):
        assert rel_err(got[name], want.detach()) < 1e-10, name


def test_gpu_check_logic_on_cpu(monkeypatch):
    """benchmarks/gpu_check.py's sections, pointed at the CPU flash backend: the GPU time
    it will get is scarce, so its own code must be known to run before it gets there."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    gpu_check = importlib.import_module("gpu_check")
    monkeypatch.setattr(gpu_check, "DEVICE", torch.device("cpu"))
    monkeypatch.setattr(gpu_check, "NAMES", ("torch_cpu_flash",))
    rows: list[dict] = []
    gpu_check.check_block("torch_cpu_flash", torch.float32, 4, 2, 64, False, 40, 24, rows)
    gpu_check.check_ring("torch_cpu_flash", torch.bfloat16, "packed", 2, rows)
    assert [r["pass"] for r in rows] == [True, True], rows
    eff = gpu_check.efficiency(60, [2], [32], 2, 1)
    assert {r["layout"] for r in eff["rows"]} == {"zigzag", "stripe", "contiguous", "packed"}
    lap = gpu_check.overlap([32], 2, 1)["rows"][0]
    assert lap["kv_block_bytes"] == 2 * 32 * 1 * 128 * 2
    assert lap["fwd_hidden_d2d_s"] == (lap["t_copy_d2d_s"] < lap["t_step_fwd_s"]), lap
