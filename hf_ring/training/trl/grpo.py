"""``RingGRPOTrainer``: TRL's ``GRPOTrainer`` with context parallelism.

How a step runs under CP: :mod:`hf_ring.training.trl.rollout_trainer` (each rank TRL's code on
its slice of the CP group's rollouts, generated once per group without CP, every model's
log-probabilities through the ring on the group's rows). What GRPO adds is its loss types'
reductions. Each rank returns TRL's loss of its slice, and the processes' mean of those is the
loss of the group's whole batch for ``grpo`` (a mean of per-sequence means over equal
slices), ``dr_grpo`` (a sum over a constant) and ``dapo`` (normalised by TRL's global token
count). ``bnpo`` normalises by the process's own token count, so its loss is rescaled to
the group's count (``cp_size * local / group``), which makes it one process's.

A CP group is therefore one of TRL's processes: cp 2 logs what cp 1 logs on the same prompts.
What is not exact yet is refused (:func:`~hf_ring.training.trl.rollout_checks.check_grpo_config`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from trl import GRPOTrainer

from hf_ring.training.trl.rollout_checks import check_grpo_config
from hf_ring.training.trl.rollout_trainer import RingRolloutTrainer


class RingGRPOTrainer(RingRolloutTrainer, GRPOTrainer):
    """``trl.GRPOTrainer`` for context-parallel training.

    Args:
        model, reward_funcs, args, ...: as for ``trl.GRPOTrainer``. Under CP the model (and the
            reference model TRL builds from its checkpoint when ``beta > 0``) must use
            ``attn_implementation="ring_flash"``; ``per_device_train_batch_size`` counts the
            rollouts of one CP group per step and must be a multiple of ``cp_size``.
        ring_plugin: the :class:`~hf_ring.RingAttentionPlugin`; default ``cp_size=1``.
        padding_free: hf_ring's option (TRL's config has none): run each forward's prompt +
            completion rows as one packed row of documents, each padded to ``2 * cp_size``
            only, instead of every row to the longest; needs ``ring_flash`` (at cp 1 too).
        generate_under_cp: hf_ring's option: under CP the group's ranks generate its rollouts
            together, the prompts prefilled by the ring into a sharded cache (docs/generation.md),
            instead of its first rank alone without CP; the same completions either way.

    Refused under CP (:func:`~hf_ring.training.trl.rollout_checks.check_grpo_config`): vLLM
    and continuous-batching generation, tools / environments / ``rollout_func``, loss
    types other than ``grpo``, ``dapo``, ``dr_grpo``, ``bnpo``, ``steps_per_generation > 1``,
    the entropy bonus and entropy masks, the off-policy mask, sequence-level importance
    sampling, evaluation, DeepSpeed, image-text rollouts, an MoE auxiliary loss.
    """

    # TRL's GRPO loss is already normalised for gradient accumulation.
    loss_is_scaled_for_ga = True
    _trl_trainer = GRPOTrainer
    _generation_returns_logprobs = True
    _check_config = staticmethod(check_grpo_config)

    def _group_loss(self, loss: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """``bnpo``: TRL's per-process token mean times ``cp_size * local / group`` completion
        tokens (each clamped to 1, as TRL's), this rank's share of the group's token mean
        (collective over the CP group); the other loss types as they are."""
        if self.loss_type != "bnpo":
            return loss
        local = inputs["completion_mask"].sum().to(torch.float64)
        group = local.clone()
        dist.all_reduce(group, op=dist.ReduceOp.SUM, group=self.ring_state.cp_group)
        return loss * (self.ring_state.cp_size * local.clamp(min=1.0) / group.clamp(min=1.0)).to(loss.dtype)
