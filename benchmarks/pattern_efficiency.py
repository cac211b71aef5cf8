"""Every context-parallel pattern against the ring: efficiency and bytes moved per step.

Efficiency is ring_efficiency.py's: time of one causal attention call over the full
sequence / (cp x time of the slowest rank); 1.0 means the pattern splits the work
perfectly and adds nothing.

- virtual (default): one process runs each rank of each pattern in turn, through the
  patterns' own ops (``run_plan`` (ring), ``allgather_attention``, ``ulysses_attention``;
  hybrid = Ulysses over a virtual all-to-all around a virtual ring), their transfers
  replaced by in-process copies (``VirtualRing``, ``VirtualCollectives``). Communication
  time is therefore not in these figures; what is: each rank's share of the causal work,
  the kernel's speed on the pieces it gets, merges, reorderings and copies. The ring and
  all-gather compute exact attention here; Ulysses' virtual all-to-all delivers this
  rank's own values in place of its peers' (same shapes, same work), so its output is
  not checked here (tests/test_cp_patterns.py checks every pattern over gloo).
- ``--spawn``: ``hf_ring.context_parallel_attn_func`` over gloo in ``cp`` processes,
  transfers included (hybrid needs cp >= 4: on a 2-core machine those processes share
  cores, so its spawned figure is a lower bound).

Bytes moved per step: what one rank sends in one attention call (forward; forward and
backward), counted on the virtual transports as the collectives move them (ring P2P:
each block once; all-gather and reduce-scatter: (cp - 1) pieces per rank; all-to-all:
(cp - 1) / cp of the tensor), also given as multiples of the rank's own K/V bytes.

Hybrid uses Ulysses groups of ``cp / 2`` ranks (a ring of 2 across them) unless
``--ulysses-size`` says otherwise; at cp 2 it is not run (it would be Ulysses or the ring).
Run ``python benchmarks/pattern_efficiency.py --help``; results in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from typing import Optional

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]
import ring_efficiency as bench  # noqa: E402

from hf_ring.patterns import AttentionPlan, VirtualRing, run_plan  # noqa: E402
from hf_ring.patterns.allgather import allgather_attention  # noqa: E402
from hf_ring.distributed.collectives import Gathered, VirtualCollectives  # noqa: E402
from hf_ring.patterns.hybrid import RING_SHARD_LAYOUTS, group_positions  # noqa: E402
from hf_ring.patterns.ulysses import kv_repeat, ulysses_attention  # noqa: E402

PATTERNS = ("ring", "allgather", "ulysses", "hybrid")
LAYOUTS = ("zigzag", "stripe", "contiguous")


class Counter:
    """Bytes this rank sent, by phase."""

    def __init__(self) -> None:
        self.sent = 0  # since the forward began
        self.fwd_bytes = 0  # in the forward alone


class CountingCollectives:
    """A :class:`VirtualCollectives` that counts the bytes each collective makes a rank send."""

    def __init__(self, inner: VirtualCollectives, counter: Counter) -> None:
        self.inner, self.counter = inner, counter
        self.rank, self.world = inner.rank, inner.world

    def all_gather(self, x):
        self.counter.sent += x.nbytes * (self.world - 1)
        return self.inner.all_gather(x)

    def start_all_gather(self, x):
        return Gathered(self.all_gather(x))

    def reduce_scatter(self, x):
        self.counter.sent += x[0].nbytes * (self.world - 1)
        return self.inner.reduce_scatter(x)

    def all_to_all(self, x):
        self.counter.sent += x.nbytes * (self.world - 1) // self.world
        return self.inner.all_to_all(x)


def counting_transport(inner: VirtualRing, counter: Counter):
    """``inner``'s exchanges, each counting the bytes it sends."""
    def open_channel(channel: str):
        exchange = inner(channel)
        start = exchange.start

        def counted(send, recv):
            counter.sent += send.nbytes
            start(send, recv)
        exchange.start = counted
        return exchange
    return open_channel


def ulysses_size_for(cp: int, given: Optional[int]) -> int:
    return given if given is not None else max(1, cp // 2)


def rank_op(pattern: str, pb: bench.Problem, rank: int, kernel, scale: float, counter: Counter,
            ulysses_size: int):
    """``(q, k, v) -> out`` of rank ``rank`` of ``pattern`` on virtual transports."""
    cp, layout = pb.cp, pb.layout
    if pattern == "ring":
        plan = AttentionPlan(None, rank, cp, layout, True, scale, kernel,
                        transport=counting_transport(VirtualRing(rank, pb.kv_by_rank), counter))
        return lambda q, k, v: run_plan(q, k, v, plan)[0]
    if pattern == "allgather":
        plan = AttentionPlan(None, rank, cp, layout, True, scale, kernel, transport=VirtualRing(rank, pb.kv_by_rank))
        coll = CountingCollectives(VirtualCollectives(rank, pb.kv_by_rank), counter)
        return lambda q, k, v: allgather_attention(q, k, v, plan, coll)[0]
    if pattern == "ulysses":
        local = AttentionPlan(None, 0, 1, "contiguous", True, scale, kernel)
        coll = CountingCollectives(VirtualCollectives(rank, world=cp), counter)
        return lambda q, k, v: ulysses_attention(q, k, v, local, coll, layout, 0, cp, need_lse=False)[0]
    u = ulysses_size
    g, member = divmod(rank, u)
    _, _, s, hk, d = pb.kv_by_rank[0].shape
    hk_local = max(hk, u) // u  # K/V heads per rank after the Ulysses exchange
    blocks = [torch.randn(2, 1, u * s, hk_local, d, dtype=pb.q.dtype, device=pb.q.device) for _ in range(cp // u)]
    positions = None if layout in RING_SHARD_LAYOUTS else group_positions(cp * s, cp, u, layout)
    ring = AttentionPlan(None, g, cp // u, layout, True, scale, kernel, positions=positions,
                    transport=counting_transport(VirtualRing(g, blocks), counter))
    coll = CountingCollectives(VirtualCollectives(member, world=u), counter)
    return lambda q, k, v: ulysses_attention(q, k, v, ring, coll, layout, g * u, cp, pattern="hybrid",
                                             need_lse=False)[0]


def runs(pattern: str, cp: int, layout: str, cfg: bench.BenchConfig, ulysses_size: int) -> Optional[str]:
    """Why ``pattern`` is not run for this setting, or None."""
    if pattern == "hybrid" and (cp < 4 or ulysses_size in (1, cp) or cp % ulysses_size):
        return f"hybrid needs 1 < ulysses_size < cp dividing cp (cp {cp}, ulysses_size {ulysses_size})"
    degree = cp if pattern == "ulysses" else ulysses_size
    if pattern in ("ulysses", "hybrid"):
        try:
            kv_repeat(cfg.heads, cfg.kv_heads, degree, pattern)
        except NotImplementedError as e:
            return str(e)
    return None


def measure(cp: int, spr: int, layouts: list[str], patterns: list[str], cfg: bench.BenchConfig,
            ulysses_size: Optional[int]) -> list[dict]:
    """Virtual efficiency and bytes rows for every pattern x layout at one cp and length."""
    kernel = cfg.kernel()
    scale = 1 / math.sqrt(cfg.head_dim)
    u = ulysses_size_for(cp, ulysses_size)
    problems = {lay: bench.make_problem(lay, cp, spr, cfg) for lay in layouts}
    refs = bench.full_units(problems[layouts[0]], kernel, scale)
    units, counters, skipped = {}, {}, []
    for lay in layouts:
        for pat in patterns:
            why = runs(pat, cp, lay, cfg, u)
            if why:
                skipped.append({"pattern": pat, "layout": lay, "cp": cp, "seq_per_rank": spr, "skipped": why})
                continue
            pb = problems[lay]
            ranks = []
            for r in range(cp):
                counter = Counter()
                op = rank_op(pat, pb, r, kernel, scale, counter, u)

                def fwd(pb=pb, r=r, op=op, counter=counter):
                    counter.sent = 0
                    q, k, v = (t.detach().requires_grad_() for t in pb.shards[r][:3])
                    return op(q, k, v), counter

                def bwd(state, pb=pb, r=r):
                    out, counter = state
                    counter.fwd_bytes = counter.sent
                    out.backward(pb.shards[r][3])
                ranks.append(bench.Unit(f"{pat} {lay} rank {r}", fwd, bwd))
                counters.setdefault((pat, lay), []).append(counter)
            units[(pat, lay)] = ranks
    bench.run_interleaved([*refs, *(x for us in units.values() for x in us)], cfg)
    rows = []
    kv_bytes = problems[layouts[0]].kv_by_rank[0].nbytes
    for (pat, lay), ranks in units.items():
        sent = counters[(pat, lay)]
        fwd_b, all_b = max(c.fwd_bytes for c in sent), max(c.sent for c in sent)
        for row in bench.efficiency_rows(lay, cp, spr, refs, ranks, cfg, kernel.name, None):
            b = fwd_b if row["pass"] == "forward" else all_b
            rows.append({"pattern": pat, **row, "bytes_sent_per_rank": b, "bytes_over_local_kv": b / kv_bytes,
                         "ulysses_size": u if pat == "hybrid" else None})
    return rows + skipped


def _spawn_worker(rank, cp, pattern, layout, spr, cfg, threads, u, tmp):
    import torch.distributed as dist

    import hf_ring

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=cp)
    pb = bench.make_problem(layout, cp, spr, cfg)
    q, k, v = (t.clone().requires_grad_() for t in pb.shards[rank][:3])
    kwargs = {"ulysses_size": u} if pattern == "hybrid" else {}
    hf_ring.context_parallel_attn_func(q, k, v, pattern=pattern, layout=layout, backend=cfg.backend, **kwargs)

    def fwd():
        return hf_ring.context_parallel_attn_func(q, k, v, pattern=pattern, layout=layout, backend=cfg.backend,
                                                  check_ranks=False, **kwargs)
    unit = bench.Unit(f"rank {rank}", fwd, lambda out: out.backward(pb.shards[rank][3]))
    refs = bench.full_units(pb, cfg.kernel(), 1 / math.sqrt(cfg.head_dim))
    for i in range(cfg.warmup + cfg.repeats):
        dist.barrier()
        bench.time_unit(unit, cfg, keep=i >= cfg.warmup)
        dist.barrier()
        if rank == 0:
            for ref in refs:
                bench.time_unit(ref, cfg, keep=i >= cfg.warmup)
    torch.save((unit.fwd_s, unit.fb_s, [(x.name, x.fwd_s, x.fb_s) for x in refs]), f"{tmp}/rank{rank}.pt")
    dist.destroy_process_group()


def measure_spawn(pattern: str, layout: str, cp: int, spr: int, cfg: bench.BenchConfig, threads: int,
                  ulysses_size: Optional[int]) -> list[dict]:
    import torch.multiprocessing as mp

    u = ulysses_size_for(cp, ulysses_size)
    why = runs(pattern, cp, layout, cfg, u)
    if why:
        return [{"pattern": pattern, "layout": layout, "cp": cp, "seq_per_rank": spr, "skipped": why, "mode": "spawn"}]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawn_worker, args=(cp, pattern, layout, spr, cfg, threads, u, tmp), nprocs=cp, join=True)
        res = [torch.load(f"{tmp}/rank{r}.pt") for r in range(cp)]
    ranks = [bench.Unit(f"rank {r}", fwd_s=x[0], fb_s=x[1]) for r, x in enumerate(res)]
    refs = [bench.Unit(name, fwd_s=f, fb_s=fb) for name, f, fb in res[0][2]]
    rows = bench.efficiency_rows(layout, cp, spr, refs, ranks, cfg, cfg.kernel().name, None, mode="spawn")
    return [{"pattern": pattern, **r, "threads": threads, "ulysses_size": u if pattern == "hybrid" else None}
            for r in rows]


def _print(rows: list[dict]) -> None:
    print(f"{'mode':8} {'pattern':10} {'layout':11} {'cp':>3} {'seq/rank':>8} {'pass':17} {'eff':>6} "
          f"{'MB sent/rank':>12} {'x local KV':>10}")
    for r in rows:
        if "skipped" in r:
            print(f"{r.get('mode', 'virtual'):8} {r['pattern']:10} {r['layout']:11} {r['cp']:>3} "
                  f"{r['seq_per_rank']:>8} skipped: {r['skipped'][:70]}")
            continue
        mb = r.get("bytes_sent_per_rank")
        sent = f"{mb / 2**20:12.2f} {r['bytes_over_local_kv']:10.2f}" if mb is not None else f"{'-':>12} {'-':>10}"
        print(f"{r['mode']:8} {r['pattern']:10} {r['layout']:11} {r['cp']:>3} {r['seq_per_rank']:>8} {r['pass']:17} "
              f"{r['efficiency']:6.3f} {sent}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--seq-per-rank", type=int, nargs="+", default=[1024])
    p.add_argument("--layouts", nargs="+", default=["zigzag"], choices=LAYOUTS)
    p.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    p.add_argument("--ulysses-size", type=int, default=None, help="hybrid: ranks per Ulysses group (cp/2)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=sorted(bench.DTYPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--clock", default="wall", choices=sorted(bench.CLOCKS))
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--spawn", action="store_true", help="real collectives over gloo (cp 2 unless --cp)")
    p.add_argument("--tiny", action="store_true", help="smoke test: cp 2 and 4, 32 tokens per rank, small heads")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    a = p.parse_args(argv)
    if a.tiny:
        a.cp, a.seq_per_rank, a.repeats, a.heads, a.kv_heads, a.head_dim = [2, 4], [32], 2, 4, 2, 16
    if a.spawn and a.cp == [2, 4, 8]:
        a.cp = [2]
    torch.set_num_threads(a.threads)
    cfg = bench.BenchConfig(a.heads, a.kv_heads, a.head_dim, a.dtype, a.device, a.backend, a.repeats, a.warmup,
                            a.clock)
    rows: list[dict] = []
    for cp in a.cp:
        for spr in a.seq_per_rank:
            if a.spawn:
                new = [r for pat in a.patterns for lay in a.layouts
                       for r in measure_spawn(pat, lay, cp, spr, cfg, max(1, a.threads // cp), a.ulysses_size)]
            else:
                new = measure(cp, spr, a.layouts, a.patterns, cfg, a.ulysses_size)
            rows += new
            if a.json:
                for r in new:
                    print(json.dumps(r), flush=True)
    if not a.json:
        print(f"# {cfg.kernel().name}, {a.dtype}, heads {a.heads}/{a.kv_heads}, head_dim {a.head_dim}, batch 1, "
              f"median of {a.repeats} after {a.warmup} warm-up, {a.threads} threads, {a.clock} clock")
        _print(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
