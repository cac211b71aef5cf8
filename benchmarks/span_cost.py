"""What bidirectional spans (Gemma 3's images) cost the ring: time and scored pairs.

Each rank of a virtual ring (one process runs the ranks in turn, transfers replaced by
in-process copies: ``VirtualRing``) runs the ring pattern's forward and backward with and
without spans; the figure is the slowest rank's CPU time with spans over without. The spans
move no bytes (a span's keys on other ranks arrive with the ring's K/V blocks), so the time
is the extra masked blocks' kernel calls and merges. The model column counts the pairs
the span blocks score (their rectangles) against the causal schedule's.

Images are ``--image`` tokens every ``--every`` tokens (Gemma 3: 256 tokens an image).
Run ``python benchmarks/span_cost.py --help``; results in benchmarks/results/span_cost.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE)]

from hf_ring.kernels import get_backend  # noqa: E402
from hf_ring.kernels.base import KernelNeeds  # noqa: E402
from hf_ring.patterns import AttentionPlan, VirtualRing, run_plan  # noqa: E402
from hf_ring.patterns.ring.attention import pack_kv  # noqa: E402
from hf_ring.patterns.ring.spans import BidirectionalSpans  # noqa: E402
from hf_ring.sharding import shard_sequence  # noqa: E402


def rank_seconds(args, spans, rank: int, shards, kv_by_rank, kernel) -> tuple[float, float]:
    """CPU seconds of rank ``rank``'s forward and backward without and with ``spans``
    (medians of ``args.repeat``, the two interleaved so that neither runs on a colder process)."""
    scale = 1 / math.sqrt(args.head_dim)
    plans = [AttentionPlan(None, rank, args.cp, "zigzag", True, scale, kernel, spans=sp,
                           transport=VirtualRing(rank, kv_by_rank)) for sp in (None, spans)]
    q, k, v, dout = shards[rank]
    times: tuple[list, list] = ([], [])
    for _ in range(args.repeat):
        for plan, took in zip(plans, times):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            start = time.process_time()
            out, _ = run_plan(*leaves, plan)
            out.backward(dout)
            took.append(time.process_time() - start)
    return tuple(sorted(t)[len(t) // 2] for t in times)


def scored_pairs(args, spans, kernel) -> tuple[float, float]:
    """Pairs the causal schedule's blocks and the span blocks score, summed over ranks and steps."""
    scale = 1 / math.sqrt(args.head_dim)
    local = args.seq // args.cp
    causal = extra = 0.0
    for rank in range(args.cp):
        plan = AttentionPlan(None, rank, args.cp, "zigzag", True, scale, kernel, spans=spans,
                             transport=VirtualRing(rank, []))
        for step in range(args.cp):
            causal += sum(b.work for b in plan.blocks(step, local))
            extra += sum(sb.block.work for sb in plan.span_blocks(step, local))
    return causal, extra


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--image", type=int, default=256)
    p.add_argument("--every", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--backend", default="torch_cpu_flash")
    p.add_argument("--out", default=os.path.join(_HERE, "results", "span_cost.jsonl"))
    args = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, args.seq, h, args.head_dim, generator=g)
            for h in (args.heads, args.kv_heads, args.kv_heads, args.heads)]
    shards = [[shard_sequence(t, args.cp, r) for t in full] for r in range(args.cp)]
    kv_by_rank = [pack_kv(s[1], s[2]) for s in shards]
    kernel = get_backend(args.backend, torch.device("cpu"), torch.float32, KernelNeeds(masked=True))
    row = tuple((a, a + args.image) for a in range(args.every // 2, args.seq - args.image + 1, args.every))
    spans = BidirectionalSpans((row,), args.seq)
    per_rank = [rank_seconds(args, spans, r, shards, kv_by_rank, kernel) for r in range(args.cp)]
    plain, with_spans = (max(t[i] for t in per_rank) for i in range(2))
    causal, extra = scored_pairs(args, spans, kernel)
    result = {"seq": args.seq, "cp": args.cp, "images": len(row), "image_tokens": args.image,
              "image_share": len(row) * args.image / args.seq, "backend": args.backend,
              "slowest_rank_s": plain, "slowest_rank_with_spans_s": with_spans, "time_ratio": with_spans / plain,
              "scored_pairs_ratio": (causal + extra) / causal}
    print(json.dumps(result))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
