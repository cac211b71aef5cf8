"""Peak memory per process of a training step at growing sequence lengths, for cp_size 1,
2 and 4, and the longest sequence that fits a per-process memory budget.

Every (cp_size, seq_len) point runs in fresh processes (step_world.py). Per-process peak
memory is close to affine in the tokens a process holds, ``a + b * seq_len / cp_size``,
so the longest sequence under a budget is read off a least-squares line through each
cp_size's measured points (the points are printed, so the fit can be checked).

Prints a table, writes JSON and a PNG plot:

    python benchmarks/memory_scaling.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plotting import new_axes, save  # noqa: E402
from step_world import StepConfig, run_step  # noqa: E402


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--tokens-per-rank", type=int, nargs="+", default=[2048, 4096, 8192],
                    help="sequence lengths are these times cp_size")
    ap.add_argument("--budget-mb", type=float, default=None,
                    help="per-process budget; default: the cp_size=1 peak at the largest point")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="tiny sweep (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens_per_rank = [256, 512]
    from tqdm import tqdm

    points = []
    cores = os.cpu_count() or 1
    for cp in tqdm(args.cp_sizes, desc="memory sweep (one world per cp_size)", unit="world"):
        seqs = tuple(t * cp for t in args.tokens_per_rank)
        cfg = StepConfig(cp_size=cp, seq_lens=seqs, steps=1, warmup=0, device=args.device,
                         threads_per_process=max(1, cores // cp))
        for p in run_step(cfg):
            points.append({k: p[k] for k in ("cp_size", "seq_len", "peak_mb_per_process", "runtime_baseline_mb")})
            tqdm.write(f"cp={cp} seq={p['seq_len']}: peak {p['peak_mb_per_process']:.0f} MB per process")

    budget = args.budget_mb or max(
        p["peak_mb_per_process"] for p in points if p["cp_size"] == min(args.cp_sizes)
    )
    longest = {}
    for cp in args.cp_sizes:
        mine = [p for p in points if p["cp_size"] == cp]
        a, b = _fit([p["seq_len"] for p in mine], [p["peak_mb_per_process"] for p in mine])
        longest[cp] = {"intercept_mb": a, "mb_per_token": b, "longest_seq": (budget - a) / b}
    base = longest[min(args.cp_sizes)]["longest_seq"]
    print(f"\nper-process budget: {budget:.0f} MB")
    print(f"{'cp':>3} {'MB/token':>9} {'fixed MB':>9} {'longest seq':>12} {'x cp=1':>7} {'target':>7}")
    for cp, d in longest.items():
        d["growth"] = d["longest_seq"] / base
        d["target_growth"] = 0.9 * cp
        print(f"{cp:>3} {d['mb_per_token']:>9.4f} {d['intercept_mb']:>9.0f} {d['longest_seq']:>12.0f} "
              f"{d['growth']:>7.2f} {d['target_growth']:>7.2f}")
    result = {"device": args.device, "budget_mb": budget, "points": points,
              "longest": {str(k): v for k, v in longest.items()}, "model": {k: v for k, v in StepConfig(1, (2,)).__dict__.items() if k not in ("cp_size", "seq_lens")}}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory_scaling.json"), "w") as f:
        json.dump(result, f, indent=2)
    _plot(points, longest, budget, os.path.join(args.out, "memory_scaling.png"))
    return result


def _plot(points, longest, budget, path) -> None:
    fig, ax = new_axes()
    for cp, d in longest.items():
        mine = [p for p in points if p["cp_size"] == cp]
        xs = [p["seq_len"] for p in mine]
        ax.plot(xs, [p["peak_mb_per_process"] for p in mine], "o-", label=f"cp_size={cp}")
    ax.axhline(budget, color="grey", ls="--", lw=1, label=f"budget {budget:.0f} MB")
    save(fig, ax, path, "Training-step memory vs sequence length", "sequence length (tokens)", "peak memory per process (MB)")


if __name__ == "__main__":
    main()
