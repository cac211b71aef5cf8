"""How much of one process's gated-delta-rule speed the context-parallel op keeps.

Efficiency is ring_efficiency.py's: time of the layer over the full sequence without CP
(the fastest of hf_ring's one-process chunked scan and, when transformers is installed,
its ``torch_chunk_gated_delta_rule``) / (cp x time of the slowest rank), forward and
forward + backward (autograd, a random output cotangent). 1.0 means CP splits the work
perfectly and adds nothing; what lowers it is each rank's extra work: the summaries (the
scan on the widened state ``[S | P]``), their composition, the state-gradient shares.
``efficiency_same_length`` compares the slowest rank with the one-process scan over a
sequence of the rank's own length instead (on a CPU the full sequence's per-token cost
grows with its length, out of cache, which flatters CP; this figure does not).

Virtual (the only mode here): one process runs each rank in turn through
``hf_ring.mixers.delta_rule.gated_delta_rule_op`` itself, its collectives replaced by
in-process ones that deliver at each all-gather (the forward's summaries, the backward's
state-gradient shares) every rank's real tensor, recorded in an untimed pass first; so the
forward and backward are exact, and checked against the one-process scan (``max_rel_err``:
output and every input's gradient). Communication time is not in these figures; the bytes
each rank sends are (an all-gather: ``cp - 1`` copies of the rank's tensor), forward and
forward + backward.

Defaults: float32 on CPU, 2 key heads, 4 value heads, head dims 128 (Qwen3-Next's head
size; its head counts are 16 / 32, and the cost is per head), q/k l2-normalised in the
op, chunk 64, batch 1, zigzag and contiguous, cp 2 and 4, 2048 tokens per rank; 1
warm-up round, then the median of 3, every unit timed in turn within a round.
Run ``python benchmarks/mixer_efficiency.py --help``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Optional

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]
from pattern_efficiency import Counter  # noqa: E402
from ring_efficiency import CLOCKS, BenchConfig, Unit, run_interleaved  # noqa: E402

import hf_ring  # noqa: E402
from hf_ring.mixers.delta_rule import gated_delta_rule_op  # noqa: E402
from hf_ring.mixers.delta_rule_chunk import local_gated_delta_rule  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta")


class _Recorder:
    """Collectives that record each all-gather's input of one rank (values delivered: this
    rank's own, repeated; what is recorded does not depend on them)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.sent = rank, world, []

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.sent.append(x.detach().clone())
        return x.expand(self.world, *x.shape)


class _Replay:
    """Collectives of rank ``rank`` that deliver, at the ``i``-th all-gather of each
    forward + backward, every rank's recorded ``i``-th input; and count the bytes sent
    (an all-gather makes each rank send its tensor to the ``world - 1`` others)."""

    def __init__(self, rank: int, recorded: list[list[torch.Tensor]], counter: Counter) -> None:
        self.rank, self.world, self.counter, self.calls = rank, len(recorded), counter, 0
        self.recorded = recorded

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.counter.sent += x.nbytes * (self.world - 1)
        every = torch.stack([calls[self.calls] for calls in self.recorded])
        self.calls += 1
        return every


def make_problem(cp: int, spr: int, hk: int, hv: int, d: int, seed: int = 0) -> dict:
    """Full-sequence float32 inputs ``(1, cp * spr, heads, d)`` / ``(1, cp * spr, hv)`` and the
    output cotangent; decays as a trained layer's (g in (-0.1, 0)), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    s = cp * spr
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return {"q": r(1, s, hk, d), "k": r(1, s, hk, d), "v": r(1, s, hv, d),
            "g": -0.1 * torch.rand(1, s, hv, generator=gen), "beta": torch.rand(1, s, hv, generator=gen),
            "dout": r(1, s, hv, d)}


def full_units(pb: dict, chunk: int) -> list[Unit]:
    """The exact ways to run the full sequence on one process (the fastest is the reference)."""
    ops = {"hf_ring one-process scan": lambda *x: local_gated_delta_rule(*x, chunk, None, True)[0]}
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
        ops["transformers torch_chunk_gated_delta_rule"] = (
            lambda *x: torch_chunk_gated_delta_rule(*x, chunk_size=chunk, use_qk_l2norm_in_kernel=True)[0])
    except ImportError:
        pass

    def unit(name, op):
        def fwd():
            return op(*(pb[n].detach().requires_grad_() for n in NAMES))
        return Unit(name, fwd, lambda out: out.backward(pb["dout"]))
    return [unit(n, op) for n, op in ops.items()]


def _rank_run(shard: dict, coll, layout: str, chunk: int) -> tuple[torch.Tensor, dict]:
    """One rank's forward and backward; its output and input gradients."""
    leaves = {n: shard[n].detach().requires_grad_() for n in NAMES}
    out = gated_delta_rule_op(*leaves.values(), coll, layout, None, chunk, None, True)[0]
    out.backward(shard["dout"])
    return out.detach(), {n: t.grad for n, t in leaves.items()}


def rank_units(pb: dict, cp: int, layout: str, chunk: int) -> tuple[list[Unit], list[Counter], float]:
    """Each rank's CP op over collectives replaying every rank's real summaries and
    state-gradient shares, the bytes counters, and the largest relative error of the
    reassembled output and input gradients against the one-process scan."""
    shards = [{n: hf_ring.shard_sequence(t, cp, r, layout=layout).contiguous() for n, t in pb.items()}
              for r in range(cp)]
    recorders = [_Recorder(r, cp) for r in range(cp)]
    for r in range(cp):  # untimed: record what every rank sends
        _rank_run(shards[r], recorders[r], layout, chunk)
    recorded = [rec.sent for rec in recorders]
    runs = [_rank_run(shards[r], _Replay(r, recorded, Counter()), layout, chunk) for r in range(cp)]
    leaves = {n: pb[n].detach().requires_grad_() for n in NAMES}
    full = local_gated_delta_rule(*leaves.values(), chunk, None, True)[0]
    full.backward(pb["dout"])
    pairs = [(hf_ring.unshard_sequence([run[0] for run in runs], layout=layout), full.detach())]
    pairs += [(hf_ring.unshard_sequence([run[1][n] for run in runs], layout=layout), leaves[n].grad) for n in NAMES]
    err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)
    units, counters = [], []
    for r in range(cp):
        counter = Counter()
        coll = _Replay(r, recorded, counter)

        def fwd(r=r, coll=coll, counter=counter):
            counter.sent, coll.calls = 0, 0
            leaves = {n: shards[r][n].detach().requires_grad_() for n in NAMES}
            out = gated_delta_rule_op(*leaves.values(), coll, layout, None, chunk, None, True)[0]
            counter.fwd_bytes = counter.sent
            return out

        units.append(Unit(f"{layout} rank {r}", fwd, lambda out, r=r: out.backward(shards[r]["dout"])))
        counters.append(counter)
    return units, counters, err


def measure(cp: int, spr: int, layouts: list[str], a, cfg: BenchConfig) -> list[dict]:
    pb = make_problem(cp, spr, a.k_heads, a.v_heads, a.head_dim)
    refs = full_units(pb, a.chunk)
    # The one-process scan over one rank's token count: its per-token cost is the CP op's
    # floor without the full sequence's own size effects (caches), which help CP on a CPU.
    same = full_units(make_problem(1, spr, a.k_heads, a.v_heads, a.head_dim), a.chunk)[0]
    ranks = {lay: rank_units(pb, cp, lay, a.chunk) for lay in layouts}
    run_interleaved([*refs, same, *(u for us, _, _ in ranks.values() for u in us)], cfg)
    rows = []
    for lay, (units, counters, err) in ranks.items():
        for name, attr in (("forward", "fwd_s"), ("forward+backward", "fb_s")):
            ref = min(refs, key=lambda u: statistics.median(getattr(u, attr)))
            full = statistics.median(getattr(ref, attr))
            per_rank = [statistics.median(getattr(u, attr)) for u in units]
            sent = max(c.fwd_bytes if name == "forward" else c.sent for c in counters)
            rows.append({
                "mixer": "gated_delta_rule", "layout": lay, "cp": cp, "seq_per_rank": spr, "pass": name,
                "efficiency": full / (cp * max(per_rank)), "t_full_s": full, "t_slowest_rank_s": max(per_rank),
                "t_same_length_s": statistics.median(getattr(same, attr)),
                "efficiency_same_length": statistics.median(getattr(same, attr)) / max(per_rank),
                "t_ranks_s": per_rank, "reference": ref.name,
                "t_references_s": {u.name: statistics.median(getattr(u, attr)) for u in refs},
                "bytes_sent_per_rank": sent, "max_rel_err": err, "k_heads": a.k_heads, "v_heads": a.v_heads,
                "head_dim": a.head_dim, "chunk": a.chunk, "threads": torch.get_num_threads(), "clock": a.clock,
            })
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seq-per-rank", type=int, nargs="+", default=[2048])
    p.add_argument("--layouts", nargs="+", default=["zigzag", "contiguous"], choices=["zigzag", "contiguous"])
    p.add_argument("--k-heads", type=int, default=2)
    p.add_argument("--v-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS))
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--tiny", action="store_true", help="smoke test: cp 2, 64 tokens per rank, small heads")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    a = p.parse_args(argv)
    if a.tiny:
        a.cp, a.seq_per_rank, a.k_heads, a.v_heads, a.head_dim, a.chunk, a.repeats = [2], [64], 1, 2, 16, 16, 1
    torch.set_num_threads(a.threads)
    cfg = BenchConfig(repeats=a.repeats, warmup=a.warmup, clock=a.clock)
    rows = [r for cp in a.cp for spr in a.seq_per_rank for r in measure(cp, spr, a.layouts, a, cfg)]
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"# gated delta rule, float32 CPU, heads {a.k_heads}/{a.v_heads}, head_dim {a.head_dim}, chunk {a.chunk}, "
          f"median of {a.repeats} after {a.warmup} warm-up, {a.threads} threads, {a.clock} clock")
    print(f"{'layout':11} {'cp':>3} {'seq/rank':>8} {'pass':17} {'eff':>6} {'t_full s':>9} {'slowest rank s':>14} "
          f"{'eff same len':>12} {'MiB sent/rank':>13} {'rel err':>8}")
    for r in rows:
        print(f"{r['layout']:11} {r['cp']:>3} {r['seq_per_rank']:>8} {r['pass']:17} {r['efficiency']:6.3f} "
              f"{r['t_full_s']:9.4f} {r['t_slowest_rank_s']:14.4f} {r['efficiency_same_length']:12.3f} "
              f"{r['bytes_sent_per_rank'] / 2**20:13.3f} "
              f"{r['max_rel_err']:8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
