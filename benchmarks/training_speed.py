"""Training throughput per process at cp_size 1, 2 and 4 for one total sequence length,
and the share of a step spent blocked on ring transfers.

tokens/s per process = seq_len / step_time / cp_size: with one device per process and
perfect scaling it stays flat as cp_size grows (each process handles 1/cp_size of the
tokens in 1/cp_size of the time). On a CPU machine every cp_size shares the same cores, so
the per-process figure must fall as 1/cp_size even with perfect scaling; there tokens/s
per core (seq_len / step_time / cores used) is the figure that stays flat.
The communication share is the time a rank spends in ``RingExchange.wait`` (transfers the
compute did not hide) over its step time, for the slowest rank.

On CPU, each process gets ``max(1, cores // cp_size)`` threads, so all runs use the same
cores; when cp_size exceeds the cores, processes share them and the figures say so.

    python benchmarks/training_speed.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plotting import new_axes, save  # noqa: E402
from step_world import StepConfig, run_step  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seq_len, args.steps = 512, 1
    from tqdm import tqdm

    cores = os.cpu_count() or 1
    rows = []
    for cp in tqdm(args.cp_sizes, desc="speed sweep", unit="run"):
        threads = max(1, cores // cp) if args.device == "cpu" else 1
        cfg = StepConfig(cp_size=cp, seq_lens=(args.seq_len,), steps=args.steps, warmup=1,
                         threads_per_process=threads, device=args.device)
        res = run_step(cfg)[0]
        step = res["step_seconds"]
        rows.append({
            "cp_size": cp, "seq_len": args.seq_len, "threads_per_process": threads,
            "processes_over_cores": cp > cores and args.device == "cpu",
            "step_seconds": step,
            "tokens_per_second_per_process": args.seq_len / step / cp,
            "tokens_per_second_per_core": (
                args.seq_len / step / min(cores, cp * threads) if args.device == "cpu" else None
            ),
            "comm_wait_share": res["comm_wait_seconds"] / step,
        })
        tqdm.write(f"cp={cp}: step {step:.2f}s")
    base = rows[0]["tokens_per_second_per_process"]
    print(f"\nseq_len {args.seq_len}, {cores} CPU cores" if args.device == "cpu" else f"\nseq_len {args.seq_len}")
    cpu = args.device == "cpu"
    print(f"{'cp':>3} {'threads':>7} {'step s':>8} {'tok/s/proc':>11} {'vs cp=1':>8}"
          + (f" {'tok/s/core':>11} {'vs cp=1':>8}" if cpu else "") + f" {'comm wait':>10}")
    for r in rows:
        r["relative_to_cp1"] = r["tokens_per_second_per_process"] / base
        per_core = ""
        if cpu:
            r["per_core_relative_to_cp1"] = r["tokens_per_second_per_core"] / rows[0]["tokens_per_second_per_core"]
            per_core = f" {r['tokens_per_second_per_core']:>11.0f} {r['per_core_relative_to_cp1']:>8.2f}"
        note = "  (processes share cores)" if r["processes_over_cores"] else ""
        print(f"{r['cp_size']:>3} {r['threads_per_process']:>7} {r['step_seconds']:>8.2f} "
              f"{r['tokens_per_second_per_process']:>11.0f} {r['relative_to_cp1']:>8.2f}{per_core} "
              f"{100 * r['comm_wait_share']:>9.1f}%{note}")
    result = {"device": args.device, "cores": cores, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "training_speed.json"), "w") as f:
        json.dump(result, f, indent=2)
    _plot(rows, os.path.join(args.out, "training_speed.png"))
    return result


def _plot(rows, path) -> None:
    fig, ax = new_axes()
    cps = [str(r["cp_size"]) for r in rows]
    compute = [r["step_seconds"] * (1 - r["comm_wait_share"]) for r in rows]
    wait = [r["step_seconds"] * r["comm_wait_share"] for r in rows]
    ax.bar(cps, compute, label="compute")
    ax.bar(cps, wait, bottom=compute, label="waiting on ring transfers")
    for i, r in enumerate(rows):
        label = f"{r['tokens_per_second_per_process']:.0f} tok/s/proc"
        if r.get("tokens_per_second_per_core"):
            label += f"\n{r['tokens_per_second_per_core']:.0f} tok/s/core"
        ax.text(i, r["step_seconds"], label, ha="center", va="bottom", fontsize=8)
    save(fig, ax, path, f"Training step at {rows[0]['seq_len']} tokens", "cp_size", "step time (s), slowest process")


if __name__ == "__main__":
    main()
