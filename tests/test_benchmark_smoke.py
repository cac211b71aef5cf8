"""benchmarks/ring_efficiency.py runs end to end in its tiny mode and prints well-formed
JSON lines: one per (layout, cp, seq_per_rank, pass) with an efficiency in (0, 1.5]; the
block calls it times are exactly the ring's (they reassemble to full attention); and
benchmarks/gpu_check.py's sections run, pointed at the CPU backend.

Tiny blocks are dominated by per-call overhead, so the efficiencies are low (~0.1-0.3);
the bound only catches a broken ratio (zero, negative, a reference that was not timed).
One thread and the process clock keep it stable on a machine shared with other work.
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
        assert 0 < r["efficiency"] <= 1.5, r


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("ring_efficiency", os.path.join(ROOT, "benchmarks", "ring_efficiency.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("layout,cp", [("zigzag", 4), ("stripe", 3), ("contiguous", 2), ("packed", 2)])
def test_virtual_ring_computes_attention(layout, cp):
    """The block calls the benchmark times are the ring's: reassembled over all ranks they
    give full attention and its gradients (float64, within 1e-10 of the plain-math reference)."""
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
    for name, want in (("out", out), ("lse", lse), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
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
    assert lap["kv_block_bytes"] == 2 * 32 * 1 * 128 * 2 and lap["t_step_fwd_s"] > 0
