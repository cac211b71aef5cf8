"""Model-state bytes per rank (parameters + gradients + optimizer states) against the number
of ranks, for DDP, FSDP2 and DeepSpeed ZeRO-3; and the projection for Llama-3-8B shapes.

Measured: a spawned gloo world of N processes (N = 1, 2, 4 by default) trains the example's
default model (examples/finetune_llama_long.py: Llama, hidden 128, 2 layers, 8/4 heads,
259-token vocabulary; float32, torch AdamW) for one step under each strategy, then each rank
counts the bytes of the storages it actually holds, each storage once (views, flat buffers
and aliases are deduplicated by storage), after the optimizer step and before the gradients
are cleared:

- DDP: ``DistributedDataParallel(gradient_as_bucket_view=True)``, so that the gradients ARE
  the reducer's buckets (otherwise DDP keeps a second, invisible copy);
- FSDP2: ``torch.distributed.fsdp.fully_shard`` on every decoder layer and on the root,
  over all N ranks; the local shards of the DTensors;
- ZeRO-3: ``deepspeed.initialize`` (stage 3, torch AdamW as a client optimizer): the
  parameter partitions, the gradient partitions, the fp32 master partitions (the same
  storage as the parameters' when they are float32 already) and AdamW's moments.

Under context parallelism the N ranks are the whole dp x cp world: hf_ring shards (and
reduces) over all of them, so these figures hold for dp x cp = N.

Projected (``project``): bytes per parameter for mixed-precision AdamW training,
``bf16`` weights for compute with ``fp32`` master weights and moments, and the per-rank
model state for Llama-3-8B shapes at 8, 16, 64 ranks. Assumptions (stated in the JSON):
DDP keeps bf16 parameters and gradients plus fp32 master weights and AdamW's two moments
on every rank (2+2+4+4+4 = 16 bytes per parameter); FSDP2 (Accelerate's mixed precision:
fp32 sharded parameters, fp32-reduced sharded gradients, moments sharded) and ZeRO-3
(bf16 parameter and gradient partitions, fp32 master and moment partitions) hold 16 / N
bytes per parameter. Transient buffers (one layer's gathered parameters, communication
buckets, activations) are not model state and are not counted.

    python benchmarks/model_state_memory.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STRATEGIES = ("ddp", "fsdp2", "zero3")
# Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json): untied embeddings, GQA 32/8 heads.
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
# Bytes per parameter of mixed-precision AdamW training (see the module docstring).
BYTES_PER_PARAM = {
    "ddp": {"bf16 params": 2, "bf16 grads": 2, "fp32 master": 4, "fp32 adam m": 4, "fp32 adam v": 4},
    "fsdp2": {"fp32 params": 4, "fp32 grads": 4, "fp32 adam m": 4, "fp32 adam v": 4},
    "zero3": {"bf16 params": 2, "bf16 grads": 2, "fp32 master": 4, "fp32 adam m": 4, "fp32 adam v": 4},
}
# hidden_size ** 2, what the HF Trainer's "auto" gives DeepSpeed's reduce bucket.
REDUCE_BUCKET = 128 * 128
SHARDED = {"ddp": False, "fsdp2": True, "zero3": True}


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int = 259
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    tie_word_embeddings: bool = False

    def num_parameters(self) -> int:
        """Parameters of a Llama of this shape (no biases; RMSNorm weights)."""
        head_dim = self.hidden_size // self.num_attention_heads
        attn = 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size * self.num_key_value_heads * head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        layer = attn + mlp + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embeddings + self.hidden_size


def project(shape: ModelShape, ranks: list[int]) -> dict:
    """Model-state bytes per rank of ``shape`` under each strategy at each number of ranks."""
    params = shape.num_parameters()
    rows = []
    for strategy in STRATEGIES:
        per_param = sum(BYTES_PER_PARAM[strategy].values())
        for n in ranks:
            per_rank = per_param * params / (n if SHARDED[strategy] else 1)
            rows.append({"strategy": strategy, "ranks": n, "bytes_per_param": per_param,
                         "bytes_per_rank": per_rank, "gib_per_rank": per_rank / 2**30})
    return {"shape": asdict(shape), "num_parameters": params, "assumptions": BYTES_PER_PARAM, "rows": rows}


# ---- measurement, in each spawned rank ----


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(tensors, seen: set[int]) -> int:
    """Bytes of the storages of ``tensors`` not in ``seen`` (added to it); freed storages weigh 0."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _model(shape: ModelShape) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**asdict(shape), attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(config)


def _other_tensor_bytes(seen: set[int]) -> int:
    """Bytes of every other tensor storage the process's Python objects reach (buffers such as
    RoPE's, the batch, communication buffers): a check that nothing large went uncounted."""
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on some objects of other libraries warns
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor):
                    found.append(obj)
            except ReferenceError:
                continue
    return _storage_bytes(found, seen)


def _step(strategy: str, model: torch.nn.Module, batch: torch.Tensor, world: int) -> dict:
    """One AdamW step of ``model`` under ``strategy``; the model-state tensors by kind."""
    if strategy == "zero3":
        import deepspeed

        from hf_ring.patches import deepspeed as deepspeed_patches

        # stage3_param_persistence_threshold 0: every parameter is partitioned. DeepSpeed's
        # default keeps parameters under 1e5 elements whole on every rank, which is all of
        # this tiny model but only the norms (0.003%) of Llama-3-8B. Buckets as the HF
        # Trainer's "auto" sizes them (DeepSpeed's default reduce bucket is 5e8 elements:
        # 2 GB in float32 on every rank, for any model).
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                        "reduce_bucket_size": REDUCE_BUCKET, "stage3_prefetch_bucket_size": REDUCE_BUCKET},
                  "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                          config=config)
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()
        return deepspeed_patches.zero3_model_state(engine)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    params = list(model.parameters())
    return {"parameters": params, "gradients": [p.grad for p in params], "optimizer": _optimizer_tensors(optimizer),
            "_keep": [wrapped, optimizer]}


def _measure(rank: int, world: int, strategies: list[str], shape: ModelShape, seq_len: int) -> dict:
    """Each strategy in turn in this world; only one strategy's objects are alive at a time."""
    if "zero3" in strategies:
        import deepspeed

        from hf_ring.patches import deepspeed as deepspeed_patches

        deepspeed_patches.skip_cpu_shm_comm_build()  # no C++ op build (see patches/deepspeed.py)
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    results = {}
    for strategy in strategies:
        torch.manual_seed(0)
        model = _model(shape)
        elements = sum(p.numel() for p in model.parameters())
        batch = torch.randint(0, shape.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(rank))
        state = _step(strategy, model, batch, world)
        seen: set[int] = set()
        row = {kind: _storage_bytes(state[kind], seen) for kind in ("parameters", "gradients", "optimizer")}
        row["other_tensors"] = _other_tensor_bytes(seen)
        row["parameter_elements"] = elements
        results[strategy] = row
        del model, state, batch
        gc.collect()
        dist.barrier()
    return results


def _entry(rank: int, world: int, init_file: str, strategies: list[str], shape: ModelShape, seq_len: int,
           out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(_measure(rank, world, strategies, shape, seq_len), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def measure(strategies: list[str], world: int, shape: ModelShape, seq_len: int = 64) -> dict[str, list[dict]]:
    """Each rank's model-state bytes after one step of each strategy over ``world`` ranks (one
    spawned world for all strategies), by strategy, in rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world, os.path.join(tmp, "rendezvous"), list(strategies), shape, seq_len, tmp),
                 nprocs=world, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    out = {}
    for strategy in strategies:
        rows = [r[strategy] for r in ranks]
        for row in rows:
            row["model_state"] = row["parameters"] + row["gradients"] + row["optimizer"]
        out[strategy] = rows
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    ap.add_argument("--project-ranks", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--out", default=None, help="folder for model_state_memory.json and .png")
    args = ap.parse_args(argv)

    shape = ModelShape()
    measured = []
    print(f"measured: the example's default model, {shape.num_parameters()} parameters, float32, AdamW")
    print(f"{'strategy':8} {'ranks':>5} {'params B':>10} {'grads B':>10} {'optim B':>10} {'total B/rank':>13} {'x 1 rank':>9} {'other B':>9}")
    worlds = {n: measure(args.strategies, n, shape) for n in args.ranks}
    for strategy in args.strategies:
        base = None
        for n in args.ranks:
            ranks = worlds[n][strategy]
            worst = max(ranks, key=lambda r: r["model_state"])
            base = base or worst["model_state"]
            row = {"strategy": strategy, "ranks": n, **{k: worst[k] for k in ("parameters", "gradients", "optimizer", "other_tensors")},
                   "model_state_bytes": worst["model_state"], "per_rank": [r["model_state"] for r in ranks],
                   "fraction_of_one_rank": worst["model_state"] / base}
            measured.append(row)
            print(f"{strategy:8} {n:5d} {row['parameters']:10d} {row['gradients']:10d} {row['optimizer']:10d} "
                  f"{row['model_state_bytes']:13d} {row['fraction_of_one_rank']:9.3f} {row['other_tensors']:9d}")
    projection = project(ModelShape(**LLAMA3_8B), args.project_ranks)
    print(f"projected: Llama-3-8B shapes, {projection['num_parameters']} parameters, mixed-precision AdamW")
    for row in projection["rows"]:
        print(f"{row['strategy']:8} {row['ranks']:5d} ranks: {row['bytes_per_param']} B/param -> "
              f"{row['gib_per_rank']:8.2f} GiB per rank")
    result = {"measured_model": {**asdict(shape), "num_parameters": shape.num_parameters(), "dtype": "float32"},
              "measured": measured, "projection": projection}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "model_state_memory.json"), "w") as f:
            json.dump(result, f, indent=1)
        _plot(measured, os.path.join(args.out, "model_state_memory.png"))
    return result


def _plot(measured: list[dict], path: str) -> None:
    from plotting import new_axes, save

    fig, ax = new_axes()
    for strategy in sorted({r["strategy"] for r in measured}):
        rows = [r for r in measured if r["strategy"] == strategy]
        ax.plot([r["ranks"] for r in rows], [r["model_state_bytes"] / 2**20 for r in rows], marker="o", label=strategy)
    ax.set_xticks(sorted({r["ranks"] for r in measured}))
    save(fig, ax, path, "Model state per rank (params + grads + AdamW), tiny Llama, fp32",
         "ranks (dp x cp)", "MiB per rank (largest rank)")


if __name__ == "__main__":
    main()
