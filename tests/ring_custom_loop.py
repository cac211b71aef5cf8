"""A custom Accelerate training loop with RingAttentionPlugin, as its docstring shows.

Launched by tests/test_trainer_cp.py (``accelerate launch``, or plain python for one
process): trains a tiny Llama for a few SGD steps on prompt-masked rows and writes, from
rank 0, every step's loss (the world's token mean) and the first step's full gradient
(after DDP's average) to the JSON file named by the second argument.

    python tests/ring_custom_loop.py CP_SIZE OUT.json
"""

from __future__ import annotations

import gc
import json
import random
import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_ring
from hf_ring.training.loss import all_reduce_sum, count_valid_tokens, loss_share, scale_for_ddp, token_loss_sum


def _rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = rng.randint(40, 64)
        ids = [rng.randrange(1, 32) for _ in range(length)]
        answer = rng.randint(2, 6)
        rows.append({"input_ids": ids, "labels": [-100] * (length - answer) + ids[-answer:]})
    return rows


def main(cp_size: int, out_path: str) -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    plugin = hf_ring.RingAttentionPlugin(cp_size=cp_size)
    plugin.attach(accelerator)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_flash" if cp_size > 1 else "sdpa")
    loader = DataLoader(_rows(8, seed=1), batch_size=2, collate_fn=plugin.make_collator(pad_token_id=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses, first_grad = [], None
    for batch in loader:
        shift_labels = batch.pop("shift_labels")
        batch.pop("labels")
        logits = model(**batch).logits
        count = plugin.global_token_count(count_valid_tokens(shift_labels))
        share = loss_share(token_loss_sum(logits, shift_labels), count)
        accelerator.backward(scale_for_ddp(share, plugin.world_size))
        if first_grad is None:
            first_grad = torch.cat([p.grad.flatten() for p in model.parameters()]).tolist()
        losses.append(float(all_reduce_sum(share.detach())))
        optimizer.step()
        optimizer.zero_grad()

    if accelerator.is_main_process:
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "first_grad": first_grad}, f)
    # Free the DDP model before the groups (see examples/finetune_llama_long.py's _shut_down).
    accelerator.free_memory()
    del model, optimizer
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
