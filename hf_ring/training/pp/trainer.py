"""``RingTrainer``'s training step, evaluation, gradient clipping and saving under pipeline
parallelism.

What changes against ``pp_size == 1``, and why:

- the model is cut into this rank's stages (``plugin.make_pipeline``: pruned in place, its
  parameters keep their names) before the optimizer exists, and the Accelerator prepares it
  without DDP (``hf_ring.patches.accelerate.keep_model_unwrapped``): DDP over the world
  would average gradients across stages that hold different layers;
- a training step (one of the Trainer's accumulation micro-steps) is one
  ``PipelineRunner.step`` over its batch, cut into ``pp_microbatches``: the forwards,
  backwards and sends are PyTorch's schedule's. The loss on the last stage is each
  micro-batch's token-loss sum over the step's valid tokens (``num_items_in_batch``, counted
  over the stage's dp x cp ranks), so the shares add up to one process's loss. At the
  step's last micro-step the gradients are summed over the stage's dp x cp ranks only;
- the loss the Trainer logs: the step's loss summed over the world, so every rank returns
  one process's value and the Trainer's mean over processes is that value;
- the gradient norm (what the Trainer logs as ``grad_norm`` and clips by): over every stage,
  through the Accelerator's ``clip_grad_norm_``, which the Trainer calls (a stage's own norm
  would clip each stage apart);
- evaluation: each batch forward only through the schedule (``schedule.eval``), the last
  stage's token-loss sum handed to every stage over the ``pp`` group, so that every rank
  records the CP group's batch loss as at ``pp_size == 1``;
- the chunked loss (``RingTrainer(chunked_loss=...)``; by default on under CP, as at
  ``pp_size == 1``) is computed by the last stage inside its LM head's call, which returns the
  micro-batch's token-loss sum instead of the logits (``hf_ring.pipeline.stages``);
- gradient checkpointing is the Trainer's own (``gradient_checkpointing=True`` turns it on in
  the pruned model's decoder layers, which the stages share): each layer is recomputed in
  its stage's backward, its ring with it;
- padded rows are filled to a multiple of ``pp_microbatches`` with copies of the batch's
  first row that carry no label (no token of the loss); packed rows come filled from
  :class:`~hf_ring.training.pp.collator.PipelineDataCollator`;
- ``save_model``: the stages' weights gathered to the first process, written as one whole
  model that ``from_pretrained`` loads in one process (a checkpoint's model too; its
  optimizer states and resuming: ``hf_ring.training.pp.checkpoint``);
- with ``RingAttentionPlugin(pp_fsdp=True)`` each stage is sharded by FSDP2 over its own dp x
  cp ranks (``hf_ring.pipeline.fsdp``): its reduce-scatter sums the gradients at the end of
  every schedule step, so nothing is left to reduce at the last micro-step; the norm sums
  the shards' squares, and saving gathers each weight whole first.

Must not import TRL or ``hf_ring.training.trainer``.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hf_ring.patches import accelerate as accelerate_patches
from hf_ring.pipeline import clip_pipeline_grad_norm_, reduce_stage_gradients
from hf_ring.sharding.labels import IGNORE_INDEX


def fill_rows(batch: dict[str, Any], multiple: int) -> dict[str, Any]:
    """``batch`` (padded rows along dim 0) with copies of its first row appended, their
    ``shift_labels`` all ignored, up to a multiple of ``multiple`` rows."""
    rows = batch["input_ids"].shape[0]
    extra = -rows % multiple
    if extra == 0 or batch.get("doc_bounds") is not None:
        return batch
    filled = dict(batch)
    for key in ("input_ids", "position_ids", "shift_labels", "labels"):
        if key in batch:
            pad = batch[key][:1].expand(extra, *batch[key].shape[1:])
            if key in ("shift_labels", "labels"):
                pad = torch.full_like(pad, IGNORE_INDEX)
            filled[key] = torch.cat([batch[key], pad])
    return filled


class TrainerPipeline:
    """This rank's stages of ``trainer.model`` and the schedule, wired into the Trainer.

    Args:
        trainer: a ``RingTrainer`` under ``RingAttentionPlugin(pp_size > 1)``, constructed (its
            Accelerator and ring state built, its refusals checked), not yet trained.
    """

    def __init__(self, trainer: Any):
        self.state = trainer.ring_state
        if trainer.loss_mean != "tokens":
            raise NotImplementedError(
                f"{type(trainer).__name__} with pipeline parallelism trains the token mean over the step "
                f"(loss_mean='tokens'), not loss_mean={trainer.loss_mean!r}: pass loss_mean='tokens', or use pp_size=1")
        self.model = trainer.model
        # The trainer's rule (on under CP or TP unless set), so the last stage chunks as one process would.
        chunked = trainer.chunked_loss
        self.chunked_loss = chunked if chunked.active(self.state.cp_size, self.state.tp_size) else None
        self.runner = trainer.ring_plugin.make_pipeline(self.model, chunked_loss=self.chunked_loss)
        self.sharded = bool(getattr(trainer.ring_plugin, "pp_fsdp", False))  # FSDP2 inside each stage
        accelerate_patches.keep_model_unwrapped(trainer.accelerator, self.model)
        trainer.accelerator.clip_grad_norm_ = self.clip_grad_norm_

    def describe(self) -> str:
        r = self.runner
        return (f"pipeline: {r.schedule_name}, {r.num_stages} stages (this rank: {sorted(r.stages)}, layers "
                f"{[r.ranges[s] for s in sorted(r.stages)]}), {r.n_microbatches} micro-batches a step"
                + (f", FSDP2 over each stage's {self.state.loss_size} dp x cp ranks" if self.sharded else "")
                + (", the loss chunked on the last stage (no logits)" if self.chunked_loss is not None
                   else ", the loss from the last stage's logits"))

    def _mode(self, training: bool) -> None:
        for stage in self.runner.stages.values():
            stage.train(training)

    def train_step(self, inputs: dict[str, Any], num_items_in_batch: torch.Tensor, sync: bool) -> torch.Tensor:
        """One accumulation micro-step through the schedule; at the step's last (``sync``) the
        gradients summed over the stage's dp x cp ranks. Returns the micro-step's loss (its
        share of one process's step loss), the same on every rank."""
        self._mode(True)
        share = self.runner.step(fill_rows(inputs, self.runner.n_microbatches), num_items_in_batch)
        if sync:
            reduce_stage_gradients(self.model.parameters(), self.state)
        device = inputs["input_ids"].device
        loss = share.detach().float() if share is not None else torch.zeros((), dtype=torch.float32, device=device)
        dist.all_reduce(loss)  # the last stage's shares over its dp x cp ranks; 0 from the other stages
        return loss

    def eval_token_sum(self, inputs: dict[str, Any]) -> torch.Tensor:
        """The float32 sum of this CP shard's token losses over ``inputs`` (forward only), the
        same on every stage (collective over the ``pp`` group)."""
        self._mode(False)
        with torch.no_grad():
            token_sum = self.runner.evaluate(fill_rows(inputs, self.runner.n_microbatches))
        if token_sum is None:
            token_sum = torch.zeros((), dtype=torch.float32, device=inputs["input_ids"].device)
        dist.all_reduce(token_sum, group=self.state.mesh.group("pp"))
        return token_sum

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                        norm_type: float = 2) -> torch.Tensor:
        """The Accelerator's ``clip_grad_norm_`` under PP: the whole model's 2-norm (every stage),
        each gradient scaled by the same factor (collective over the ``pp`` group)."""
        if norm_type != 2:
            raise NotImplementedError(f"the gradient norm over pipeline stages is the 2-norm, not norm_type={norm_type}")
        return clip_pipeline_grad_norm_(parameters, max_norm, self.state)

    def save(self, trainer: Any, output_dir: Optional[str]) -> None:
        """One whole model in ``output_dir`` (default: the run's), loadable with ``from_pretrained``
        in one process: every stage's weights gathered to the first process, which writes them
        with the model's config (and the training arguments, the tokenizer where the Trainer
        holds one). Call on every rank."""
        output_dir = output_dir if output_dir is not None else trainer.args.output_dir
        pp_group = self.state.mesh.group("pp")
        rank = dist.get_rank()
        # Under FSDP2 inside the stages each weight is whole once gathered over its stage's ranks (collective).
        own = {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
               for name, t in self.model.state_dict().items()}
        if 0 in dist.get_process_group_ranks(pp_group):  # one rank of each stage: the first's dp x cp x tp block
            gathered: Optional[list] = [None] * dist.get_world_size(pp_group) if rank == 0 else None
            dist.gather_object(own, gathered, dst=0, group=pp_group)
            if rank == 0:
                whole: dict[str, torch.Tensor] = {}
                for part in gathered:
                    whole.update(part)
                self._check_whole(whole)
                os.makedirs(output_dir, exist_ok=True)
                self.model.save_pretrained(output_dir, state_dict=whole)
                torch.save(trainer.args, os.path.join(output_dir, "training_args.bin"))
                if getattr(trainer, "processing_class", None) is not None:
                    trainer.processing_class.save_pretrained(output_dir)
        dist.barrier()

    def _check_whole(self, whole: dict[str, torch.Tensor]) -> None:
        layers = len(self.model.base_model.layers)
        missing = [i for i in range(layers) if not any(f"layers.{i}." in name for name in whole)]
        if missing or not any("lm_head" in name for name in whole):
            raise RuntimeError(f"the gathered stages lack decoder layers {missing} or the LM head: "
                               "the model was not saved")


__all__ = ["TrainerPipeline", "fill_rows"]
