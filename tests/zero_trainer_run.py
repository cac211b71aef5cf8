"""Runs examples/finetune_llama_long.py and also saves the first optimizer step's whole state.

Usage: ``python zero_trainer_run.py DUMP_PATH <the example's arguments>`` (under a launcher
for several processes). Rank 0 writes to DUMP_PATH, with ``torch.save``:

- ``params``: every parameter's whole value before the first update (ZeRO-3 gathers its
  shards), by name: the same ``--seed`` must give the same initial weights;
- ``grads``: every parameter's whole gradient of the first optimizer step, before clipping
  and before the step (ZeRO gathers and all-reduces its partitions);
- ``logits_widths``: the last dimension of the logits of every forward up to then (0 only:
  the chunked loss ran, the full logits never existed).

Without DeepSpeed the gradient is read from ``param.grad`` after the last micro-batch of
the step (the Trainer clips it afterwards); with DeepSpeed the engine's ``step`` (which
Accelerate calls right after each backward, and which clips and updates at an
accumulation boundary) is wrapped to read it just before.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import finetune_llama_long  # noqa: E402

import hf_ring  # noqa: E402


def _full_gradients(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient, by name, gathered from ZeRO's partitions (collective:
    every rank calls it, after the backward of an accumulation boundary, before the step)."""
    from deepspeed.utils import safe_get_full_grad

    return {name: safe_get_full_grad(p).detach().clone() for name, p in engine.module.named_parameters()}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _whole_params(trainer: hf_ring.RingTrainer, model: Any) -> dict[str, torch.Tensor]:
    if trainer.is_deepspeed_enabled:
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in model.module.named_parameters()}
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


class FirstStepDump(hf_ring.RingTrainer):
    dump_path = ""

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        if not hasattr(self, "_first_step"):
            self._first_step = {"params": _whole_params(self, model), "logits_widths": set()}
            widths = self._first_step["logits_widths"]
            model.register_forward_hook(lambda module, args, out: widths.add(out.logits.shape[-1]))
            self._micro_steps = 0
            if self.is_deepspeed_enabled:
                self._wrap_engine_step(model)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._micro_steps += 1
        if (
            not self.is_deepspeed_enabled
            and self._micro_steps == self.args.gradient_accumulation_steps
        ):
            self._save_first_step({n: p.grad.detach().clone() for n, p in self.model.named_parameters()})
        return loss

    def _wrap_engine_step(self, engine: Any) -> None:
        original = engine.step

        def step(*args: Any, **kwargs: Any) -> Any:
            if engine.is_gradient_accumulation_boundary() and "grads" not in self._first_step:
                self._save_first_step(_full_gradients(engine))
                engine.step = original
            return original(*args, **kwargs)

        engine.step = step

    def _save_first_step(self, grads: dict[str, torch.Tensor]) -> None:
        self._first_step["grads"] = grads
        self._first_step["logits_widths"] = sorted(self._first_step["logits_widths"])  # weights_only loads lists
        if _rank() == 0:
            torch.save(self._first_step, self.dump_path)


if __name__ == "__main__":
    FirstStepDump.dump_path = sys.argv[1]
    hf_ring.RingTrainer = FirstStepDump  # the example builds hf_ring.RingTrainer
    finetune_llama_long.main(sys.argv[2:])
