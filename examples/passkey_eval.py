"""A Trainer callback that answers passkey prompts by generation at every evaluation: the
long-context retrieval check, at the trained length, during training.

Under context parallelism every rank of the CP group runs the callback (callbacks run on
every process), so every rank calls ``model.generate`` on the same prompt together: the
prompt is prefilled by the ring into a sharded cache and the answer decoded against every
rank's shard (hf_ring's generation, docs/generation.md), and every rank gets the answer
one process gets. Logged with the evaluation's step: ``eval_passkey_accuracy`` (answers
exactly right) and ``eval_passkey_token_accuracy`` (answer tokens right), the same figures
at any cp size.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

IGNORE_INDEX = -100


class PasskeyGenerationEval(TrainerCallback):
    """At every evaluation, greedy answers to ``examples`` (rows of a passkey dataset:
    ``input_ids`` with the answer at the end, ``labels`` -100 on the prompt)."""

    def __init__(self, examples: list[dict[str, list[int]]]) -> None:
        self.cases = []
        for row in examples:
            prompt = [t for t, label in zip(row["input_ids"], row["labels"]) if label == IGNORE_INDEX]
            self.cases.append((torch.tensor([prompt]), torch.tensor(row["input_ids"][len(prompt):])))

    def on_evaluate(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        exact, right, total = 0, 0, 0
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for prompt, answer in self.cases:
                prompt = prompt.to(model.device)
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=len(answer),
                                     min_new_tokens=len(answer), do_sample=False, use_cache=True)
                got = out[0, prompt.shape[1]:].cpu()
                exact += int(torch.equal(got, answer))
                right += int((got == answer).sum())
                total += len(answer)
        model.train(was_training)
        state.log_history.append({"eval_passkey_accuracy": exact / len(self.cases),
                                  "eval_passkey_token_accuracy": right / total, "step": state.global_step})
