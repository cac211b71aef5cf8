"""What a Ring trainer cannot run under pipeline parallelism yet, refused by name.

Why its own module: the list of what is not composed with the stages stays in one place that
docs/parallelism.md cites, and every refusal is raised at construction on every rank
together (``RingTrainerBase`` runs it through ``raise_together``), before any stage is
built or any rank waits for a peer in a send. What the model itself cannot be cut into
stages for (image-text models, hybrid token mixers, tied embeddings, the MoE router's loss,
expert parallelism) is refused by ``hf_ring.pipeline.refusals`` when the stages are built.

Refused here: a loss of the trainer's own (the TRL trainers), tensor parallelism inside a
stage, TrainingArguments' fsdp or DeepSpeed (FSDP2 inside each stage is the plugin's
``pp_fsdp``), patterns other than the sharded ring, PEFT models, torch.compile, fp16's
gradient scaler, evaluation under ZBVZeroBubble, reentrant gradient checkpointing under the
zero-bubble schedules, collators whose rows the schedule cannot cut, and the checkpoint
options named below. Composed, and so not refused: gradient checkpointing inside a stage
(every layer recomputed in its stage's backward, ring and all) and the chunked loss, computed
by the last stage in its LM head's call; both equal one process's loss and gradients
(tests/test_trainer_pp.py).

Must not import TRL or ``hf_ring.training.trainer``.
"""

from __future__ import annotations

from typing import Any

import transformers

from hf_ring.training import weight_sharding
from hf_ring.training.collator import RingCollatorConfig


# The schedules whose backward PyTorch splits into input- and weight-gradient actions.
_SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble")


def _reentrant(args: Any) -> bool:
    """Whether the Trainer's gradient checkpointing is PyTorch's reentrant one: as its kwargs say,
    else transformers' default (``use_reentrant=True`` before 5.0, False from 5.0)."""
    kwargs = getattr(args, "gradient_checkpointing_kwargs", None) or {}  # 5.x: mirrors activation_checkpointing_kwargs
    if "use_reentrant" in kwargs:
        return bool(kwargs["use_reentrant"])
    return int(transformers.__version__.split(".")[0]) < 5


def _refuse(trainer: Any, what: str, todo: str) -> None:
    pp = trainer.ring_state.mesh.size("pp")
    raise NotImplementedError(f"{type(trainer).__name__} with pipeline parallelism (pp_size={pp}): {what} is not "
                              f"composed with the pipeline stages yet; {todo}")


def check_pipeline_trainer(trainer: Any, subclass_loss: bool) -> None:
    """Raise NotImplementedError for what ``trainer`` (its Accelerator and ring state built, the
    model not yet cut) cannot run under ``pp_size > 1``; nothing when ``pp_size == 1``.
    ``subclass_loss``: the trainer computes its loss its own way (the TRL trainers)."""
    state, args = trainer.ring_state, trainer.args
    if state.mesh.size("pp") == 1:
        return
    if subclass_loss:
        _refuse(trainer, "a loss of the trainer's own (the TRL trainers, a compute_loss override: the schedule runs "
                "RingTrainer's token loss on the last stage)", "train with RingTrainer, or with pp_size=1")
    if state.tp_size > 1:
        _refuse(trainer, f"tensor parallelism inside a stage (tp_size={state.tp_size})", "use tp_size=1 or pp_size=1")
    if getattr(trainer, "is_deepspeed_enabled", False) or weight_sharding.fsdp_requested(args, trainer.accelerator):
        _refuse(trainer, "TrainingArguments' fsdp (Accelerate's FSDP2 mesh: the whole world, across stages holding "
                "other layers) or DeepSpeed", "shard each stage over its own dp x cp ranks with "
                "RingAttentionPlugin(pp_fsdp=True) and no fsdp / deepspeed in TrainingArguments, or use pp_size=1")
    if state.pattern != "ring" or state.placement != "sharded":
        _refuse(trainer, f"pattern={state.pattern!r} / placement={state.placement!r} (checked: the ring, every "
                "document sharded)", "use pattern='ring' and placement='sharded', or pp_size=1")
    model = trainer.model
    if hasattr(model, "peft_config"):
        _refuse(trainer, "a PEFT (LoRA) model", "train the whole model, or use pp_size=1")
    if getattr(args, "torch_compile", False):
        _refuse(trainer, "torch.compile of the stages", "set torch_compile=False, or use pp_size=1")
    schedule = trainer.ring_plugin.pp_schedule
    if schedule in _SPLIT_BACKWARD and getattr(args, "gradient_checkpointing", False) and _reentrant(args):
        # PyTorch's split backward takes the input gradients with torch.autograd.grad, which the
        # reentrant checkpoint refuses (torch 2.14: "incompatible with .grad()").
        _refuse(trainer, f"reentrant gradient checkpointing (use_reentrant=True) under pp_schedule={schedule!r}",
                "pass gradient_checkpointing_kwargs={'use_reentrant': False}, or another schedule")
    if getattr(trainer.accelerator, "scaler", None) is not None:
        _refuse(trainer, "fp16 mixed precision (a gradient scaler)", "use bf16 or float32, or pp_size=1")
    # Checkpoints are composed (hf_ring.training.pp.checkpoint); reloading the best one at the end is not.
    if getattr(args, "load_best_model_at_end", False):
        _refuse(trainer, "load_best_model_at_end (the stock reload of the best checkpoint loads the whole model "
                "into every stage)", "set load_best_model_at_end=False and load the best checkpoint's model "
                "with from_pretrained after training (each checkpoint holds one whole model), or use pp_size=1")
    if getattr(trainer, "eval_dataset", None) is not None and trainer.ring_plugin.pp_schedule == "ZBVZeroBubble":
        _refuse(trainer, "evaluation under ZBVZeroBubble (PyTorch's runs its backward actions in eval too)",
                "train with another schedule (InterleavedZeroBubble evaluates), or without an eval_dataset")
    collator = getattr(trainer.data_collator, "config", None)
    if isinstance(collator, RingCollatorConfig):
        from hf_ring.training.pp.collator import PipelineDataCollator

        if collator.packing and not isinstance(trainer.data_collator, PipelineDataCollator):
            _refuse(trainer, "packed rows from a RingDataCollator (one packed row a batch: the schedule needs one "
                    "a micro-batch)", "build the collator with plugin.make_collator(..., packing=True)")
        if collator.return_attention_mask:
            _refuse(trainer, "an attention_mask (the stages take input_ids, positions and document bounds)",
                    "build the collator with return_attention_mask=False")


__all__ = ["check_pipeline_trainer"]
