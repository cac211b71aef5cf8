"""One-shot GPU check of every CUDA block backend and of the ring on them (< 10 minutes on one H200).

Sections, each within its own time budget and guarded, so that a failure or a slow
compile in one still lets the others run:

1. correctness (gpu_check_kernels.py): every CUDA backend (flash_attn_3, flash_attn_4,
   torch_cudnn, flash_attn, torch_flash, torch_efficient), forward and backward, against
   the float64 reference: MHA / GQA / MQA, head_dim 64 and 128, causal (square) and not
   (q_len != k_len, lengths off the kernels' tiles), in each dtype it takes; then the
   whole virtual ring (zigzag cp=4, packed cp=2) on each against full attention; logit
   softcapping where a backend takes it, and the virtual all-gather pattern
   (gpu_patterns.py). Cheapest-first per backend, so a spent budget still leaves every
   backend checked.
2. throughput: forward and backward TFLOP/s of one bf16 block per backend, and the
   measured order next to the order ``backend="auto"`` uses here (not yet measured by
   this project: the next run on a GPU confirms or changes it).
3. efficiency: ring_efficiency.measure_group per backend, bf16, cp 4 and 8, 4k to 32k
   tokens per rank (lengths outer, backends inner).
4. patterns: every context-parallel pattern's virtual efficiency and bytes sent per rank
   (pattern_efficiency.py via gpu_patterns.py) on the first backend in auto's order.
5. overlap: time to move one K/V block against one ring step's compute.

Prints one ``PASS`` / ``FAIL`` / ``SKIP`` (not runnable here, and why) line per backend,
writes everything as JSON to --out; exit status 1 if any backend failed.

``--dry-run-cpu`` runs all of it on the CPU at tiny sizes, every CUDA backend's glue
routed to the stand-ins of tests/cuda_standins.py: the script's own logic is known to run
before it gets scarce GPU time (the numbers then say nothing about CUDA).

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
# The sibling scripts, and hf_ring itself from this checkout: a GPU machine may have only
# torch installed, not this package.
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]
import gpu_check_kernels as kernels  # noqa: E402
import gpu_patterns  # noqa: E402
import ring_efficiency as bench  # noqa: E402

from hf_ring.kernels import available_backends, get_backend, registry  # noqa: E402
from hf_ring.patterns.ring.schedule import step_blocks  # noqa: E402

CUDA_BACKENDS = ("flash_attn_3", "flash_attn_4", "torch_cudnn", "flash_attn", "torch_flash", "torch_efficient")
CHECK_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def guarded(report: dict, section: str, fn: Callable[[], Any]) -> None:
    """Run one section; record its result, or its error, without stopping the script."""
    start = time.perf_counter()
    try:
        report[section] = fn()
    except Exception as e:  # a broken section must not hide the others' results
        traceback.print_exc()
        report[section] = {"error": f"{type(e).__name__}: {e}"}
    print(f"[{section}: {time.perf_counter() - start:.1f}s]", flush=True)


def runnable(device: torch.device) -> tuple[dict[str, list[torch.dtype]], dict[str, str]]:
    """For each CUDA backend: the dtypes it runs in here (its record's, in CHECK_DTYPES
    order), or why it cannot run here at all."""
    dtypes, why = {}, {}
    for name in CUDA_BACKENDS:
        record = registry._REGISTERED[name].backend
        ok = [d for d in CHECK_DTYPES if d in record.dtypes and name in available_backends(device, d)]
        if ok:
            dtypes[name] = ok
            continue
        try:
            get_backend(name, device, torch.bfloat16)
            why[name] = "runs in none of the checked dtypes"
        except (ValueError, NotImplementedError) as e:
            why[name] = str(e).split("; available here")[0]
    return dtypes, why


def efficiency(device: torch.device, names: list[str], budget_s: float, cps: list[int], lengths: list[int],
               heads: int, kv_heads: int, repeats: int = 3) -> dict:
    rows, skipped = [], []
    start = time.perf_counter()
    for cp in cps:
        for spr in lengths:
            for name, layout in ((n, lay) for n in names for lay in ("zigzag", "packed")):
                if time.perf_counter() - start > budget_s:
                    skipped.append({"backend": name, "layout": layout, "cp": cp, "seq_per_rank": spr})
                    continue
                cfg = bench.BenchConfig(heads=heads, kv_heads=kv_heads, head_dim=128, dtype="bfloat16",
                                        device=device.type, backend=name, repeats=repeats, warmup=1)
                try:  # one layout at a time: the packed reference's masked SDPA call is the one to run out
                    new = bench.measure_group(cp, spr, [layout], cfg)
                except torch.cuda.OutOfMemoryError as e:
                    skipped.append({"backend": name, "layout": layout, "cp": cp, "seq_per_rank": spr,
                                    "error": str(e)[:200]})
                    torch.cuda.empty_cache()
                    continue
                rows += new
                for r in new:
                    print(f"  {name:16} {r['layout']:8} cp={cp} seq/rank={spr:6} {r['pass']:17} "
                          f"eff={r['efficiency']:.3f} full={r['t_full_s'] * 1e3:8.2f}ms "
                          f"slowest rank={r['t_slowest_rank_s'] * 1e3:8.2f}ms", flush=True)
    if skipped:
        print(f"efficiency: time budget or memory: skipped {skipped}", flush=True)
    return {"rows": rows, "skipped": skipped}


def patterns(device: torch.device, names: list[str], budget_s: float, cps: list[int], lengths: list[int],
             heads: int, kv_heads: int, repeats: int = 3) -> dict:
    """Every context-parallel pattern's virtual efficiency and bytes sent per rank (bf16,
    zigzag) on the first backend of ``names`` (the fastest by auto's order), within ``budget_s``."""
    if not names:
        return {"rows": [], "skipped": "no backend runs here"}
    rows, skipped = [], []
    start = time.perf_counter()
    name = names[0]
    for cp in cps:
        for spr in lengths:
            if time.perf_counter() - start > budget_s:
                skipped.append({"backend": name, "cp": cp, "seq_per_rank": spr})
                continue
            cfg = bench.BenchConfig(heads=heads, kv_heads=kv_heads, head_dim=128, dtype="bfloat16",
                                    device=device.type, backend=name, repeats=repeats, warmup=1)
            new = gpu_patterns.measure_patterns(cp, spr, cfg)
            rows += new
            for r in new:
                print(f"  {name:16} {gpu_patterns.describe_pattern(r)}", flush=True)
    if skipped:
        print(f"patterns: time budget: skipped {skipped}", flush=True)
    return {"rows": rows, "skipped": skipped}


def overlap(device: torch.device, names: list[str], lengths: list[int], heads: int, kv_heads: int,
            repeats: int = 20) -> dict:
    """Per tokens-per-rank: K/V block transfer time against one zigzag ring step's compute."""
    dtype, d = torch.bfloat16, 128
    peer = torch.device("cuda", 1) if device.type == "cuda" and torch.cuda.device_count() > 1 else None
    rows = []
    for name in names:
        kernel = get_backend(name, device, dtype)
        for spr in lengths:
            # The message of one step: K and V of one shard; the backward also sends the
            # float32 dK/dV accumulator of the same shape (3x the bytes).
            kv = torch.randn(2, 1, spr, kv_heads, d, device=device, dtype=dtype)
            dst = torch.empty_like(kv)
            q = torch.randn(1, spr, heads, d, device=device, dtype=dtype)
            dout = torch.randn_like(q)
            blk = step_blocks("zigzag", True, spr, 1, 0)[0]  # not the diagonal: all queries, half the keys
            ks, scale = slice(blk.k_start, blk.k_end), 1 / math.sqrt(d)
            out, lse = kernel.forward(q, kv[0][:, ks], kv[1][:, ks], False, scale)
            timed = lambda fn: kernels.device_time(device, fn, repeats)  # noqa: E731
            row = {"backend": name, "seq_per_rank": spr, "kv_block_bytes": kv.numel() * kv.element_size(),
                   "t_copy_d2d_s": timed(lambda: dst.copy_(kv)),
                   "t_step_fwd_s": timed(lambda: kernel.forward(q, kv[0][:, ks], kv[1][:, ks], False, scale)),
                   "t_step_bwd_s": timed(lambda: kernel.backward(dout, q, kv[0][:, ks], kv[1][:, ks], out, lse,
                                                                 False, scale)),
                   "step_block": f"{spr}x{blk.k_end - blk.k_start}"}
            if peer is not None:
                remote = torch.empty_like(kv, device=peer)
                row["t_copy_p2p_s"] = timed(lambda: remote.copy_(kv))
            for key in ("t_copy_d2d_s", "t_copy_p2p_s"):
                if key in row:
                    row[key.replace("t_copy", "fwd_hidden")] = row[key] < row["t_step_fwd_s"]
                    row[key.replace("t_copy", "bwd_hidden")] = 3 * row[key] < row["t_step_bwd_s"]
            # Link bandwidth at which a step's transfer just matches its compute.
            row["break_even_GBps_fwd"] = row["kv_block_bytes"] / row["t_step_fwd_s"] / 1e9
            row["break_even_GBps_bwd"] = 3 * row["kv_block_bytes"] / row["t_step_bwd_s"] / 1e9
            rows.append(row)
            print(f"  {name:16} seq/rank={spr:6} KV {row['kv_block_bytes'] / 2**20:7.1f} MiB  d2d copy "
                  f"{row['t_copy_d2d_s'] * 1e6:8.1f}us  step fwd {row['t_step_fwd_s'] * 1e6:9.1f}us  bwd "
                  f"{row['t_step_bwd_s'] * 1e6:9.1f}us  break-even {row['break_even_GBps_fwd']:.0f} GB/s", flush=True)
    return {"rows": rows}


def verdicts(names: list[str], why: dict[str, str], checks: list[dict]) -> dict[str, str]:
    """One line per CUDA backend: PASS (every check it ran passed), FAIL, or SKIP (why)."""
    lines = {}
    for name in CUDA_BACKENDS:
        mine = [r for r in checks if r["backend"] == name]
        if name in why:
            lines[name] = f"SKIP {name}: {why[name]}"
        elif not mine:
            lines[name] = f"FAIL {name}: no check ran within the time budget"
        else:
            bad = [r for r in mine if not r["pass"]]
            lines[name] = (f"{'FAIL' if bad else 'PASS'} {name}: {len(mine) - len(bad)}/{len(mine)} checks passed"
                           + (f"; first failure: {bad[0]}" if bad else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where to write the JSON report")
    p.add_argument("--correctness-budget-s", type=float, default=180.0)
    p.add_argument("--throughput-budget-s", type=float, default=60.0)
    p.add_argument("--efficiency-budget-s", type=float, default=120.0)
    p.add_argument("--patterns-budget-s", type=float, default=60.0)
    p.add_argument("--cp", type=int, nargs="+", default=[4, 8])
    p.add_argument("--seq-per-rank", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--skip", nargs="*", default=[], choices=["correctness", "throughput", "efficiency", "patterns", "overlap"])
    p.add_argument("--dry-run-cpu", action="store_true",
                   help="run it all on the CPU at tiny sizes, the CUDA kernels replaced by tests/cuda_standins.py")
    a = p.parse_args(argv)
    sizes = dict(block_len=200, ring_len=200, throughput_seq=8192, cp=a.cp, spr=a.seq_per_rank, repeats=5,
                 all_dtypes=True, block_cases=kernels.BLOCK_CASES)
    if a.dry_run_cpu:
        sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests"))
        import cuda_standins  # noqa: E402  (tests/ is only needed for the dry run)

        cuda_standins.install(setattr, keep_dtypes=True)
        device = torch.device("cpu")
        torch.set_num_threads(1)
        # Every backend through every section, at the least work: one dtype each, the core
        # causal case and one with q_len != k_len, one timed repeat.
        sizes = dict(block_len=40, ring_len=24, throughput_seq=64, cp=[2], spr=[32], repeats=1, all_dtypes=False,
                     block_cases=[kernels.BLOCK_CASES[0], kernels.BLOCK_CASES[-1]])
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check (--dry-run-cpu exercises the script on CPU)",
              file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    cuda = device.type == "cuda"
    dtypes, why = runnable(device)
    if not sizes["all_dtypes"]:
        dtypes = {n: ds[:1] for n, ds in dtypes.items()}
    names = list(dtypes)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run, stand-ins)",
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "torch": torch.__version__, "cuda": torch.version.cuda, "packages": _versions(),
        "backends": {n: [str(d) for d in ds] for n, ds in dtypes.items()}, "not_runnable": why,
        "auto_order": available_backends(device, torch.bfloat16),
    }
    print(json.dumps({k: report[k] for k in ("device", "capability", "torch", "cuda", "packages")}), flush=True)
    print(f"backends under test: {names}; not runnable here: {why}", flush=True)
    sections = {
        "correctness": lambda: kernels.correctness(
            kernels.correctness_cases(device, names, dtypes, sizes["block_len"], sizes["ring_len"],
                                      sizes["block_cases"]),
            a.correctness_budget_s),
        "throughput": lambda: kernels.throughput(device, [n for n in names if torch.bfloat16 in dtypes[n]],
                                                 sizes["throughput_seq"], 32, 8, a.throughput_budget_s,
                                                 sizes["repeats"]),
        "efficiency": lambda: efficiency(device, names, a.efficiency_budget_s, sizes["cp"], sizes["spr"], a.heads,
                                         a.kv_heads, min(3, sizes["repeats"])),
        "patterns": lambda: patterns(device, names, a.patterns_budget_s, sizes["cp"], sizes["spr"], a.heads,
                                     a.kv_heads, min(3, sizes["repeats"])),
        "overlap": lambda: overlap(device, names, sizes["spr"], a.heads, a.kv_heads, 4 * sizes["repeats"]),
    }
    for section, fn in sections.items():
        if section not in a.skip:
            print(f"== {section}", flush=True)
            guarded(report, section, fn)
            with open(a.out, "w") as f:  # written after each section, so a later crash keeps the rest
                json.dump(report, f, indent=1, default=str)
    measured = report.get("throughput", {}).get("measured_order")
    if measured is not None:
        auto = [n for n in report["auto_order"] if n in measured]
        print(f"block speed, fastest first (measured): {measured}", flush=True)
        print(f"backend='auto' order here:             {auto} ({'agrees' if auto == measured else 'DIFFERS'})",
              flush=True)
    checks = report.get("correctness", {}).get("checks", [])
    report["verdicts"] = verdicts(names, why, checks)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    for line in report["verdicts"].values():
        print(line, flush=True)
    failed = any(v.startswith("FAIL") for v in report["verdicts"].values()) or "error" in report.get("correctness", {})
    print(f"gpu_check: {'FAIL' if failed else 'PASS'}; report in {a.out}", flush=True)
    return 1 if failed else 0


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for pkg in ("flash_attn", "flash_attn_3", "flash-attn-4", "nvidia-cutlass-dsl", "hf_ring"):
        try:
            found[pkg] = version(pkg)
        except PackageNotFoundError:
            found[pkg] = None
    return found


if __name__ == "__main__":
    sys.exit(main())
