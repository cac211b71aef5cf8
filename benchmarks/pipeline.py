"""Pipeline parallelism: the bubble of PyTorch's schedules against their formulas, and a step's
time and peak memory per rank at pp 2 x cp 2 against cp 4 and pp 1 (one process).

Two parts:

- ``bubble``: ``pp`` gloo processes run ``hf_ring.pipeline``'s schedules (PyTorch's) over
  stages whose layers sleep ``t`` in the forward, ``t`` for the input gradient and ``t`` for
  the weight gradient (``Sleeper``), so what is timed is the schedule's order, not the
  machine's load (a sleep takes no core). Measured bubble: ``1 - m x (work of one rank per
  micro-batch) / step time``; it includes the schedule's own overhead (gloo sends, Python)
  per action. Formulas (idealised, no overhead): GPipe and 1F1B ``(p - 1) / (m + p - 1)``;
  interleaved 1F1B and looped BFS with ``v`` stages a rank ``(p - 1) / (v m + p - 1)``; the zero-bubble schedules fill the bubble with weight
  gradients: about a third of interleaved 1F1B's with ``t_F = t_B = t_W`` (ZB-H1's rule).
- ``step``: the example's default Llama shape (tiny by default) trained one step on 4
  processes at pp 2 x cp 2 (1F1B, 2 micro-batches) and at cp 4, and on 1 process at cp 1:
  the step's wall time and each rank's peak resident memory (``ru_maxrss``). On a 2-core
  CPU shared by 4 processes the times measure the machine more than the method; the
  memory is each rank's.

    .venv/bin/python benchmarks/pipeline.py bubble [--pp 4 --microbatches 8 --t 0.01]
    .venv/bin/python benchmarks/pipeline.py step [--seq 2048 --layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

FORMULA = {
    "GPipe": lambda p, m, v: (p - 1) / (m + p - 1),
    "1F1B": lambda p, m, v: (p - 1) / (m + p - 1),
    "Interleaved1F1B": lambda p, m, v: (p - 1) / (v * m + p - 1),
    "LoopedBFS": lambda p, m, v: (p - 1) / (v * m + p - 1),
    "InterleavedZeroBubble": lambda p, m, v: (p - 1) / (3 * (v * m + p - 1)),
    "ZBVZeroBubble": lambda p, m, v: (p - 1) / (3 * (v * m + p - 1)),
}


class _Sleep(torch.autograd.Function):
    """Identity; its forward sleeps ``t_f`` and its backward ``t_b``."""

    @staticmethod
    def forward(ctx, x, t_f, t_b):
        ctx.t_b = t_b
        time.sleep(t_f)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.t_b)
        return grad, None, None


class Sleeper(torch.nn.Module):
    """A stage of ``layers`` layers. Each layer's forward sleeps ``t``; its backward sleeps ``t``
    on the input's path (the input gradient) and ``t`` on the weight's (the weight gradient,
    which the zero-bubble schedules run apart to fill the bubble): ``t_F = t_B = t_W``."""

    def __init__(self, layers: int, t: float):
        super().__init__()
        self.t, self.lin = t, torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))

    def forward(self, x):
        for lin in self.lin:
            x = _Sleep.apply(x, self.t, self.t) + _Sleep.apply(lin.weight, 0.0, self.t).sum() * 0 + lin(x) * 0
        return x


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _bubble_rank(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    from hf_ring.pipeline.schedule import schedule_class, stages_per_rank_of
    from hf_ring.pipeline.split import stages_of_rank

    _init(rank, world, port)
    layers_per_rank = 4
    for name in FORMULA:
        v = stages_per_rank_of(name)
        ids = stages_of_rank(rank, world, v, name == "ZBVZeroBubble")
        stages = [PipelineStage(Sleeper(layers_per_rank // v, args.t), s, world * v, torch.device("cpu"),
                                input_args=torch.empty(args.rows, 8, requires_grad=s > 0),
                                output_args=torch.empty(args.rows, 8, requires_grad=True)) for s in ids]
        cls = schedule_class(name)
        sched = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages, n_microbatches=args.microbatches,
                    loss_fn=lambda y, target: y.sum(), scale_grads=False)
        times = []
        for _ in range(args.repeats):
            x = torch.randn(args.rows * args.microbatches, 8)
            dist.barrier()
            start = time.perf_counter()
            sched.step(*((x,) if 0 in ids else ()), target=x if world * v - 1 in ids else None, return_outputs=False)
            dist.barrier()
            times.append(time.perf_counter() - start)
        step = min(times)
        work = args.microbatches * sum(3 * args.t * len(s.submod.lin) for s in stages)
        if rank == 0:
            out[name] = {"schedule": name, "pp": world, "microbatches": args.microbatches, "stages_per_rank": v,
                         "step_s": round(step, 4), "bubble": round(1 - work / step, 3),
                         "formula": round(FORMULA[name](world, args.microbatches, v), 3)}
    dist.destroy_process_group()


def _step_rank(rank: int, world: int, port: int, args: argparse.Namespace, mode: str, out: dict) -> None:
    import hf_ring
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_ring.training.loss import count_valid_tokens

    _init(rank, world, port)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=args.seq, tie_word_embeddings=False, attn_implementation="ring_flash")
    model = LlamaForCausalLM(config)
    pp = 2 if mode == "pp2_cp2" else 1
    plugin = hf_ring.RingAttentionPlugin(cp_size=world // pp, pp_size=pp, pp_schedule="1F1B", pp_microbatches=2)
    collate = plugin.make_collator(pad_token_id=0)
    features = [{"input_ids": torch.randint(1, args.vocab, (args.seq,)).tolist()} for _ in range(2)]
    batch = collate(features)
    runner = plugin.make_pipeline(model) if pp > 1 else None
    count = plugin.global_token_count(count_valid_tokens(batch["shift_labels"]))
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        if runner is not None:
            runner.step(batch, count)
        else:
            kwargs = {k: batch[k] for k in ("input_ids", "position_ids")}
            logits = model(**kwargs).logits
            (torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["shift_labels"].flatten(),
                                               reduction="sum") / count).backward()
        dist.barrier()
        times.append(time.perf_counter() - start)
        model.zero_grad()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    out[f"{mode}_{rank}"] = {"mode": mode, "rank": rank, "world": world, "seq": args.seq, "layers": args.layers,
                             "step_s": round(min(times), 3), "peak_rss_mib": round(peak, 1)}
    dist.destroy_process_group()


def _spawn(fn, world: int, *args) -> dict:
    out = mp.Manager().dict()
    mp.spawn(fn, args=(world, _free_port(), *args, out), nprocs=world, join=True)
    return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("bubble", "step"))
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--t", type=float, default=0.005, help="bubble: a layer's forward sleep (s)")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--out", default=None, help="append the rows as JSON lines to this file")
    args = parser.parse_args()
    if args.part == "bubble":
        rows = list(_spawn(_bubble_rank, args.pp, args).values())
    else:
        rows = []
        for mode, world in (("pp2_cp2", 4), ("cp4", 4), ("cp1", 1)):
            rows += sorted(_spawn(_step_rank, world, args, mode).values(), key=lambda r: r["rank"])
    for row in rows:
        print(json.dumps(row))
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
