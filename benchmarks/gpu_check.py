"""One-shot GPU check of hf_ring's CUDA kernels and ring efficiency (a few minutes on one GPU).

Three sections, each guarded so that a failure in one still lets the others run:

1. correctness: every CUDA backend available here (flash_attn, flash_attn_3,
   torch_efficient), forward and backward, against the float64 ``reference`` backend on
   the same rounded inputs, for MHA and GQA, head_dim 64 and 128, causal (square) and
   non-causal (q_len != k_len, lengths not multiples of the kernels' tiles) blocks; then
   the whole virtual ring (zigzag cp=4 and packed cp=2, from ring_efficiency.py) with each
   backend against full attention (out, lse, dq); logit softcapping on the backends that
   take it, and the virtual all-gather pattern (gpu_patterns.py). Tolerances on
   norm(x - ref) / norm(ref): see TOL.
2. efficiency: ring_efficiency.measure_group with each CUDA backend, bf16, cp 4 and 8,
   4k to 32k tokens per rank, within --budget-s seconds (the rest is skipped, and said so).
3. patterns: every context-parallel pattern's virtual efficiency and bytes sent per rank
   (pattern_efficiency.py), bf16, zigzag, within --budget-s seconds.
4. overlap: time to move one K/V block (a device-to-device copy, and a copy to a second
   GPU when there is one) against the time to compute one ring step on it, forward and
   backward. The ring hides the transfer when transfer < compute.

Prints PASS/FAIL lines and tables; writes everything as JSON to --out. Exit status 1 if
any correctness check failed.

Run: ``python benchmarks/gpu_check.py --out gpu_check.json`` (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from typing import Any, Callable

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
# The sibling script, and hf_ring itself from this checkout: a GPU machine may have only
# torch installed, not this package.
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]
import gpu_patterns  # noqa: E402
import ring_efficiency as bench  # noqa: E402

from hf_ring.kernels import available_backends, get_backend  # noqa: E402
from hf_ring.ring.schedule import step_blocks  # noqa: E402

CUDA_BACKENDS = ("flash_attn", "flash_attn_3", "torch_efficient")
# Relative error bounds by input dtype. The kernels round P (and dP) to the input dtype
# before the second matmul, so out and gradients carry a few units of that dtype's
# rounding (bf16 2^-8, fp16 2^-11); lse is accumulated in float32 throughout.
TOL = {
    torch.bfloat16: {"out": 2e-2, "lse": 1e-3, "grad": 5e-2},
    torch.float16: {"out": 5e-3, "lse": 1e-3, "grad": 1e-2},
    torch.float32: {"out": 1e-3, "lse": 1e-4, "grad": 2e-3},
}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def guarded(report: dict, section: str, fn: Callable[[], Any]) -> None:
    """Run one section; record its result, or its error, without stopping the script."""
    start = time.perf_counter()
    try:
        report[section] = fn()
    except Exception as e:  # a broken section must not hide the others' results
        traceback.print_exc()
        report[section] = {"error": f"{type(e).__name__}: {e}"}
    print(f"[{section}: {time.perf_counter() - start:.1f}s]", flush=True)


# The device under test and the backends to check on it. ``--dry-run-cpu`` points these at
# the CPU and its flash backend, to exercise this script's own logic on a machine without
# a GPU (the numbers then say nothing about CUDA).
DEVICE = torch.device("cuda")
NAMES = CUDA_BACKENDS


def backends_for(dtype: torch.dtype) -> list[str]:
    here = available_backends(DEVICE, dtype)
    return [n for n in NAMES if n in here]


# ------------------------------------------------------------------------- correctness


def _check(rows: list[dict], what: dict, errors: dict[str, float], tol: dict) -> None:
    ok = all(errors[k] <= tol["grad" if k.startswith("d") else k] for k in errors)
    rows.append({**what, **{f"err_{k}": v for k, v in errors.items()}, "pass": ok})
    errs = " ".join(f"{k}={v:.2e}" for k, v in errors.items())
    print(f"{'PASS' if ok else 'FAIL'} {' '.join(f'{k}={v}' for k, v in what.items())} {errs}", flush=True)


def check_block(name: str, dtype: torch.dtype, hq: int, hk: int, d: int, causal: bool, sq: int, sk: int,
                rows: list[dict]) -> None:
    dev = DEVICE
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, dout = (torch.randn(2, n, h, d, generator=g).to(dev, dtype)
                     for n, h in ((sq, hq), (sk, hk), (sk, hk), (sq, hq)))
    scale = 1 / math.sqrt(d)
    kernel, ref = get_backend(name, dev, dtype), get_backend("reference", dev, torch.float64)
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, dout))
    ref_out, ref_lse = ref.forward(q64, k64, v64, causal, scale)
    out, lse = kernel.forward(q, k, v, causal, scale)
    # Backward as the ring calls it: the final out in the input dtype and a float32 lse.
    grads = kernel.backward(dout, q, k, v, ref_out.to(dtype), ref_lse.float(), causal, scale)
    ref_grads = ref.backward(do64, q64, k64, v64, ref_out, ref_lse, causal, scale)
    errors = {"out": rel_err(out, ref_out), "lse": rel_err(lse, ref_lse)}
    errors |= {n: rel_err(gr, rg) for n, gr, rg in zip(("dq", "dk", "dv"), grads, ref_grads)}
    what = dict(kind="block", backend=name, dtype=str(dtype).split(".")[1], heads=f"{hq}/{hk}", head_dim=d,
                causal=causal, q_len=sq, k_len=sk)
    _check(rows, what, errors, TOL[dtype])


def check_ring(name: str, dtype: torch.dtype, layout: str, cp: int, rows: list[dict]) -> None:
    cfg = bench.BenchConfig(heads=8, kv_heads=2, head_dim=128, dtype=str(dtype).split(".")[1],
                            device=DEVICE.type, backend=name)
    pb = bench.make_problem(layout, cp, 200, cfg)
    scale = 1 / math.sqrt(128)
    got = bench.virtual_ring(pb, cfg.kernel(), scale)
    ref = get_backend("reference", DEVICE, torch.float64)
    q, k, v, dout = (t.double() for t in (pb.q, pb.k, pb.v, pb.dout))
    parts = {"out": [], "lse": [], "dq": [], "dk": [], "dv": []}
    for c in bench.full_calls(pb):  # one causal block per document (the whole row if dense)
        o, l = ref.forward(q[:, c], k[:, c], v[:, c], True, scale)
        grads = ref.backward(dout[:, c], q[:, c], k[:, c], v[:, c], o, l, True, scale)
        for n, t in zip(parts, (o, l, *grads)):
            parts[n].append(t)
    want = {n: torch.cat(ts, 2 if n == "lse" else 1) for n, ts in parts.items()}
    # The virtual ring returns what it computes exactly (out, lse, dq; see virtual_ring).
    errors = {n: rel_err(got[n], want[n]) for n in got}
    what = dict(kind="ring", backend=name, dtype=str(dtype).split(".")[1], layout=layout, cp=cp,
                seq=pb.q.shape[1])
    _check(rows, what, errors, TOL[dtype])


def correctness() -> dict:
    rows: list[dict] = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for name in backends_for(dtype):
            for (hq, hk), d, causal in [((8, 8), 128, True), ((8, 2), 128, True), ((8, 2), 64, True),
                                        ((8, 2), 128, False), ((8, 1), 64, False)]:
                lengths = [(200, 200)] if causal else [(200, 136), (72, 264)]
                for sq, sk in lengths:
                    _run_one(rows, lambda: check_block(name, dtype, hq, hk, d, causal, sq, sk, rows),
                             dict(kind="block", backend=name, dtype=str(dtype)))
            if dtype == torch.bfloat16 or name == "torch_efficient":
                for layout, cp in (("zigzag", 4), ("packed", 2)):
                    _run_one(rows, lambda: check_ring(name, dtype, layout, cp, rows),
                             dict(kind="ring", backend=name, dtype=str(dtype), layout=layout))
    for dtype in (torch.bfloat16, torch.float16):
        check = lambda what, errors, dtype=dtype: _check(rows, what, errors, TOL[dtype])  # noqa: E731
        _run_one(rows, lambda: gpu_patterns.softcap_blocks(DEVICE, backends_for(dtype), dtype, check),
                 dict(kind="softcap block", dtype=str(dtype)))
        for name in backends_for(dtype)[:1]:
            _run_one(rows, lambda: gpu_patterns.patterns_virtual(DEVICE, name, dtype, check),
                     dict(kind="allgather pattern", backend=name, dtype=str(dtype)))
    failed = [r for r in rows if not r["pass"]]
    print(f"correctness: {len(rows) - len(failed)} passed, {len(failed)} failed", flush=True)
    return {"checks": rows, "failed": len(failed), "backends": {str(d): backends_for(d) for d in TOL}}


def _run_one(rows: list[dict], fn: Callable[[], None], what: dict) -> None:
    try:
        fn()
    except Exception as e:  # one unsupported case must not stop the others
        rows.append({**what, "pass": False, "error": f"{type(e).__name__}: {e}"})
        print(f"FAIL {what} raised {type(e).__name__}: {e}", flush=True)


# -------------------------------------------------------------------------- efficiency


def _measure_layouts(cp: int, spr: int, cfg) -> list[dict]:
    return bench.measure_group(cp, spr, list(bench.LAYOUTS), cfg)


def _describe_layout(r: dict) -> str:
    return f"{r['layout']:11} cp={r['cp']} seq/rank={r['seq_per_rank']:6} {r['pass']:17} eff={r['efficiency']:.3f} " \
           f"full={r['t_full_s'] * 1e3:8.2f}ms slowest rank={r['t_slowest_rank_s'] * 1e3:8.2f}ms"


def efficiency(budget_s: float, cps: list[int], lengths: list[int], heads: int, kv_heads: int,
               measure: Callable = _measure_layouts, describe: Callable = _describe_layout) -> dict:
    """``measure(cp, seq_per_rank, cfg) -> rows`` for each CUDA backend (bf16), cp and length
    until ``budget_s`` is spent; every row printed by ``describe``."""
    rows, skipped = [], []
    start = time.perf_counter()
    for name in backends_for(torch.bfloat16):
        cfg = bench.BenchConfig(heads=heads, kv_heads=kv_heads, head_dim=128, dtype="bfloat16",
                                device=DEVICE.type, backend=name, repeats=3, warmup=1)
        for cp in cps:
            for spr in lengths:
                if time.perf_counter() - start > budget_s:
                    skipped.append({"backend": name, "cp": cp, "seq_per_rank": spr})
                    continue
                try:
                    new = measure(cp, spr, cfg)
                except torch.cuda.OutOfMemoryError as e:
                    skipped.append({"backend": name, "cp": cp, "seq_per_rank": spr, "error": str(e)[:200]})
                    torch.cuda.empty_cache()
                    continue
                rows += new
                for r in new:
                    print(f"{name:16} {describe(r)}", flush=True)
    if skipped:
        print(f"efficiency: skipped {len(skipped)} configurations (time budget or memory): {skipped}", flush=True)
    return {"rows": rows, "skipped": skipped}


# ----------------------------------------------------------------------------- overlap


def _device_time(fn: Callable[[], Any], repeats: int = 20) -> float:
    """Median seconds of ``fn``: by CUDA events on the current stream (wall time on CPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if DEVICE.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def overlap(lengths: list[int], heads: int, kv_heads: int) -> dict:
    """Per tokens-per-rank: K/V block transfer time against one zigzag ring step's compute."""
    dev, dtype, d = DEVICE, torch.bfloat16, 128
    peer = torch.device("cuda", 1) if DEVICE.type == "cuda" and torch.cuda.device_count() > 1 else None
    rows = []
    for name in backends_for(dtype):
        kernel = get_backend(name, dev, dtype)
        for spr in lengths:
            # The message of one step: K and V of one shard, (2, 1, spr, kv_heads, d); the
            # backward also sends the float32 dK/dV accumulator of the same shape.
            kv = torch.randn(2, 1, spr, kv_heads, d, device=dev, dtype=dtype)
            dst = torch.empty_like(kv)
            q = torch.randn(1, spr, heads, d, device=dev, dtype=dtype)
            dout = torch.randn_like(q)
            c = spr // 2
            # A zigzag step that is not the diagonal: all queries against half the keys.
            blk = step_blocks("zigzag", True, spr, 1, 0)[0]
            ks = slice(blk.k_start, blk.k_end)
            scale = 1 / math.sqrt(d)
            out, lse = kernel.forward(q, kv[0][:, ks], kv[1][:, ks], False, scale)
            row = {
                "backend": name, "seq_per_rank": spr, "kv_block_bytes": kv.numel() * kv.element_size(),
                "t_copy_d2d_s": _device_time(lambda: dst.copy_(kv)),
                "t_step_fwd_s": _device_time(lambda: kernel.forward(q, kv[0][:, ks], kv[1][:, ks], False, scale)),
                "t_step_bwd_s": _device_time(lambda: kernel.backward(dout, q, kv[0][:, ks], kv[1][:, ks], out, lse,
                                                                   False, scale)),
                "step_block": f"{spr}x{c}",
            }
            if peer is not None:
                remote = torch.empty_like(kv, device=peer)
                row["t_copy_p2p_s"] = _device_time(lambda: remote.copy_(kv))
            for key in ("t_copy_d2d_s", "t_copy_p2p_s"):
                if key in row:
                    # Forward: K/V travel; backward: K/V plus the float32 dK/dV accumulator (3x).
                    row[key.replace("t_copy", "fwd_hidden")] = row[key] < row["t_step_fwd_s"]
                    row[key.replace("t_copy", "bwd_hidden")] = 3 * row[key] < row["t_step_bwd_s"]
            rows.append(row)
            p2p = f"{row['t_copy_p2p_s'] * 1e6:8.1f}us" if peer is not None else "     n/a"
            print(f"{name:16} seq/rank={spr:6} KV block {row['kv_block_bytes'] / 2**20:7.1f} MiB  "
                  f"d2d copy {row['t_copy_d2d_s'] * 1e6:8.1f}us  p2p {p2p}  step fwd {row['t_step_fwd_s'] * 1e6:9.1f}us"
                  f"  step bwd {row['t_step_bwd_s'] * 1e6:9.1f}us", flush=True)
    # Link bandwidth at which a step's transfer just matches its forward compute: above it
    # the ring hides communication (e.g. ~50 GB/s per GPU over InfiniBand, ~450 over NVLink).
    for r in rows:
        r["break_even_GBps_fwd"] = r["kv_block_bytes"] / r["t_step_fwd_s"] / 1e9
        r["break_even_GBps_bwd"] = 3 * r["kv_block_bytes"] / r["t_step_bwd_s"] / 1e9
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where to write the JSON report")
    p.add_argument("--budget-s", type=float, default=180.0, help="time allowed for the efficiency sweep")
    p.add_argument("--cp", type=int, nargs="+", default=[4, 8])
    p.add_argument("--seq-per-rank", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--skip", nargs="*", default=[], choices=["correctness", "efficiency", "patterns", "overlap"])
    p.add_argument("--dry-run-cpu", action="store_true",
                   help="run this script's logic on the CPU flash backend (no GPU needed; numbers are not CUDA's)")
    a = p.parse_args(argv)
    global DEVICE, NAMES
    if a.dry_run_cpu:
        DEVICE, NAMES = torch.device("cpu"), ("torch_cpu_flash",)
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check (--dry-run-cpu exercises the script on CPU)",
              file=sys.stderr)
        return 2
    cuda = DEVICE.type == "cuda"
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)",
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "torch": torch.__version__, "cuda": torch.version.cuda, "devices": torch.cuda.device_count(),
        "packages": _versions(),
    }
    print(json.dumps({k: report[k] for k in ("device", "capability", "torch", "cuda", "devices", "packages")}))
    print("backends under test (bf16):", backends_for(torch.bfloat16), flush=True)
    sections = {
        "correctness": correctness,
        "efficiency": lambda: efficiency(a.budget_s, a.cp, a.seq_per_rank, a.heads, a.kv_heads),
        "patterns": lambda: efficiency(a.budget_s, a.cp, a.seq_per_rank, a.heads, a.kv_heads,
                                       gpu_patterns.measure_patterns, gpu_patterns.describe_pattern),
        "overlap": lambda: overlap(a.seq_per_rank, a.heads, a.kv_heads),
    }
    for section, fn in sections.items():
        if section not in a.skip:
            guarded(report, section, fn)
            with open(a.out, "w") as f:  # written after each section, so a later crash keeps the rest
                json.dump(report, f, indent=1, default=str)
    failed = report.get("correctness", {}).get("failed", 0) or "error" in report.get("correctness", {})
    print(f"gpu_check: {'FAIL' if failed else 'PASS'}; report in {a.out}", flush=True)
    return 1 if failed else 0


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for pkg in ("flash_attn", "flash_attn_3", "hf_ring"):
        try:
            found[pkg] = version(pkg)
        except PackageNotFoundError:
            found[pkg] = None
    return found


if __name__ == "__main__":
    sys.exit(main())
