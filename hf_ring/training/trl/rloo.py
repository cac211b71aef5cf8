"""``RingRLOOTrainer``: TRL's ``RLOOTrainer`` with context parallelism.

How a step runs under CP: :mod:`hf_ring.training.trl.rollout_trainer`, as for GRPO. RLOO's
loss is a mean over sequences of the clipped sequence-level ratio times the leave-one-out
advantage; each rank returns it for its slice, and the mean over the group's equal slices is
the group's batch's. Its KL penalty (per sequence, from the old-policy and reference
log-probabilities, both computed through the ring) enters the rewards, which TRL gathers
over every process before the leave-one-out baselines: unchanged under CP.

What is not exact yet is refused (:func:`~hf_ring.training.trl.rollout_checks.check_rloo_config`).
"""

from __future__ import annotations

from trl import RLOOTrainer

from hf_ring.training.trl.rollout_checks import check_rloo_config
from hf_ring.training.trl.rollout_trainer import RingRolloutTrainer


class RingRLOOTrainer(RingRolloutTrainer, RLOOTrainer):
    """``trl.RLOOTrainer`` for context-parallel training.

    Args:
        model, reward_funcs, args, ...: as for ``trl.RLOOTrainer``. Under CP the model (and the
            reference model TRL builds from its checkpoint when ``beta > 0``, RLOO's default)
            must use ``attn_implementation="ring_flash"``; ``per_device_train_batch_size``
            counts the rollouts of one CP group per step and must be a multiple of ``cp_size``.
        ring_plugin: the :class:`~hf_ring.RingAttentionPlugin`; default ``cp_size=1``.
        padding_free: hf_ring's option (TRL's config has none): run each forward's prompt +
            completion rows as one packed row of documents, each padded to ``2 * cp_size``
            only, instead of every row to the longest; needs ``ring_flash`` (at cp 1 too).
        generate_under_cp: hf_ring's option: under CP the group's ranks generate its rollouts
            together, the prompts prefilled by the ring into a sharded cache (docs/generation.md),
            instead of its first rank alone without CP; the same completions either way.

    Refused under CP (:func:`~hf_ring.training.trl.rollout_checks.check_rloo_config`): vLLM
    and continuous-batching generation, tools / environments / ``rollout_func``,
    ``steps_per_generation > 1``, evaluation, DeepSpeed, image-text rollouts, an MoE
    auxiliary loss.
    """

    # TRL's RLOO loss is a per-batch mean: the Trainer divides it by the accumulation steps.
    loss_is_scaled_for_ga = False
    _trl_trainer = RLOOTrainer
    _generation_returns_logprobs = False
    _check_config = staticmethod(check_rloo_config)
