"""What ``RingGRPOTrainer`` and ``RingRLOOTrainer`` refuse under context parallelism, and why.

Each refusal is a setting under which the run would not be the run of one process per
data-parallel rank (what cp 1 computes), or one not checked against it yet. Checked from the
config and the constructor's arguments, which are the same on every rank, so every rank
raises the same error before any collective.

Must not import TRL (it reads public config fields only) or accelerate.
"""

from __future__ import annotations

from typing import Any, Callable

# TRL's GRPO loss types whose reduction the CP group reproduces (see hf_ring.training.trl.grpo).
EXACT_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")


def _refuser(trainer: str, cp_size: int) -> Callable[[str, str], None]:
    def refuse(what: str, instead: str) -> None:
        raise NotImplementedError(f"{trainer} under context parallelism (cp_size={cp_size}): {what} is not "
                                  f"supported yet; {instead}")

    return refuse


def check_rollout_config(args: Any, constructor_kwargs: dict[str, Any], cp_size: int, trainer: str) -> None:
    """Raise NotImplementedError / ValueError for what either rollout trainer (named ``trainer``)
    cannot run exactly at ``cp_size > 1``; ``args``: its ``GRPOConfig`` / ``RLOOConfig``,
    ``constructor_kwargs``: the trainer's keywords."""
    refuse = _refuser(trainer, cp_size)
    if args is None:
        raise ValueError(f"{trainer} under context parallelism needs its config passed as args=")
    if args.use_vllm:
        refuse("use_vllm=True (vLLM generation)", "generate with transformers (use_vllm=False), or train at cp_size=1")
    if getattr(args, "use_transformers_continuous_batching", False):
        refuse("use_transformers_continuous_batching=True", "set it to False (transformers' generate is used)")
    for name in ("tools", "rollout_func", "environment_factory"):
        if constructor_kwargs.get(name) is not None:
            refuse(f"{name}= (multi-turn rollouts: their tool masks are not one run of tokens per row)",
                   f"drop {name}=, or train at cp_size=1")
    if (args.steps_per_generation or 1) != 1:
        refuse(
            f"steps_per_generation={args.steps_per_generation} (TRL shuffles each process's generation batch "
            "before cutting it into micro-batches: the CP group's micro-batches would not be one process's)",
            "set steps_per_generation=1 (generation_batch_size=None); gradient accumulation still works",
        )
    if args.eval_strategy != "no" or constructor_kwargs.get("eval_dataset") is not None:
        refuse("evaluation (its rollouts are not sliced over the CP group yet)",
               "drop eval_dataset and set eval_strategy='no', or evaluate at cp_size=1")
    if args.deepspeed:
        refuse("DeepSpeed (the CP group's first rank generates alone, and ZeRO-3 gathers the weights layer by "
               "layer with every process taking part, in each decoding step)", "train with DDP or FSDP2")
    if args.per_device_train_batch_size % cp_size:
        raise ValueError(
            f"per_device_train_batch_size={args.per_device_train_batch_size} (the CP group's rollouts per step) "
            f"must be a multiple of cp_size={cp_size}: each rank of the group scores an equal slice of them"
        )


def check_grpo_config(args: Any, constructor_kwargs: dict[str, Any], cp_size: int) -> None:
    """:func:`check_rollout_config` for ``RingGRPOTrainer``, plus GRPO's own settings."""
    check_rollout_config(args, constructor_kwargs, cp_size, "RingGRPOTrainer")
    refuse = _refuser("RingGRPOTrainer", cp_size)
    if args.loss_type not in EXACT_LOSS_TYPES:
        refuse(f"loss_type={args.loss_type!r}", f"use one of {EXACT_LOSS_TYPES}")
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        refuse("the entropy bonus (entropy_coef / use_adaptive_entropy: a per-process token mean)",
               "set entropy_coef=0.0 and use_adaptive_entropy=False")
    if args.top_entropy_quantile < 1.0:
        refuse("top_entropy_quantile < 1 (not checked against one process)", "set top_entropy_quantile=1.0")
    if args.off_policy_mask_threshold is not None:
        refuse("off_policy_mask_threshold (not checked against one process)", "set it to None")
    if args.importance_sampling_level != "token":
        refuse(f"importance_sampling_level={args.importance_sampling_level!r} (not checked against one process)",
               "use importance_sampling_level='token'")


def check_rloo_config(args: Any, constructor_kwargs: dict[str, Any], cp_size: int) -> None:
    """:func:`check_rollout_config` for ``RingRLOOTrainer`` (its loss, a mean over sequences of
    equal slices, and its sequence-level KL need nothing more)."""
    check_rollout_config(args, constructor_kwargs, cp_size, "RingRLOOTrainer")
