"""Packed rows of many documents of one length: the ring with runs of equal blocks batched
into one kernel call per step (hf_ring/patterns/ring/block_runs.py) against one call per
document, the same virtual ring otherwise (ring_efficiency.py's), timed interleaved in
one process so that load from other work hits both alike.

Prints, per number of documents, the slowest rank's forward+backward seconds both ways
and their ratio (one call per document / batched: above 1, batching is faster), and
checks that both give the same out, lse and dq.

    python benchmarks/packed_runs.py                          # 4, 16, 64 documents, cp 4, 2048 tokens per rank
    python benchmarks/packed_runs.py --threads 1 --clock process
    python benchmarks/packed_runs.py --tiny                   # smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import replace
from typing import Optional

import torch

import ring_efficiency as bench
from gpu_check_kernels import rel_err


def measure(docs: int, cp: int, seq_per_rank: int, cfg: bench.BenchConfig) -> dict:
    """One row: the slowest rank's median forward+backward seconds, batched and per document."""
    pb = bench.make_problem("packed", cp, seq_per_rank, replace(cfg, docs=docs))
    scale = 1 / math.sqrt(cfg.head_dim)
    kernels = {"batched": cfg.kernel(), "per_document": replace(cfg.kernel(), batched_views=False)}
    got = {name: bench.virtual_ring(pb, k, scale) for name, k in kernels.items()}
    worst = max(rel_err(got["batched"][n], got["per_document"][n]) for n in got["batched"])
    if worst > 1e-5:
        raise AssertionError(f"batched runs and per-document calls differ by {worst:.2e} (relative)")
    units = {name: [bench.rank_unit(pb, r, k, scale, cfg) for r in range(cp)] for name, k in kernels.items()}
    bench.run_interleaved([u for us in units.values() for u in us], cfg)
    slowest = {name: max(statistics.median(u.fb_s) for u in us) for name, us in units.items()}
    return {"docs": docs, "doc_len": pb.doc_lens[0], "cp": cp, "seq_per_rank": seq_per_rank,
            "t_batched_s": slowest["batched"], "t_per_document_s": slowest["per_document"],
            "ratio": slowest["per_document"] / slowest["batched"], "max_rel_diff": worst,
            "backend": kernels["batched"].name, "clock": cfg.clock, "repeats": cfg.repeats}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--seq-per-rank", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", default="wall", choices=sorted(bench.CLOCKS))
    p.add_argument("--tiny", action="store_true", help="smoke test: 4 and 8 documents, cp 2, 64 tokens per rank")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    a = p.parse_args(argv)
    if a.tiny:
        a.docs, a.cp, a.seq_per_rank, a.repeats = [4, 8], 2, 64, 1
    if a.clock == "process" and a.threads != 1:
        p.error("--clock process measures one thread: pass --threads 1")
    torch.set_num_threads(a.threads)
    cfg = bench.BenchConfig(heads=2 if a.tiny else 8, kv_heads=1 if a.tiny else 2, head_dim=16 if a.tiny else 128,
                            repeats=a.repeats, clock=a.clock)
    if not a.json:
        print(f"# {cfg.kernel().name}, float32, heads {cfg.heads}/{cfg.kv_heads}, head_dim {cfg.head_dim}, "
              f"cp {a.cp}, {a.seq_per_rank} tokens per rank, median of {a.repeats}, {a.threads} threads, "
              f"{a.clock} clock")
        print(f"{'docs':>5} {'tokens':>7} {'batched s':>10} {'per-doc s':>10} {'ratio':>6}")
    for docs in a.docs:
        row = measure(docs, a.cp, a.seq_per_rank, cfg)
        if a.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"{docs:>5} {row['doc_len']:>7} {row['t_batched_s']:>10.4f} {row['t_per_document_s']:>10.4f} "
                  f"{row['ratio']:>6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
