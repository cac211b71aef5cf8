"""How much of one process's speed the context-parallel token mixers keep: the gated delta
rule and Mamba-2's SSD chunk scan.

Efficiency is ring_efficiency.py's: time of the layer over the full sequence without CP
(the fastest of hf_ring's one-process op and, when transformers is installed, its own:
``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``) / (cp x time of the slowest rank),
forward and forward + backward (autograd, a random output cotangent). 1.0 means CP splits
the work perfectly and adds nothing; what lowers it is each rank's extra work: for the
gated delta rule the summaries (the scan on the widened state ``[S | P]``), their
composition, the state-gradient shares; for the SSD (whose transition is one scalar per
head) the composition and folding the entering state into the chunks' states.
``efficiency_same_length`` compares the slowest rank with the one-process op over a
sequence of the rank's own length instead (on a CPU the full sequence's per-token cost
grows with its length, out of cache, which flatters CP; this figure does not).

Virtual (the only mode here): one process runs each rank in turn through the op itself
(``gated_delta_rule_op``, ``ssd_op``), its collectives replaced by in-process ones that
deliver at each all-gather (the forward's summaries, the backward's state-gradient shares)
every rank's real tensor and at each reduce-scatter (the SSD's backward of its all-gather)
the real sum, recorded in untimed passes first; so the forward and backward are exact, and
checked against the one-process op (``max_rel_err``: output and every input's gradient, the
per-head parameters' summed over the ranks). Communication time is not in these figures;
the bytes each rank sends are (an all-gather or a reduce-scatter: ``cp - 1`` blocks of the
rank's share), forward and forward + backward.

Defaults: float32 on CPU, batch 1, zigzag and contiguous, cp 2 and 4, 2048 tokens per rank;
1 warm-up round, then the median of 3, every unit timed in turn within a round. Gated delta
rule: 2 key heads, 4 value heads, head dims 128 (Qwen3-Next's head size; its head counts are
16 / 32, and the cost is per head), q/k l2-normalised in the op, chunk 64. SSD: Mamba-2's
shapes per head (head dim 64, state 128, 1 group, chunk 256), 8 heads (Mamba-2 2.7B has 80:
the cost is per head), dt_bias and softplus, D.
Run ``python benchmarks/mixer_efficiency.py --help``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]
from pattern_efficiency import Counter  # noqa: E402
from ring_efficiency import CLOCKS, BenchConfig, Unit, run_interleaved  # noqa: E402

import hf_ring  # noqa: E402
from hf_ring.mixers.delta_rule import gated_delta_rule_op  # noqa: E402
from hf_ring.mixers.delta_rule_chunk import local_gated_delta_rule  # noqa: E402
from hf_ring.mixers.ssd import ssd_op  # noqa: E402


@dataclass(frozen=True)
class Mixer:
    """One token mixer as the benchmark runs it.

    Attributes:
        name: the rows' ``mixer``.
        sharded: inputs along the sequence (each rank its shard); shared: per-head
            parameters, the same on every rank (their gradient: the sum of the ranks').
        problem: ``(seq, args) -> inputs``: full-sequence float32 inputs (batch 1) and
            ``"dout"``, the output cotangent.
        full_ops: ``args -> {name: op(inputs) -> out}``: the exact ways to run the full
            sequence on one process, hf_ring's first.
        cp_op: ``(inputs, collectives, layout, args) -> out``: one rank's CP op.
        fields: ``args -> dict``: the shape fields of its rows.
    """

    name: str
    sharded: tuple[str, ...]
    shared: tuple[str, ...]
    problem: Callable[[int, argparse.Namespace], dict]
    full_ops: Callable[[argparse.Namespace], dict]
    cp_op: Callable[[dict, object, str, argparse.Namespace], torch.Tensor]
    fields: Callable[[argparse.Namespace], dict]


def _gdr_problem(s: int, a, seed: int = 0) -> dict:
    """q, k ``(1, s, hk, d)``, v ``(1, s, hv, d)``; decays as a trained layer's (g in (-0.1, 0)),
    beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    hk, hv, d = a.k_heads, a.v_heads, a.head_dim
    return {"q": r(1, s, hk, d), "k": r(1, s, hk, d), "v": r(1, s, hv, d),
            "g": -0.1 * torch.rand(1, s, hv, generator=gen), "beta": torch.rand(1, s, hv, generator=gen),
            "dout": r(1, s, hv, d)}


def _gdr_full_ops(a) -> dict:
    ops = {"hf_ring one-process scan": lambda x: local_gated_delta_rule(*_gdr_args(x), a.chunk, None, True)[0]}
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
        ops["transformers torch_chunk_gated_delta_rule"] = (
            lambda x: torch_chunk_gated_delta_rule(*_gdr_args(x), chunk_size=a.chunk, use_qk_l2norm_in_kernel=True)[0])
    except ImportError:
        pass
    return ops


def _gdr_args(x: dict) -> list[torch.Tensor]:
    return [x[n] for n in ("q", "k", "v", "g", "beta")]


def _ssd_problem(s: int, a, seed: int = 0) -> dict:
    """Mamba-2's: x, B, C ~ N(0, 1); raw dt ~ N(0, 1) with dt_bias the inverse softplus of
    U(1e-3, 0.1) (Mamba-2's dt initialisation), softplus in the op; A = -U(1, 16); D ~ N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    h, p, g, n = a.ssd_heads, a.ssd_head_dim, a.ssd_groups, a.ssd_state
    dt0 = 1e-3 + (0.1 - 1e-3) * torch.rand(h, generator=gen)
    return {"x": r(1, s, h, p), "dt": r(1, s, h), "A": -(1 + 15 * torch.rand(h, generator=gen)),
            "B": r(1, s, g, n), "C": r(1, s, g, n), "D": r(h), "dt_bias": dt0 + torch.log(-torch.expm1(-dt0)),
            "dout": r(1, s, h, p)}


def _ssd_kwargs(x: dict) -> dict:
    return dict(D=x["D"], dt_bias=x["dt_bias"], dt_softplus=True)


def _ssd_full_ops(a) -> dict:
    def ours(x):
        return ssd_op(*_ssd_args(x), None, chunk_size=a.ssd_chunk, **_ssd_kwargs(x))[0]
    ops = {"hf_ring one-process scan": ours}
    try:
        from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan
        ops["transformers mamba2_chunk_scan"] = (
            lambda x: mamba2_chunk_scan(*_ssd_args(x), chunk_size=a.ssd_chunk, **_ssd_kwargs(x)))
    except ImportError:
        pass
    return ops


def _ssd_args(x: dict) -> list[torch.Tensor]:
    return [x[n] for n in ("x", "dt", "A", "B", "C")]


MIXERS = {
    "gated_delta_rule": Mixer(
        "gated_delta_rule", ("q", "k", "v", "g", "beta"), (), _gdr_problem, _gdr_full_ops,
        lambda x, coll, lay, a: gated_delta_rule_op(*_gdr_args(x), coll, layout=lay, chunk_size=a.chunk,
                                                      use_qk_l2norm_in_kernel=True)[0],
        lambda a: {"k_heads": a.k_heads, "v_heads": a.v_heads, "head_dim": a.head_dim, "chunk": a.chunk}),
    "ssd": Mixer(
        "ssd", ("x", "dt", "B", "C"), ("A", "D", "dt_bias"), _ssd_problem, _ssd_full_ops,
        lambda x, coll, lay, a: ssd_op(*_ssd_args(x), coll, lay, chunk_size=a.ssd_chunk, **_ssd_kwargs(x))[0],
        lambda a: {"heads": a.ssd_heads, "head_dim": a.ssd_head_dim, "state_size": a.ssd_state,
                   "groups": a.ssd_groups, "chunk": a.ssd_chunk}),
}


class _Replay:
    """Collectives of rank ``rank`` run in one process (module docstring). The ``i``-th
    all-gather of each forward + backward delivers every rank's ``i``-th input from
    ``gathered`` (None: records this rank's, delivering it repeated); the ``i``-th
    reduce-scatter the sum of every rank's ``i``-th input's entry ``rank`` from ``scattered``
    (None: records this rank's, delivering its own entry). Counts the bytes sent."""

    def __init__(self, rank: int, world: int, counter: Counter, gathered: Optional[list] = None,
                 scattered: Optional[list] = None) -> None:
        self.rank, self.world, self.counter = rank, world, counter
        self.gathered, self.scattered = gathered, scattered
        self.gather_in, self.scatter_in, self.calls, self.rs_calls = [], [], 0, 0

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.counter.sent += x.nbytes * (self.world - 1)
        if self.gathered is None:
            self.gather_in.append(x.detach().clone())
            return x.detach().expand(self.world, *x.shape).clone()
        self.calls += 1
        return torch.stack([calls[self.calls - 1] for calls in self.gathered])

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        self.counter.sent += x.nbytes * (self.world - 1) // self.world
        if self.scattered is None:
            self.scatter_in.append(x.detach().clone())
            return x[self.rank].clone()
        self.rs_calls += 1
        return sum(calls[self.rs_calls - 1][self.rank] for calls in self.scattered)


def _run(mixer: Mixer, op: Callable, inputs: dict) -> tuple[torch.Tensor, dict]:
    """``op``'s forward and backward from fresh leaves; its output and input gradients."""
    leaves = {n: inputs[n].detach().requires_grad_() for n in (*mixer.sharded, *mixer.shared)}
    out = op(leaves)
    out.backward(inputs["dout"])
    return out.detach(), {n: t.grad for n, t in leaves.items()}


def full_units(mixer: Mixer, pb: dict, a) -> list[Unit]:
    """The exact ways to run the full sequence on one process (the fastest is the reference)."""
    def unit(name, op):
        def fwd():
            return op({n: pb[n].detach().requires_grad_() for n in (*mixer.sharded, *mixer.shared)})
        return Unit(name, fwd, lambda out: out.backward(pb["dout"]))
    return [unit(n, op) for n, op in mixer.full_ops(a).items()]


def rank_units(mixer: Mixer, pb: dict, cp: int, layout: str, a) -> tuple[list[Unit], list[Counter], float]:
    """Each rank's CP op over collectives replaying every rank's real exchanges, the bytes
    counters, and the largest relative error of the reassembled output and input gradients
    against the one-process op."""
    shards = [{n: hf_ring.shard_sequence(t, cp, r, layout=layout).contiguous() if n not in mixer.shared else t
               for n, t in pb.items()} for r in range(cp)]

    def run_all(**recorded) -> tuple[list[_Replay], list]:
        colls = [_Replay(r, cp, Counter(), **recorded) for r in range(cp)]
        runs = [_run(mixer, lambda x, r=r: mixer.cp_op(x, colls[r], layout, a), shards[r]) for r in range(cp)]
        return colls, runs

    # Untimed: what every rank all-gathers (it does not depend on what it receives), then what
    # every rank reduce-scatters given the real all-gathers, then the exact run.
    gathered = [c.gather_in for c in run_all()[0]]
    scattered = [c.scatter_in for c in run_all(gathered=gathered)[0]]
    runs = run_all(gathered=gathered, scattered=scattered)[1]
    full = _run(mixer, mixer.full_ops(a)["hf_ring one-process scan"], pb)
    pairs = [(hf_ring.unshard_sequence([run[0] for run in runs], layout=layout), full[0])]
    pairs += [(hf_ring.unshard_sequence([run[1][n] for run in runs], layout=layout), full[1][n]) for n in mixer.sharded]
    pairs += [(sum(run[1][n] for run in runs), full[1][n]) for n in mixer.shared]
    err = max(((x - y).abs().max() / y.abs().max()).item() for x, y in pairs)
    units, counters = [], []
    for r in range(cp):
        counter = Counter()
        coll = _Replay(r, cp, counter, gathered, scattered)

        def fwd(r=r, coll=coll, counter=counter):
            counter.sent, coll.calls, coll.rs_calls = 0, 0, 0
            out = mixer.cp_op({n: t.detach().requires_grad_() for n, t in shards[r].items() if n != "dout"},
                              coll, layout, a)
            counter.fwd_bytes = counter.sent
            return out

        units.append(Unit(f"{mixer.name} {layout} rank {r}", fwd, lambda out, r=r: out.backward(shards[r]["dout"])))
        counters.append(counter)
    return units, counters, err


def measure(mixer: Mixer, cp: int, spr: int, layouts: list[str], a, cfg: BenchConfig) -> list[dict]:
    pb = mixer.problem(cp * spr, a)
    refs = full_units(mixer, pb, a)
    # The one-process op over one rank's token count: its per-token cost is the CP op's
    # floor without the full sequence's own size effects (caches), which help CP on a CPU.
    same = full_units(mixer, mixer.problem(spr, a), a)[0]
    ranks = {lay: rank_units(mixer, pb, cp, lay, a) for lay in layouts}
    run_interleaved([*refs, same, *(u for us, _, _ in ranks.values() for u in us)], cfg)
    rows = []
    for lay, (units, counters, err) in ranks.items():
        for name, attr in (("forward", "fwd_s"), ("forward+backward", "fb_s")):
            ref = min(refs, key=lambda u: statistics.median(getattr(u, attr)))
            full = statistics.median(getattr(ref, attr))
            per_rank = [statistics.median(getattr(u, attr)) for u in units]
            sent = max(c.fwd_bytes if name == "forward" else c.sent for c in counters)
            rows.append({
                "mixer": mixer.name, "layout": lay, "cp": cp, "seq_per_rank": spr, "pass": name,
                "efficiency": full / (cp * max(per_rank)), "t_full_s": full, "t_slowest_rank_s": max(per_rank),
                "t_same_length_s": statistics.median(getattr(same, attr)),
                "efficiency_same_length": statistics.median(getattr(same, attr)) / max(per_rank),
                "t_ranks_s": per_rank, "reference": ref.name,
                "t_references_s": {u.name: statistics.median(getattr(u, attr)) for u in refs},
                "bytes_sent_per_rank": sent, "max_rel_err": err, **mixer.fields(a),
                "threads": torch.get_num_threads(), "clock": a.clock,
            })
    return rows


def _shape(r: dict) -> str:
    if r["mixer"] == "ssd":
        return f"heads {r['heads']}, head_dim {r['head_dim']}, state {r['state_size']}, groups {r['groups']}"
    return f"heads {r['k_heads']}/{r['v_heads']}, head_dim {r['head_dim']}"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixer", default="all", choices=[*MIXERS, "all"])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seq-per-rank", type=int, nargs="+", default=[2048])
    p.add_argument("--layouts", nargs="+", default=["zigzag", "contiguous"], choices=["zigzag", "contiguous"])
    p.add_argument("--k-heads", type=int, default=2, help="gated delta rule")
    p.add_argument("--v-heads", type=int, default=4, help="gated delta rule")
    p.add_argument("--head-dim", type=int, default=128, help="gated delta rule")
    p.add_argument("--chunk", type=int, default=64, help="gated delta rule")
    p.add_argument("--ssd-heads", type=int, default=8)
    p.add_argument("--ssd-head-dim", type=int, default=64)
    p.add_argument("--ssd-state", type=int, default=128)
    p.add_argument("--ssd-groups", type=int, default=1)
    p.add_argument("--ssd-chunk", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS))
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--tiny", action="store_true", help="smoke test: cp 2, 64 tokens per rank, small heads")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    a = p.parse_args(argv)
    if a.tiny:
        a.cp, a.seq_per_rank, a.k_heads, a.v_heads, a.head_dim, a.chunk, a.repeats = [2], [64], 1, 2, 16, 16, 1
        a.ssd_heads, a.ssd_head_dim, a.ssd_state, a.ssd_groups, a.ssd_chunk = 4, 8, 16, 2, 16
    torch.set_num_threads(a.threads)
    cfg = BenchConfig(repeats=a.repeats, warmup=a.warmup, clock=a.clock)
    mixers = list(MIXERS.values()) if a.mixer == "all" else [MIXERS[a.mixer]]
    rows = [r for m in mixers for cp in a.cp for spr in a.seq_per_rank for r in measure(m, cp, spr, a.layouts, a, cfg)]
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    for m in mixers:
        mine = [r for r in rows if r["mixer"] == m.name]
        print(f"# {m.name}, float32 CPU, {_shape(mine[0])}, chunk {mine[0]['chunk']}, median of {a.repeats} after "
              f"{a.warmup} warm-up, {a.threads} threads, {a.clock} clock")
        print(f"{'layout':11} {'cp':>3} {'seq/rank':>8} {'pass':17} {'eff':>6} {'t_full s':>9} {'slowest rank s':>14} "
              f"{'eff same len':>12} {'MiB sent/rank':>13} {'rel err':>8}")
        for r in mine:
            print(f"{r['layout']:11} {r['cp']:>3} {r['seq_per_rank']:>8} {r['pass']:17} {r['efficiency']:6.3f} "
                  f"{r['t_full_s']:9.4f} {r['t_slowest_rank_s']:14.4f} {r['efficiency_same_length']:12.3f} "
                  f"{r['bytes_sent_per_rank'] / 2**20:13.3f} {r['max_rel_err']:8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
