"""Training step time of a ``ring_flash`` Llama at cp 2, compiled (inductor) against eager,
measured in one run on this machine; graph breaks and recompiles counted alongside.

Two gloo ranks on the CPU (one thread each) run the same model twice from the same
weights: eagerly, and through ``torch.compile`` (inductor), where each attention layer's
ring is one custom op (hf_ring/hf/compiled.py). Per mode: the first step (the compile,
for the compiled one) and the median of ``--steps`` steps after it, forward and backward,
the slowest rank's. Beside them:

- graph breaks (``torch._dynamo.explain``) of the cp-2 ring_flash model and of the stock
  ``sdpa`` model in one process, for ``--layers`` and twice as many layers: what grows
  with the layers is a break per layer;
- recompiles across packed steps whose document lengths all differ (graphs compiled
  after each step, by a counting backend around inductor).

Run: ``python benchmarks/compile_step.py --out benchmarks/results/compile_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Packed rows of --seq tokens at cp 2, four steps of other document lengths (multiples of 4).
PACKED_FRACTIONS = ([0.25, 0.5, 0.25], [0.125, 0.375, 0.375, 0.125], [0.625, 0.375], [0.5, 0.25, 0.125, 0.125])


def _config(args: argparse.Namespace, layers: int):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=4, vocab_size=1024,
                       max_position_embeddings=args.seq, pad_token_id=0, bos_token_id=2, eos_token_id=1)


def _model(config, impl: str, state_dict=None):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=impl).float().train()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


class _Counter:
    """A backend around inductor that counts the graphs it compiled."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        self.graphs += 1
        return compile_fx(gm, example_inputs)


def _slowest(seconds: float) -> float:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _step(model, ids, positions, extra=None) -> None:
    logits = model(ids, position_ids=positions, **(extra or {})).logits
    logits.float().pow(2).mean().backward()


def _timed(model, params, ids, positions, steps: int) -> tuple[float, float]:
    times = []
    for _ in range(steps + 1):
        params.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        _step(model, ids, positions)
        times.append(_slowest(time.perf_counter() - start))
    return times[0], statistics.median(times[1:])


def _breaks(model, *inputs, **kwargs) -> dict:
    torch._dynamo.reset()
    e = torch._dynamo.explain(model)(*inputs, **kwargs)
    return {"graphs": e.graph_count, "graph_breaks": e.graph_break_count}


def _rank(rank: int, world: int, args: argparse.Namespace, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import hf_ring
    from hf_ring.sharding import shard_packed
    result: dict = {"cp": world, "layers": args.layers, "hidden": args.hidden, "seq": args.seq,
                    "torch": torch.__version__}
    config = _config(args, args.layers)
    state_dict = _model(config, "sdpa").state_dict()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1024, (1, args.seq), generator=g)
    positions = torch.arange(args.seq)[None]

    # Graph breaks: the stock sdpa model in one process (rank 0 alone), then the ring at cp 2.
    if rank == 0:
        for layers in (args.layers, 2 * args.layers):
            result[f"sdpa_cp1_{layers}_layers"] = _breaks(_model(_config(args, layers), "sdpa"), ids,
                                                          position_ids=positions)
    dist.barrier()
    hf_ring.setup_context_parallel(world)
    shard = lambda x: hf_ring.shard_sequence(x, world, rank)  # noqa: E731
    for layers in (args.layers, 2 * args.layers):
        result[f"ring_flash_cp2_{layers}_layers"] = _breaks(_model(_config(args, layers), "ring_flash"), shard(ids),
                                                            position_ids=shard(positions))

    # Step time, eager then compiled, the same weights and shard.
    torch._dynamo.reset()
    eager = _model(config, "ring_flash", state_dict)
    first, median = _timed(eager, eager, shard(ids), shard(positions), args.steps)
    result["eager"] = {"first_step_s": first, "median_step_s": median}
    model = _model(config, "ring_flash", state_dict)
    compiled = torch.compile(model)
    first, median = _timed(compiled, model, shard(ids), shard(positions), args.steps)
    result["compiled"] = {"first_step_s": first, "median_step_s": median}
    result["compiled_over_eager"] = result["compiled"]["median_step_s"] / result["eager"]["median_step_s"]

    # Recompiles across packed steps of other document lengths.
    torch._dynamo.reset()
    counter = _Counter()
    packed = torch.compile(_model(config, "ring_flash", state_dict), backend=counter)
    graphs = []
    for fractions in PACKED_FRACTIONS:
        lens = [int(f * args.seq) for f in fractions]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        doc_positions = torch.cat([torch.arange(n) for n in lens])[None]
        longest = max(lens)
        extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        _step(packed, shard_packed(ids, cu, world, rank), shard_packed(doc_positions, cu, world, rank), extra)
        graphs.append(counter.graphs)
    result["packed_graphs_after_each_step"] = graphs
    result["packed_document_lengths"] = [[int(f * args.seq) for f in fr] for fr in PACKED_FRACTIONS]
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=2048, help="tokens of the full sequence (cp 2: half per rank)")
    p.add_argument("--steps", type=int, default=5, help="timed steps after the first, per mode")
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    from socket import socket
    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, args, port, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    result = queue.get()
    for proc in procs:
        proc.join()
    result["date"] = time.strftime("%Y-%m-%d")
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
