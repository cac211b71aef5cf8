"""Per-rank memory of the loss beside tensor parallelism: transformers' head against hf_ring's.

transformers' TP splits the LM head's weight by vocabulary rows and all-gathers its output,
so every TP rank holds the whole ``tokens x vocabulary`` logits (and their gradient, and
the cross-entropy's softmax). hf_ring's chunked loss runs in place of that head on the
rank's own rows, a chunk of tokens at a time (``hf_ring/memory/vocab_parallel.py``).

One forward and backward of a small Llama with a large vocabulary, loaded with
``DistributedConfig(tp_size=2)`` on 2 gloo processes (no CP: the head is what is measured),
float32 on CPU: each rank's peak resident memory above where it stood before the step
(Linux: the peak reset through ``/proc/self/clear_refs``, read as ``VmHWM``), for the model's
own logits + cross-entropy and for ``model_token_loss_sum``. Prints one JSON line per
length; the two losses agree (printed too). Must not import hf_ring's training layer.

    python benchmarks/tp_loss_memory.py --tokens 2048 8192 --vocab 32768
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 64


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak_growth_gib(step) -> tuple[float, float]:
    """``(GiB the resident set rose to above its level before the call, the step's loss)``."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    loss = step()
    return (_status_kib("VmHWM") - before) / 2**20, loss


def _rank(rank: int, world: int, init: str, path: str, lengths: list[int], vocab: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import hf_ring  # noqa: F401  (registers ring_flash)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from hf_ring.memory.chunked_loss import ChunkedLossConfig, model_token_loss_sum

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=world),
                                                 attn_implementation="sdpa", dtype=torch.float32)
    rows = []
    for tokens in lengths:
        ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens))
        shift = torch.full_like(ids, -100)
        shift[:, :-1] = ids[:, 1:]

        def gathered() -> float:
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shift.flatten(), reduction="sum")
            loss.backward()
            return loss.item()

        def chunked() -> float:
            model.zero_grad(set_to_none=True)
            loss, _ = model_token_loss_sum(model, model, {"input_ids": ids}, shift, ChunkedLossConfig(True))
            loss.backward()
            return loss.item()

        gathered()  # warm-up: the allocator's first growth is not the step's
        full_gib, full_loss = _peak_growth_gib(gathered)
        chunked_gib, chunked_loss = _peak_growth_gib(chunked)
        rows.append({"rank": rank, "tp": world, "tokens": tokens, "vocab": vocab, "hidden": HIDDEN,
                     "logits_gib": tokens * vocab * 4 / 2**30, "gathered_peak_gib": full_gib,
                     "chunked_peak_gib": chunked_gib, "loss_gathered": full_loss, "loss_chunked": chunked_loss})
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--vocab", type=int, default=32768)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=max(args.tokens))).save_pretrained(f"{tmp}/model")
        mp.spawn(_rank, args=(2, f"file://{tmp}/init", f"{tmp}/model", args.tokens, args.vocab, f"{tmp}/out"),
                 nprocs=2, join=True)
        for rank in range(2):
            with open(f"{tmp}/out.{rank}") as f:
                for row in json.load(f):
                    print(json.dumps(row))
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown after the results are out


if __name__ == "__main__":
    main()
