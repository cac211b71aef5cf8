"""Evaluate one tiny Llama on eval batches of different token counts with ``RingTrainer`` (or
the stock ``Trainer``), as tests/test_eval_loss.py compares them.

Launched for cp 2 with ``accelerate launch`` (2 processes); imported by the test for the
one-process runs. Writes rank 0's eval metrics, for padded and packed rows, as JSON, and
each rank's ``predict()`` output on the padded rows (torch.save).

    python tests/eval_loss_run.py CP_SIZE OUT.json
"""

from __future__ import annotations

import gc
import json
import random
import sys
from typing import Optional

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

import hf_ring

# 5 rows of 20 to 250 tokens, eval batch 2: batches of 2, 2 and 1 rows, of different token
# counts; part of each row's labels masked, so the valid counts differ again.
ROWS, EVAL_BATCH, VOCAB, PAD = 5, 2, 64, 0
LENGTHS = (20, 250, 97, 31, 180)


def eval_rows() -> list[dict]:
    rng = random.Random(5)
    rows = []
    for length in LENGTHS:
        ids = [rng.randrange(1, VOCAB) for _ in range(length)]
        masked = rng.randint(0, length // 2)
        rows.append({"input_ids": ids, "labels": [-100] * masked + ids[masked:]})
    return rows


def tiny_llama(attn_implementation: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=PAD, use_cache=False)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).float()


def arguments(out: str) -> TrainingArguments:
    return TrainingArguments(output_dir=out, per_device_eval_batch_size=EVAL_BATCH, use_cpu=True,
                             report_to="none", disable_tqdm=True)


def stock_collate(features: list[dict]) -> dict[str, torch.Tensor]:
    """Right padding, the stock model's own (unshifted) labels."""
    length = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), length), PAD)
    labels = torch.full((len(features), length), -100)
    mask = torch.zeros((len(features), length), dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"]), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _predicted(trainer: Trainer) -> dict:
    """``trainer.predict`` on the eval rows: predictions (logits ``(rows, length, vocab)``),
    label_ids and metrics."""
    output = trainer.predict(eval_rows())
    return {"predictions": torch.as_tensor(output.predictions), "label_ids": torch.as_tensor(output.label_ids),
            "metrics": output.metrics}


def stock_eval(out: str) -> tuple[dict, dict]:
    """The stock Trainer's eval metrics and predict() output."""
    trainer = Trainer(model=tiny_llama(), args=arguments(out), eval_dataset=eval_rows(), data_collator=stock_collate)
    return trainer.evaluate(), _predicted(trainer)


def ring_eval(cp_size: int, out: str, packing: bool) -> tuple[dict, Optional[dict]]:
    """RingTrainer's eval metrics, and its predict() output on padded rows (packed: None at
    cp 1, the refusal's message under CP)."""
    plugin = hf_ring.RingAttentionPlugin(cp_size=cp_size)
    plugin.setup()
    model = tiny_llama("ring_flash" if cp_size > 1 else "sdpa")
    trainer = hf_ring.RingTrainer(model=model, args=arguments(out), eval_dataset=eval_rows(), ring_plugin=plugin,
                                  data_collator=plugin.make_collator(PAD, packing=packing))
    metrics = trainer.evaluate()
    predicted = None if packing else _predicted(trainer)
    if packing and cp_size > 1:
        try:
            trainer.predict(eval_rows())
            predicted = {"refused": "no error"}
        except NotImplementedError as e:  # raised on every rank: each holds the same packed batch
            predicted = {"refused": str(e)}
    trainer.accelerator.free_memory()
    trainer.model_wrapped = trainer.model = None
    gc.collect()
    return metrics, predicted


def main(cp_size: int, out_path: str) -> None:
    """Writes rank 0's eval metrics to ``out_path`` (JSON) and every rank's padded-row
    predict() output to ``out_path.rank{r}.pt``."""
    torch.set_num_threads(1)
    runs = {name: ring_eval(cp_size, out_path + name, packing) for name, packing in (("padded", False),
                                                                                      ("packed", True))}
    rank = torch.distributed.get_rank()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({name: metrics for name, (metrics, _) in runs.items()}, f)
    torch.save({**runs["padded"][1], "packed": runs["packed"][1]}, f"{out_path}.rank{rank}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
