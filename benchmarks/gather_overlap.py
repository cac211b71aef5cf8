"""What overlapping the all-gather with the local blocks saves, over gloo, per rank.

The all-gather pattern starts its K/V gather and runs the blocks on the rank's own K/V
while it travels (a packed row's diagonals, ``hf_ring/patterns/ring/prefix.py``; a dense
row's ring step 0, ``hf_ring/patterns/allgather.py``). This benchmark runs the same
attention in ``cp`` spawned gloo processes two ways, interleaved in one run:

- ``overlapped``: the pattern as it is (``GroupCollectives``);
- ``serial``: the same collectives, but each all-gather waited for as soon as it is
  started (:class:`SerialGather`), so nothing runs while it travels.

Each round runs both ways, in turn, the first alternating from round to round.

Every rank checks that both ways give the same out and gradients, bit for bit. Per rank it
reports the median time of the forward and of forward+backward, and the time each rank
spent blocked in collectives (``CommWaitStats``: the all-gathers' waits and the
backward's reduce-scatter). Rows: the packed default mix (40/25/20/10/5 %) and 64
documents of one length (``--docs``), float32, 8/2 heads of 128, one thread per process.

Run ``python benchmarks/gather_overlap.py --help``; results in
``benchmarks/results/gather_overlap.jsonl`` (``--json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ring_efficiency import BenchConfig, make_problem  # noqa: E402

from hf_ring.distributed.collectives import Gathered, GroupCollectives  # noqa: E402
from hf_ring.distributed.comm import CommWaitStats  # noqa: E402
from hf_ring.patterns import AttentionPlan, run_plan  # noqa: E402

WAYS = ("overlapped", "serial")


class SerialGather:
    """``GroupCollectives`` whose all-gather is waited for as soon as it is started."""

    def __init__(self, inner: GroupCollectives) -> None:
        self.inner, self.rank, self.world = inner, inner.rank, inner.world

    def start_all_gather(self, x: torch.Tensor) -> Gathered:
        return Gathered(self.inner.all_gather(x))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.all_gather(x)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.reduce_scatter(x)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.all_to_all(x)


def _worker(rank: int, cp: int, seq_per_rank: int, cfg: BenchConfig, rdzv: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=cp)
    pb = make_problem("packed_allgather", cp, seq_per_rank, cfg)
    q, k, v = (t.clone().requires_grad_() for t in pb.shards[rank][:3])
    dout = pb.shards[rank][3]
    local = tuple(n // cp for n in pb.doc_lens)
    stats = {way: CommWaitStats() for way in WAYS}
    plans = {}
    for way in WAYS:
        coll = GroupCollectives(None, stats[way])
        plans[way] = AttentionPlan(None, rank, cp, "zigzag", True, 1 / math.sqrt(cfg.head_dim), cfg.kernel(),
                                   local_doc_lens=local, pattern="allgather",
                                   collectives=coll if way == "overlapped" else SerialGather(coll))
    times = {way: {"forward": [], "forward+backward": [], "blocked": []} for way in WAYS}
    for i in range(cfg.warmup + cfg.repeats):
        for way in WAYS if i % 2 == 0 else WAYS[::-1]:  # neither way always runs first
            dist.barrier()
            blocked0 = stats[way].seconds
            t0 = time.perf_counter()
            out, _ = run_plan(q, k, v, plans[way])
            t1 = time.perf_counter()
            out.backward(dout)
            t2 = time.perf_counter()
            q.grad = k.grad = v.grad = None
            if i >= cfg.warmup:
                times[way]["forward"].append(t1 - t0)
                times[way]["forward+backward"].append(t2 - t0)
                times[way]["blocked"].append(stats[way].seconds - blocked0)
    results = {}
    for way in WAYS:  # the two ways run the same calls: the same out and gradients, bit for bit
        out, _ = run_plan(q, k, v, plans[way])
        out.backward(dout)
        results[way] = (out.detach(), q.grad, k.grad, v.grad)
        q.grad = k.grad = v.grad = None
    if not all(torch.equal(a, b) for a, b in zip(*results.values())):
        raise AssertionError(f"rank {rank}: the overlapped and serial all-gather gave different results")
    torch.save(times, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def measure(cp: int, seq_per_rank: int, cfg: BenchConfig) -> list[dict]:
    """One row per way: each rank's median, the times the slowest rank's."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(cp, seq_per_rank, cfg, os.path.join(tmp, "rdzv"), tmp), nprocs=cp, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(cp)]
    doc_lens = make_problem("packed_allgather", cp, seq_per_rank, cfg).doc_lens
    rows = []
    for way in WAYS:
        med = {what: [statistics.median(r[way][what]) for r in ranks] for what in ranks[0][way]}
        rows.append({"way": way, "cp": cp, "seq_per_rank": seq_per_rank, "docs": len(doc_lens),
                     "doc_lens": doc_lens if len(doc_lens) <= 8 else f"{len(doc_lens)} x {doc_lens[0]}",
                     "t_forward_s": max(med["forward"]), "t_forward_backward_s": max(med["forward+backward"]),
                     "t_ranks_forward_backward_s": med["forward+backward"], "t_blocked_ranks_s": med["blocked"],
                     "heads": cfg.heads, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "dtype": cfg.dtype,
                     "backend": cfg.kernel().name, "repeats": cfg.repeats, "threads": 1, "clock": "wall",
                     "date": time.strftime("%Y-%m-%d")})
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seq-per-rank", type=int, default=2048)
    p.add_argument("--docs", type=int, nargs="+", default=[0, 64],
                   help="0: the mixed lengths 40/25/20/10/5 %%; N: N documents of one length")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--tiny", action="store_true", help="smoke test: cp 2, 64 tokens per rank, small heads")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    args = p.parse_args(argv)
    cps, spr, docs_list = args.cp, args.seq_per_rank, args.docs
    shape = dict(heads=8, kv_heads=2, head_dim=128, repeats=args.repeats)
    if args.tiny:
        cps, spr, docs_list, shape = [2], 64, [4], dict(heads=4, kv_heads=2, head_dim=16, repeats=1)
    rows = []
    for cp in cps:
        for docs in docs_list:
            rows += measure(cp, spr, BenchConfig(**shape, docs=docs))
            print(f"cp {cp}, {rows[-1]['doc_lens']}: done", file=sys.stderr, flush=True)
    for r in rows:
        if args.json:
            print(json.dumps(r))
        else:
            print(f"cp {r['cp']} {str(r['doc_lens']):32} {r['way']:10} fwd {r['t_forward_s']:.4f} s  "
                  f"fwd+bwd {r['t_forward_backward_s']:.4f} s  blocked {max(r['t_blocked_ranks_s']):.4f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
