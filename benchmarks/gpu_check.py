"""One-shot GPU check of every CUDA block backend and of the ring on them: within 8 minutes
on one H200 by construction (``--quick``: 4).

One total time budget (``--budget``, default 420 s, ``--quick`` 180 s, counted from the
script's start, imports and first-use compiles included) is split over the sections and
enforced inside them (gpu_check_budget.py: a section stops starting items when its share
is spent and a timer interrupts the item then running; a kill switch ends the process 40 s
after the total even if it is stuck in one C call). Each section is guarded, so a failure
or a slow compile in one still lets the others run:

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
6. placement (gpu_placement.py): issue 50's side by side, ``sharded`` / ``by_length`` /
   ``auto`` on placement.py's four mixes, virtual ranks at cp 8 on rows of 32768 tokens
   (``--quick``: 16384), Llama-3-8B's attention shape (32 / 8 heads of 128), bf16.
7. compile (gpu_compile.py): a ring_flash Llama's training step on a packed row of 8192
   tokens (the ring's varlen path without a group), eager against each decoder layer
   compiled with inductor, and the compiled step's loss and gradients against eager's.

As soon as correctness ends, prints one ``PASS`` / ``FAIL`` / ``SKIP`` (not runnable here,
and why) line per backend and writes them to the JSON report (--out, rewritten after each
section); prints them again at the end. Exit status 1 if any backend failed.

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

_START = time.monotonic()  # the budget counts from here: importing torch and hf_ring is part of the run
import torch  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
# The sibling scripts, and hf_ring itself from this checkout: a GPU machine may have only
# torch installed, not this package.
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]
import gpu_check_budget as budgets  # noqa: E402
import gpu_check_kernels as kernels  # noqa: E402
import gpu_compile  # noqa: E402
import gpu_patterns  # noqa: E402
import gpu_placement  # noqa: E402
import ring_efficiency as bench  # noqa: E402

from hf_ring.kernels import available_backends, get_backend, registry  # noqa: E402
from hf_ring.patterns.ring.schedule import step_blocks  # noqa: E402

CUDA_BACKENDS = ("flash_attn_3", "flash_attn_4", "torch_cudnn", "flash_attn", "torch_flash", "torch_efficient")
CHECK_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def guarded(report: dict, section: str, deadline: budgets.Deadline, fn: Callable[[dict], None]) -> None:
    """Run one section into ``report[section]`` within ``deadline``; record its error, or
    that the budget interrupted it, without stopping the script (what it measured stays)."""
    start = time.perf_counter()
    result: dict[str, Any] = {}
    report[section] = result
    try:
        with deadline.hard():
            fn(result)
    except budgets.BudgetSpent as e:
        result["interrupted"] = str(e)
        print(f"{section}: {e}; kept what it measured", flush=True)
    except Exception as e:  # a broken section must not hide the others' results
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
    result["seconds"] = time.perf_counter() - start
    print(f"[{section}: {result['seconds']:.1f}s]", flush=True)


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


def efficiency(device: torch.device, names: list[str], deadline: budgets.Deadline, cps: list[int],
               lengths: list[int], heads: int, kv_heads: int, result: dict, repeats: int = 3) -> None:
    """ring_efficiency.measure_group per backend and layout into ``result["rows"]``, lengths
    outer, backends inner, until ``deadline``; what it did not measure in ``result["skipped"]``."""
    rows, skipped = result.setdefault("rows", []), result.setdefault("skipped", [])
    for cp in cps:
        for spr in lengths:
            for name, layout in ((n, lay) for n in names for lay in ("zigzag", "packed")):
                if deadline.spent():
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
                rows.extend(new)
                for r in new:
                    print(f"  {name:16} {r['layout']:8} cp={cp} seq/rank={spr:6} {r['pass']:17} "
                          f"eff={r['efficiency']:.3f} full={r['t_full_s'] * 1e3:8.2f}ms "
                          f"slowest rank={r['t_slowest_rank_s'] * 1e3:8.2f}ms", flush=True)
    if skipped:
        print(f"efficiency: time budget or memory: skipped {skipped}", flush=True)


def patterns(device: torch.device, names: list[str], deadline: budgets.Deadline, cps: list[int],
             lengths: list[int], heads: int, kv_heads: int, result: dict, repeats: int = 3) -> None:
    """Every context-parallel pattern's virtual efficiency and bytes sent per rank (bf16,
    zigzag) on the first backend of ``names`` (the fastest by auto's order), into
    ``result["rows"]`` until ``deadline``."""
    rows, skipped = result.setdefault("rows", []), result.setdefault("skipped", [])
    if not names:
        result["skipped"] = "no backend runs here"
        return
    name = names[0]
    for cp in cps:
        for spr in lengths:
            if deadline.spent():
                skipped.append({"backend": name, "cp": cp, "seq_per_rank": spr})
                continue
            cfg = bench.BenchConfig(heads=heads, kv_heads=kv_heads, head_dim=128, dtype="bfloat16",
                                    device=device.type, backend=name, repeats=repeats, warmup=1)
            new = gpu_patterns.measure_patterns(cp, spr, cfg)
            rows.extend(new)
            for r in new:
                print(f"  {name:16} {gpu_patterns.describe_pattern(r)}", flush=True)
    if skipped:
        print(f"patterns: time budget: skipped {skipped}", flush=True)


def overlap(device: torch.device, names: list[str], lengths: list[int], heads: int, kv_heads: int,
            deadline: budgets.Deadline, result: dict, repeats: int = 20) -> None:
    """Per tokens-per-rank: K/V block transfer time against one zigzag ring step's compute,
    into ``result["rows"]`` until ``deadline`` (lengths outer, backends inner)."""
    dtype, d = torch.bfloat16, 128
    peer = torch.device("cuda", 1) if device.type == "cuda" and torch.cuda.device_count() > 1 else None
    rows, skipped = result.setdefault("rows", []), result.setdefault("skipped", [])
    for spr in lengths:
        for name in names:
            if deadline.spent():
                skipped.append({"backend": name, "seq_per_rank": spr})
                continue
            kernel = get_backend(name, device, dtype)
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
    if skipped:
        print(f"overlap: time budget: skipped {skipped}", flush=True)


def verdicts(names: list[str], why: dict[str, str], checks: list[dict],
             skipped: dict[str, int] | None = None) -> dict[str, str]:
    """One line per CUDA backend: PASS (every check it ran passed), FAIL, or SKIP (why);
    ``skipped``: cases per backend the time budget left unrun, said on its line."""
    lines = {}
    for name in CUDA_BACKENDS:
        mine = [r for r in checks if r["backend"] == name]
        left = (skipped or {}).get(name, 0)
        if name in why:
            lines[name] = f"SKIP {name}: {why[name]}"
        elif not mine:
            lines[name] = f"FAIL {name}: no check ran within the time budget"
        else:
            bad = [r for r in mine if not r["pass"]]
            lines[name] = (f"{'FAIL' if bad else 'PASS'} {name}: {len(mine) - len(bad)}/{len(mine)} checks passed"
                           + (f" ({left} not run: time budget)" if left else "")
                           + (f"; first failure: {bad[0]}" if bad else ""))
    return lines


def _write(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


def _print_verdicts(report: dict) -> None:
    for line in report["verdicts"].values():
        print(line, flush=True)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where to write the JSON report")
    p.add_argument("--budget", type=float, default=None,
                   help=f"total seconds from the start, imports included (default {budgets.FULL_BUDGET_S:.0f}; "
                        f"--quick {budgets.QUICK_BUDGET_S:.0f}); split over the sections by "
                        f"{budgets.WEIGHTS}, unused time passing to the later ones")
    p.add_argument("--quick", action="store_true",
                   help="within 4 minutes: first dtype only, three block cases, cp 4, 4k and 8k tokens per rank")
    p.add_argument("--cp", type=int, nargs="+", default=None, help="default 4 8 (--quick: 4)")
    p.add_argument("--seq-per-rank", type=int, nargs="+", default=None,
                   help="default 4096 8192 16384 32768 (--quick: 4096 8192)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--skip", nargs="*", default=[], choices=list(budgets.WEIGHTS))
    p.add_argument("--dry-run-cpu", action="store_true",
                   help="run it all on the CPU at tiny sizes, the CUDA kernels replaced by tests/cuda_standins.py")
    a = p.parse_args(argv)
    if a.budget is None:
        a.budget = budgets.QUICK_BUDGET_S if a.quick else budgets.FULL_BUDGET_S
    a.cp = a.cp or ([4] if a.quick else [4, 8])
    a.seq_per_rank = a.seq_per_rank or ([4096, 8192] if a.quick else [4096, 8192, 16384, 32768])
    return a


def plan(argv: list[str] | None = None) -> dict[str, Any]:
    """The run's planned budget: the total, each section's share (were each to use all of
    it) and when the kill switch ends the process, in seconds from the start."""
    a = _arguments(["--out", "-", *(argv or [])])  # nothing is written
    budget = budgets.Budget(a.budget, 0.0, clock=lambda: 0.0)
    return {"total_s": a.budget, "sections_s": budget.plan(), "hard_limit_s": budget.hard_limit_s}


def main(argv: list[str] | None = None) -> int:
    a = _arguments(argv)
    budget = budgets.Budget(a.budget, _START)
    budgets.kill_switch(budget)
    try:
        return _run(a, budget)
    finally:
        budgets.disarm()


def _sizes(a: argparse.Namespace) -> dict[str, Any]:
    if a.dry_run_cpu:
        # Every backend through every section, at the least work: one dtype each, the core
        # causal case and one with q_len != k_len, one timed repeat.
        return dict(block_len=24, ring_len=24, throughput_seq=64, cp=[2], spr=[32], repeats=1, all_dtypes=False,
                    block_cases=[kernels.BLOCK_CASES[0], kernels.BLOCK_CASES[-1]],
                    placement=dict(cp=2, row=256, heads=a.heads, kv_heads=a.kv_heads))
    # --quick: each backend's first dtype and three block cases (MHA, GQA, head_dim 64).
    return dict(block_len=200, ring_len=200, throughput_seq=4096 if a.quick else 8192, cp=a.cp, spr=a.seq_per_rank,
                repeats=5, all_dtypes=not a.quick,
                block_cases=kernels.BLOCK_CASES[:3] if a.quick else kernels.BLOCK_CASES,
                placement=dict(cp=8, row=16384 if a.quick else 32768, heads=32, kv_heads=8))


def _run(a: argparse.Namespace, budget: budgets.Budget) -> int:
    sizes = _sizes(a)
    if a.dry_run_cpu:
        sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests"))
        import cuda_standins  # noqa: E402  (tests/ is only needed for the dry run)

        cuda_standins.install(setattr, keep_dtypes=True)
        device = torch.device("cpu")
        torch.set_num_threads(1)
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
    setup_s = time.monotonic() - budget.start
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run, stand-ins)",
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "torch": torch.__version__, "cuda": torch.version.cuda, "packages": _versions(),
        "backends": {n: [str(d) for d in ds] for n, ds in dtypes.items()}, "not_runnable": why,
        "auto_order": available_backends(device, torch.bfloat16),
        "budget": {"total_s": budget.total_s, "hard_limit_s": budget.hard_limit_s, "setup_s": setup_s,
                   "planned_sections_s": budget.plan(setup_s), "quick": a.quick},
    }
    print(json.dumps({k: report[k] for k in ("device", "capability", "torch", "cuda", "packages", "budget")}),
          flush=True)
    print(f"backends under test: {names}; not runnable here: {why}", flush=True)
    sections: dict[str, Callable[[budgets.Deadline, dict], None]] = {
        "correctness": lambda dl, res: kernels.correctness(
            kernels.correctness_cases(device, names, dtypes, sizes["block_len"], sizes["ring_len"],
                                      sizes["block_cases"]), dl, res),
        "throughput": lambda dl, res: kernels.throughput(
            device, [n for n in names if torch.bfloat16 in dtypes[n]], sizes["throughput_seq"], 32, 8, dl, res,
            sizes["repeats"]),
        "efficiency": lambda dl, res: efficiency(device, names, dl, sizes["cp"], sizes["spr"], a.heads, a.kv_heads,
                                                 res, min(3, sizes["repeats"])),
        "patterns": lambda dl, res: patterns(device, names, dl, sizes["cp"], sizes["spr"], a.heads, a.kv_heads, res,
                                             min(3, sizes["repeats"])),
        "overlap": lambda dl, res: overlap(device, names, sizes["spr"], a.heads, a.kv_heads, dl, res,
                                           4 * sizes["repeats"]),
        "placement": lambda dl, res: gpu_placement.placement(
            device, [n for n in report["auto_order"] if n in names] or names, dl, res,
            repeats=min(3, sizes["repeats"]), **sizes["placement"]),
        "compile": lambda dl, res: gpu_compile.compiled_step(device, a.dry_run_cpu, dl, res, sizes["repeats"]),
    }
    skip = tuple(a.skip)
    for section, fn in sections.items():
        if section in skip:
            continue
        print(f"== {section}", flush=True)
        deadline = budget.section(section, skip)
        guarded(report, section, deadline, lambda res: fn(deadline, res))
        if section == "correctness":  # the verdicts, as soon as they are known
            report["verdicts"] = verdicts(names, why, report[section].get("checks", []),
                                          report[section].get("skipped", {}))
            _print_verdicts(report)
        _write(report, a.out)  # after each section, so a later crash keeps the rest
    measured = report.get("throughput", {}).get("measured_order")
    if measured is not None:
        auto = [n for n in report["auto_order"] if n in measured]
        print(f"block speed, fastest first (measured): {measured}", flush=True)
        print(f"backend='auto' order here:             {auto} ({'agrees' if auto == measured else 'DIFFERS'})",
              flush=True)
    correctness = report.get("correctness", {})
    report.setdefault("verdicts", verdicts(names, why, correctness.get("checks", []), correctness.get("skipped")))
    report["seconds"] = time.monotonic() - budget.start
    _write(report, a.out)
    _print_verdicts(report)
    compiled = report.get("compile", {})  # a compiled step that differs from eager, or lost its ring op, fails
    failed = (any(v.startswith("FAIL") for v in report["verdicts"].values()) or "error" in correctness
              or compiled.get("pass") is False or "error" in compiled)
    print(f"gpu_check: {'FAIL' if failed else 'PASS'} in {report['seconds']:.0f}s (budget {budget.total_s:.0f}s); "
          f"report in {a.out}", flush=True)
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
