"""Pipeline parallelism in the N-D cost model: memory per rank and step time per ``pp`` size,
MODELLED (arithmetic on stated assumptions, nothing measured), for Llama-3-70B and
Llama-3-405B at 128K tokens.

Built on ``nd_cost_model.py`` (same assumptions: bf16 activations, full activation
checkpointing, 16 bytes of model state per parameter sharded by FSDP2 over ``dp_shard x
cp``, the links and the throughput), with ``pp`` outermost: each stage's ranks a whole
``tp x cp`` block with FSDP2 inside the stage (hf_ring's ``pp_fsdp``), ``v`` stages a rank
(1 for GPipe / 1F1B, 2 for the interleaved and zero-bubble rows). A step trains ``m``
micro-batches of one sequence of ``S`` tokens each per data-parallel replica (the same work
at every ``pp``: at ``pp = 1`` the ``m`` sequences are accumulated one after another).

Terms, per rank (each in the docstring of the function that computes it):

- **state**: ``16 x (ceil(L / p) layers + the embedding or the head) / (dp_shard x cp)``
  (the first and the last rank hold one of them each; the worst rank is printed, ``L / p``
  rounded up: an uneven split gives the first stages a layer more).
- **checkpoints in flight**: every micro-batch whose forward has run and backward has not
  keeps each of the rank's layers' input, ``(L / p) x n x hidden x 2`` bytes (``n = S / cp``):
  ``m`` of them under GPipe, ``min(m, p)`` on the first rank under 1F1B, and ``min(m, p) x
  (1 + (p - 1) / (p v))`` under the interleaved schedule (Korthikanti et al. 2022, 4.2.3).
- **one layer and the loss**: ``nd_cost_model``'s working set of one layer (or the loss on
  the last rank) on one micro-batch, and FSDP's gathered layers.
- **p2p**: per micro-batch and stage boundary, the ``n x hidden`` bf16 activations forward
  and their gradient backward, ``2 x n x hidden x 2`` bytes per rank and stage it holds:
  ``m x v x 4 n hidden`` bytes a step (an upper bound: the last stage sends no activation,
  the first no gradient), over the links between nodes (pp outermost).
- **time**: one micro-batch through the worst rank's stages ``t = (compute + TP + CP seconds
  of one sequence) x ceil(L / p) / L`` (no overlap, as ``nd_cost_model``'s tables; FSDP's and the p2p seconds
  printed apart: they overlap); a step ``m t / (1 - bubble)`` with the bubble of each
  schedule: GPipe and 1F1B ``(p - 1) / (m + p - 1)``, interleaved ``(p - 1) / (v m + p - 1)``,
  zero bubble about a third of interleaved's (ZB-H1's rule, t_F = t_B = t_W), as
  ``benchmarks/pipeline.py`` measures them against.

    python benchmarks/pp_cost_model.py                  # both models' tables
    python benchmarks/pp_cost_model.py --microbatches 32 --json

Must not import torch, transformers, or hf_ring: plain Python, like nd_cost_model.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nd_cost_model import GB, GiB, Assumptions, ModelShape, communication, local_params, local_shape, memory, \
    parse_layout, seconds  # noqa: E402

MODELS = {
    "llama3_70b": ModelShape("Llama-3-70B", layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, mlp=28672,
                             vocab=128256),
    "llama3_405b": ModelShape("Llama-3-405B", layers=126, hidden=16384, heads=128, kv_heads=8, head_dim=128,
                              mlp=53248, vocab=128256),
}
# (tp x cp inside a stage, pp sizes): Llama 3's 128K phase ran 405B at tp 8 x cp 16 x pp 16.
GRIDS = {"llama3_70b": ("tp8xcp4", (1, 2, 4, 8)), "llama3_405b": ("tp8xcp16", (1, 4, 8, 16))}


def bubble(schedule: str, p: int, m: int, v: int) -> float:
    """The idle fraction of a step: GPipe and 1F1B ``(p - 1) / (m + p - 1)``; interleaved
    ``(p - 1) / (v m + p - 1)``; zero bubble a third of interleaved's."""
    if p == 1:
        return 0.0
    if schedule in ("GPipe", "1F1B"):
        return (p - 1) / (m + p - 1)
    interleaved = (p - 1) / (v * m + p - 1)
    return interleaved / 3 if schedule == "ZeroBubble" else interleaved


def in_flight(schedule: str, p: int, m: int, v: int) -> float:
    """Micro-batches whose checkpoints the first rank holds at once (see the module's docstring)."""
    if schedule == "GPipe" or p == 1:
        return m if p > 1 else 1
    base = min(m, p)
    return base if schedule == "1F1B" else base * (1 + (p - 1) / (p * v))


@dataclass
class PipelineRow:
    model: str
    layout: str
    pp: int
    gpus: int
    layers_per_rank: float
    memory_gib: dict
    p2p_gb: dict
    seconds: dict
    bubble: dict


def evaluate(m: ModelShape, stage_layout: str, p: int, micro: int, a: Assumptions) -> PipelineRow:
    """One ``pp`` size: the worst rank's memory (GiB) under each schedule, the p2p bytes a step
    (GB) and their seconds, and the step's seconds under each schedule."""
    lay = parse_layout(stage_layout)
    ls, params, mem = local_shape(m, lay, a), local_params(m, lay, a), memory(m, lay, a)
    per_rank = math.ceil(m.layers / p)  # the worst rank: an uneven split gives the first stages one more
    state = a.state_bytes * (per_rank * params.layer_dense + max(params.embed, params.head)) / lay.fsdp
    work = mem["peak"] - mem["state"] - mem["gathered"] - mem["checkpoints"]  # max(one layer, the loss)
    layer_ckpt = per_rank * ls.tokens * m.hidden * a.act_bytes
    v = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "ZeroBubble": 2}
    memory_gib = {s: (state + mem["gathered"] + in_flight(s, p, micro, v[s]) * layer_ckpt + work) / GiB
                  for s in ("GPipe", "1F1B", "Interleaved1F1B")}
    memory_gib["state"] = state / GiB
    memory_gib["checkpoints_1f1b"] = in_flight("1F1B", p, micro, 1) * layer_ckpt / GiB
    sent = communication(m, lay, a)
    one = seconds(m, lay, a, sent)  # one sequence through the whole model, every axis but pp
    t = (one["compute"] + one["tp"] + one["cp"]) * per_rank / m.layers  # the worst rank's share
    p2p = {s: (micro * v[s] * 4 * ls.tokens * m.hidden if p > 1 else 0) / GB for s in ("1F1B", "Interleaved1F1B")}
    secs = {s: micro * t / (1 - bubble(s, p, micro, v[s])) for s in v}
    secs["p2p_1f1b"] = p2p["1F1B"] / a.inter_gbps if p > 1 else 0.0
    secs["fsdp"] = micro * one["fsdp"] * per_rank / m.layers  # reshard after forward: every micro-batch gathers its stage again
    secs["micro_batch_stage"] = t
    return PipelineRow(m.name, f"pp{p}x{stage_layout}" if p > 1 else stage_layout, p, p * lay.world,
                       per_rank, memory_gib, p2p, secs, {s: bubble(s, p, micro, v[s]) for s in v})


def render(rows: list[PipelineRow], micro: int) -> str:
    head = ["layout", "GPUs", "layers/rank", "state", "ckpt in flight (1F1B)", "peak GPipe", "peak 1F1B",
            "peak interleaved", "p2p GB (1F1B)", "p2p s", "bubble 1F1B / interleaved / ZB", "step s 1F1B",
            "step s interleaved", "step s ZB", "FSDP s"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        g, s = r.memory_gib, r.seconds
        cells = [r.layout, str(r.gpus), str(r.layers_per_rank), f"{g['state']:.1f}", f"{g['checkpoints_1f1b']:.1f}",
                 f"{g['GPipe']:.1f}", f"{g['1F1B']:.1f}", f"{g['Interleaved1F1B']:.1f}", f"{r.p2p_gb['1F1B']:.1f}",
                 f"{s['p2p_1f1b']:.2f}", " / ".join(f"{r.bubble[k]:.2f}" for k in ("1F1B", "Interleaved1F1B",
                                                                                "ZeroBubble")),
                 f"{s['1F1B']:.1f}", f"{s['Interleaved1F1B']:.1f}", f"{s['ZeroBubble']:.1f}", f"{s['fsdp']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return f"### {rows[0].model}, S = 131,072, m = {micro} micro-batches a step (memory in GiB per rank)\n\n" + \
        "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--microbatches", type=int, default=16, help="micro-batches (sequences) a step per replica")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    a = Assumptions()
    tables = {k: [evaluate(MODELS[k], GRIDS[k][0], pp, args.microbatches, a) for pp in GRIDS[k][1]] for k in MODELS}
    if args.json:
        print(json.dumps({"assumptions": asdict(a), "microbatches": args.microbatches,
                          "rows": {k: [asdict(r) for r in rows] for k, rows in tables.items()}}, indent=1))
    else:
        print("\n\n".join(render(rows, args.microbatches) for rows in tables.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
