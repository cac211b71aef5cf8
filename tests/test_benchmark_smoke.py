"""benchmarks/ring_efficiency.py runs end to end in its tiny mode and prints well-formed
JSON lines: one per (layout, cp, seq_per_rank, pass), whose figures are consistent with
each other (the efficiency is the reference over cp times the slowest rank, the reference
the fastest exact way without CP, the kernel-only efficiency no lower than the whole);
the ring it times is exact (its virtual ring reassembles to full attention); and
benchmarks/gpu_check.py runs end to end on the CPU (``--dry-run-cpu``, the CUDA kernels
replaced by their stand-ins).

Tiny blocks are dominated by per-call overhead, so the efficiencies themselves are low
(~0.1-0.3) and not asserted. One thread and the process clock keep it stable on a machine
shared with other work.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest
import torch

from closeness import rel_err
from reference_attention import full_attention
from subprocess_limits import HANG_GUARD_S
import warm_launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = {"layout", "cp", "seq_per_rank", "pass", "efficiency"}


def test_ring_efficiency_tiny_json():
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "ring_efficiency.py"), "--tiny", "--json",
           "--threads", "1", "--clock", "process"]
    proc = warm_launch.run(cmd, dict(os.environ), ROOT, HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert {(r["layout"], r["pass"]) for r in rows} == {
        (lay, p) for lay in ("zigzag", "stripe", "contiguous", "packed", "packed_allgather", "packed_ulysses")
        for p in ("forward", "forward+backward")
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


@pytest.mark.parametrize("layout,cp", [("zigzag", 4), ("stripe", 3), ("contiguous", 2), ("packed", 2),
                                       ("packed_allgather", 3)])
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


def test_gpu_check_dry_run_on_cpu(tmp_path):
    """``benchmarks/gpu_check.py --dry-run-cpu``: every section, every CUDA backend's glue
    through the CPU stand-ins (tests/cuda_standins.py), one PASS line per backend. The GPU
    time it will get is scarce, so its own code must be known to run before it gets there."""
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--dry-run-cpu", "--out", str(out)]
    proc = warm_launch.run(cmd, dict(os.environ), ROOT, HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    names = ("flash_attn_3", "flash_attn_4", "torch_cudnn", "flash_attn", "torch_flash", "torch_efficient")
    # The verdicts, one line per backend, printed as soon as correctness ends and again at the end.
    after = lines.index("== throughput")
    assert [line.split(":")[0] for line in lines[after - len(names):after]] == [f"PASS {n}" for n in names]
    for name in names:
        assert sum(line.startswith(f"PASS {name}: ") for line in lines) == 2, name
    assert any(line.startswith("backend='auto' order here:") for line in lines)
    report = json.loads(out.read_text())
    assert not any("error" in report[s] or "interrupted" in report[s]
                   for s in ("correctness", "throughput", "efficiency", "patterns", "overlap", "placement", "compile"))
    # The compiled step (gpu_compile.py, aot_eager here): equal to eager, the ring's op in both layers.
    assert report["compile"]["pass"] and report["compile"]["op_calls_per_forward"] == 2, report["compile"]
    # Issue 50's side by side: every mix under every placement, each equal to one process.
    placed = report["placement"]["rows"]
    assert {(r["mix"], r["placement"]) for r in placed} == {(m, p) for m in ("short", "five", "long_tail", "one_long")
                                                           for p in ("sharded", "by_length", "auto")}
    assert all(r["max_rel_err"] < 2e-2 and r["dtype"] == "bfloat16" for r in placed), placed
    assert list(report["verdicts"]) == list(names)
    assert all(report["verdicts"][n].startswith(f"PASS {n}: ") for n in names), report["verdicts"]
    planned = report["budget"]
    assert planned["total_s"] == 420 and planned["hard_limit_s"] <= 480, planned
    assert abs(sum(planned["planned_sections_s"].values()) + planned["setup_s"] - 420) < 1e-6, planned
    checks = report["correctness"]["checks"]
    for name in names:  # a block check and both rings (zigzag; packed: the varlen path where there is one)
        kinds = {(r["kind"], r.get("layout")) for r in checks if r["backend"] == name}
        assert {("block", None), ("ring", "zigzag"), ("ring", "packed")} <= kinds, (name, kinds)
        # The masked kernel (sliding windows), where the backend has one.
        assert (("window", None) in kinds) == (name in ("torch_flash", "flash_attn_4", "flash_attn_3")), (name, kinds)
        # The packed all-gather: two varlen calls per layer where the kernel has bottom-right causal blocks.
        paths = {r["path"] for r in checks if r["backend"] == name and r["kind"] == "allgather pattern"
                 and r["layout"] == "packed"}
        assert (paths == {"two varlen calls"}) == (name in ("flash_attn", "torch_flash")), (name, paths)
    assert set(report["throughput"]["measured_order"]) == set(names)
    assert {r["backend"] for r in report["efficiency"]["rows"]} == set(names)
    lap = report["overlap"]["rows"][0]
    assert lap["kv_block_bytes"] == 2 * 32 * 2 * 128 * 2
    assert lap["fwd_hidden_d2d_s"] == (lap["t_copy_d2d_s"] < lap["t_step_fwd_s"]), lap


def test_gpu_check_planned_budget(monkeypatch):
    """By construction within the device machine's limits: 8 minutes for the full run, 4 for
    --quick, the kill switch included; every section has a share."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    gpu_check = importlib.import_module("gpu_check")
    for argv, total, limit in (([], 420, 480), (["--quick"], 180, 240), (["--dry-run-cpu"], 420, 480)):
        plan = gpu_check.plan(argv)
        assert plan["total_s"] == total and plan["hard_limit_s"] <= limit, (argv, plan)
        assert abs(sum(plan["sections_s"].values()) - total) < 1e-9 and min(plan["sections_s"].values()) > 0, plan
    with pytest.raises(SystemExit):
        gpu_check.plan(["--budget"])  # a number is required


def test_gpu_check_verdicts(monkeypatch):
    """A backend with a failed check, one with none run, and one that cannot run here each
    get their own line."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    gpu_check = importlib.import_module("gpu_check")
    checks = [{"backend": "torch_flash", "pass": True}, {"backend": "torch_flash", "pass": False, "kind": "ring"},
              {"backend": "torch_efficient", "pass": True}]
    lines = gpu_check.verdicts(["torch_flash", "torch_efficient", "torch_cudnn"],
                               {"flash_attn_3": "runs on sm90 GPUs only", "flash_attn": "not installed",
                                "flash_attn_4": "not installed"}, checks)
    assert lines["torch_flash"].startswith("FAIL torch_flash: 1/2 checks passed; first failure: ")
    assert lines["torch_efficient"] == "PASS torch_efficient: 1/1 checks passed"
    cut = gpu_check.verdicts(["torch_efficient"], {}, checks, {"torch_efficient": 3})
    assert cut["torch_efficient"] == "PASS torch_efficient: 1/1 checks passed (3 not run: time budget)"
    assert lines["torch_cudnn"] == "FAIL torch_cudnn: no check ran within the time budget"
    assert lines["flash_attn_3"] == "SKIP flash_attn_3: runs on sm90 GPUs only"


def test_packed_runs_tiny_agrees_with_one_call_per_document():
    """benchmarks/packed_runs.py: both ways give the same attention (it raises otherwise),
    and the row holds the documents asked for, all of one length."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import packed_runs
        import ring_efficiency
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    cfg = ring_efficiency.BenchConfig(heads=2, kv_heads=1, head_dim=16, repeats=1, clock="process")
    row = packed_runs.measure(8, 2, 64, cfg)
    assert (row["docs"], row["doc_len"]) == (8, 16)
    assert row["max_rel_diff"] <= 1e-5 and row["t_batched_s"] > 0 and row["t_per_document_s"] > 0
    assert ring_efficiency.packed_doc_lens(256, 4, 8) == [32] * 8
    with pytest.raises(ValueError, match="do not split into 3 documents"):
        ring_efficiency.packed_doc_lens(256, 4, 3)


def test_gather_overlap_tiny_json():
    """benchmarks/gather_overlap.py runs the all-gather pattern both ways over gloo and
    reports, per way, the slowest rank's times and every rank's time blocked."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gather_overlap.py"), "--tiny", "--json"]
    proc = warm_launch.run(cmd, dict(os.environ), ROOT, HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [r["way"] for r in rows] == ["overlapped", "serial"]
    for r in rows:
        assert r["cp"] == 2 and len(r["t_ranks_forward_backward_s"]) == len(r["t_blocked_ranks_s"]) == 2, r
        assert r["t_forward_backward_s"] == max(r["t_ranks_forward_backward_s"]), r
        assert 0 < r["t_forward_s"] < r["t_forward_backward_s"], r
        assert all(0 <= b <= r["t_forward_backward_s"] for b in r["t_blocked_ranks_s"]), r
