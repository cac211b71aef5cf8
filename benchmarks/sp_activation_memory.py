"""Per-rank activation memory of sequence parallelism inside TP, against TP alone and CP alone.

Four gloo processes on CPU, one forward and backward of a small Llama (float32) on one row,
its loss chunked (``model_token_loss_sum``, as RingTrainer computes it beside TP) so that no
rank holds the whole logits and what is measured is the decoder's:

- ``cp4``: context parallelism over the 4 ranks (each holds 1/4 of the tokens, every weight);
- ``tp2_cp2``: transformers' ``DistributedConfig(tp_size=2, fsdp_size=2)`` beside CP 2
  (each TP rank holds the whole half of the row that its CP rank holds);
- ``tp2_cp2_sp``: the same with ``hf_ring.enable_sequence_parallel`` (each TP rank keeps a
  quarter of the row between the TP blocks).

Each with and without gradient checkpointing. Per rank: the bytes saved for the backward
(every storage packed by autograd during the forward, the weights' left out: a
deterministic count), the peak resident memory above where it stood before the step
(``/proc/self/clear_refs`` and ``VmHWM``: noisy, allocator included), the step's seconds
(4 processes on this machine's cores: compare within one run only) and the loss, which
every configuration must agree on. Prints one JSON line per configuration and rank.
Must not import hf_ring's training layer.

    python benchmarks/sp_activation_memory.py --tokens 4096 > benchmarks/results/sp_activation_memory.jsonl
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _param_storages(model: torch.nn.Module) -> set[int]:
    """The storages of ``model``'s weights as registered now (FSDP2's unsharded ones inside a forward)."""
    ptrs = set()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        ptrs.add(local.untyped_storage().data_ptr())
    return ptrs


def _measure(model: torch.nn.Module, step) -> dict:
    """Run ``step()`` (forward and backward, returns the loss) once, counting what it saves."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        if storage.data_ptr() not in _param_storages(model):
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    seconds = time.perf_counter() - start
    return {"saved_mib": sum(saved.values()) / 2**20, "peak_growth_mib": (_status_kib("VmHWM") - before) / 1024,
            "seconds": seconds, "loss": loss}


def _rank(rank: int, world: int, init: str, path: str, tokens: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import hf_ring
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from hf_ring.memory.chunked_loss import ChunkedLossConfig, model_token_loss_sum
    from hf_ring.sharding import shard_sequence

    ids = torch.randint(0, 2048, (1, tokens), generator=torch.Generator().manual_seed(0))
    shift = torch.full_like(ids, -100)
    shift[:, :-1] = ids[:, 1:]
    load = dict(attn_implementation="ring_flash", dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(path, **load)
    tp = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2),
                                              **load)
    rows = []
    for name, model, cp, tp_size in (("cp4", plain, 4, 1), ("tp2_cp2", tp, 2, 2), ("tp2_cp2_sp", tp, 2, 2)):
        state = hf_ring.setup_context_parallel(cp_size=cp, tp_size=tp_size)
        if name.endswith("_sp"):
            hf_ring.enable_sequence_parallel(model)

        def shard(t: torch.Tensor) -> torch.Tensor:
            return shard_sequence(t, cp, state.cp_rank, dim=1, layout=state.layout)

        inputs = dict(input_ids=shard(ids), position_ids=shard(torch.arange(tokens)[None]))
        count = (shift != -100).sum()

        def step() -> float:
            model.zero_grad(set_to_none=True)
            local, _ = model_token_loss_sum(model, model, inputs, shard(shift), ChunkedLossConfig(True))
            (local / count).backward()
            total = local.detach().clone()
            dist.all_reduce(total, group=state.cp_group)
            return total.item() / count.item()

        for checkpointing in (False, True):
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                model.train()
            else:
                model.gradient_checkpointing_disable()
                model.eval()
            step()  # warm-up: the allocator's first growth is not the step's
            rows.append({"config": name, "checkpointing": checkpointing, "rank": rank, "tokens": tokens,
                         "tokens_per_rank_between_blocks": tokens // cp // (2 if name.endswith("_sp") else 1),
                         **_measure(model, step)})
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                                     num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                     max_position_embeddings=args.tokens)).save_pretrained(f"{tmp}/model")
        mp.spawn(_rank, args=(WORLD, f"file://{tmp}/init", f"{tmp}/model", args.tokens, f"{tmp}/out"),
                 nprocs=WORLD, join=True)
        for rank in range(WORLD):
            with open(f"{tmp}/out.{rank}") as f:
                for row in json.load(f):
                    print(json.dumps({**row, "hidden": args.hidden, "layers": args.layers}))
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown after the results are out


if __name__ == "__main__":
    main()
