"""Where a ring rank's time goes, part by part, against the full-sequence reference.

ring_efficiency.py says how much of a single device's attention speed the ring keeps;
this says where the rest goes. It runs one virtual-ring rank (the ring itself, transfers
replaced by in-process copies; see ring_efficiency.py) forward and backward under
``torch.profiler`` and sorts the self time of every op into parts:

- kernel: the block attention calls (forward and backward);
- merge: folding a block's (out, lse) into the accumulators (exp, logaddexp, mul, addcmul);
- accumulate: adding block gradients into dq and the travelling dK/dV (add);
- copies: K/V stacking, transfers (in-process copies here), results put in place, casts;
- allocation: new and zeroed buffers;
- other ops; and, as the remainder of the wall time, Python and autograd bookkeeping.

The reference's kernel time divided by ``cp`` is the ideal per-rank time; the kernel
row's excess over it is what smaller blocks cost the kernel itself.

    python benchmarks/ring_breakdown.py --cp 4 --layout zigzag           # defaults as ring_efficiency
    python benchmarks/ring_breakdown.py --threads 1 --cp 4 --layout packed
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import defaultdict
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile

import ring_efficiency as bench

PARTS = {
    "kernel": ("flash_attention", "efficient_attention", "flash_attn", "varlen"),
    "merge": ("exp", "logaddexp", "mul_", "addcmul", "where", "isneginf", "sub", "neg"),
    "accumulate": ("add_", "add"),
    "copies": ("copy_", "cat", "stack", "clone", "contiguous", "to", "index"),
    "allocation": ("empty", "zeros", "fill_", "zero_", "full"),
}


def part_of(op: str) -> str:
    name = op.removeprefix("aten::")
    for part, keys in PARTS.items():
        if any(name == k or (len(k) > 4 and k in name) for k in keys):
            return part
    return "other ops"


def profiled(fn: Callable[[], None], repeats: int) -> dict[str, float]:
    """Median seconds per part over ``repeats`` profiled runs of ``fn`` (after one warm-up)."""
    fn()
    runs = []
    for _ in range(repeats):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            fn()
            wall = time.perf_counter() - start
        parts: dict[str, float] = defaultdict(float)
        for ev in prof.key_averages():
            if ev.key.startswith("aten::"):
                parts[part_of(ev.key)] += ev.self_cpu_time_total / 1e6
        parts["python and autograd"] = max(0.0, wall - sum(parts.values()))
        parts["wall"] = wall
        runs.append(parts)
    keys = {k for r in runs for k in r}
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}


def breakdown(layout: str, cp: int, seq_per_rank: int, cfg: bench.BenchConfig, rank: Optional[int] = None) -> dict:
    kernel = cfg.kernel()
    scale = 1 / math.sqrt(cfg.head_dim)
    pb = bench.make_problem(layout, cp, seq_per_rank, cfg)
    refs = bench.full_units(pb, kernel, scale)
    ref_times = {u.name: profiled(lambda u=u: u.bwd(u.fwd()), cfg.repeats) for u in refs}
    ref_name = min(ref_times, key=lambda n: ref_times[n]["wall"])
    ranks = [rank] if rank is not None else range(cp)
    per_rank = {r: profiled(lambda r=r: bench.rank_backward(pb, r, bench.rank_forward(pb, r, kernel, scale)),
                            cfg.repeats) for r in ranks}
    slowest = max(per_rank, key=lambda r: per_rank[r]["wall"])
    return {"layout": layout, "cp": cp, "seq_per_rank": seq_per_rank, "threads": torch.get_num_threads(),
            "reference": ref_name, "reference_parts": ref_times[ref_name], "rank": slowest,
            "rank_parts": per_rank[slowest]}


def print_breakdown(res: dict) -> None:
    ref, rk, cp = res["reference_parts"], res["rank_parts"], res["cp"]
    ideal = ref["wall"] / cp
    print(f"# {res['layout']} cp={cp}, {res['seq_per_rank']} tokens per rank, {res['threads']} threads; "
          f"reference: {res['reference']}; slowest rank {res['rank']}")
    print(f"{'part':22} {'rank s':>9} {'ref/cp s':>9} {'share of rank':>13}")
    order = ["kernel", "merge", "accumulate", "copies", "allocation", "other ops", "python and autograd"]
    for part in order:
        print(f"{part:22} {rk.get(part, 0.0):9.4f} {ref.get(part, 0.0) / cp:9.4f} "
              f"{100 * rk.get(part, 0.0) / rk['wall']:12.1f}%")
    print(f"{'wall':22} {rk['wall']:9.4f} {ideal:9.4f}   efficiency {ideal / rk['wall']:.3f}, "
          f"kernel-only {ideal / rk.get('kernel', float('nan')):.3f}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--layout", default="zigzag", choices=bench.LAYOUTS)
    p.add_argument("--seq-per-rank", type=int, default=2048)
    p.add_argument("--threads", type=int, default=min(2, torch.get_num_threads()))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=sorted(bench.DTYPES))
    p.add_argument("--rank", type=int, default=None, help="profile this rank only (default: all, show the slowest)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = bench.BenchConfig(dtype=a.dtype, repeats=a.repeats)
    print_breakdown(breakdown(a.layout, a.cp, a.seq_per_rank, cfg, a.rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
