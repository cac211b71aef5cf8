"""``RingDPOTrainer``: TRL's ``DPOTrainer`` with context parallelism.

Every rank of a CP group gets the same batch of whole (prompt + chosen, prompt +
rejected) rows from TRL's own collator. The policy and the reference model run through
:class:`~hf_ring.training.trl.fused_forward.RingFusedForward`: each rank computes its shard of every
row through the ring, and the per-token log-probabilities (and the fields TRL's metrics
read) are gathered back into whole rows. TRL's loss, of any ``loss_type``, and its metrics
(rewards, margins, accuracies, log-probabilities, entropy, token accuracy) are then
computed from exactly what they are computed from without CP, identically on every rank
of the group; the gather's backward makes the gradients those of a run without CP.

The eval loss is the stock Trainer's (every Ring trainer's evaluation loop,
:mod:`hf_ring.training.trainer_base`): the mean over eval samples of their batch's DPO loss,
gathered over data-parallel ranks; TRL's token count is divided by the number of processes
that share a batch. Every other method is TRL's, reached through ``super()``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from trl import DPOTrainer

from hf_ring.training.plugin import RingAttentionPlugin
from hf_ring.training.trainer_base import RingTrainerBase
from hf_ring.training.trainer_checks import check_reference_attention, refuse_placement
from hf_ring.patches import trl as trl_patches
from hf_ring.training.trl.fused_forward import RingFusedForward


class RingDPOTrainer(RingTrainerBase, DPOTrainer):
    """``trl.DPOTrainer`` for context-parallel training.

    Args:
        model, ref_model, args, ...: as for ``trl.DPOTrainer``. Under CP both models must
            use ``attn_implementation="ring_flash"`` and a reference model must be given
            (or be creatable by TRL from the policy's checkpoint).
        ring_plugin: the :class:`~hf_ring.RingAttentionPlugin`; default ``cp_size=1``.

    Refused under CP (``cp_size > 1``): ``precompute_ref_log_probs`` (its pass over the
    data shards over every process), PEFT without a reference model (the reference is the
    policy with its adapter disabled, called outside the ring), multimodal inputs and an
    MoE router auxiliary loss.
    """

    # TRL's DPO loss is a per-batch mean: the Trainer divides it by the accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        model: Any,
        ref_model: Any = None,
        args: Any = None,
        *rest: Any,
        ring_plugin: Optional[RingAttentionPlugin] = None,
        **kwargs: Any,
    ):
        trl_patches.check_version()
        plugin = ring_plugin if ring_plugin is not None else RingAttentionPlugin(cp_size=1)
        if plugin.cp_size > 1 and args is not None and getattr(args, "precompute_ref_log_probs", False):
            raise NotImplementedError(
                "precompute_ref_log_probs=True is not supported under context parallelism (its pass over the "
                "data shards batches over every process, not over data-parallel ranks); set it to False: the "
                "reference model then runs through the ring with the policy"
            )
        super().__init__(model, ref_model, args, *rest, ring_plugin=plugin, **kwargs)
        # Every process of a CP group counts its (whole) batch's tokens.
        trl_patches.set_batch_replicas(self, self.ring_state.cp_size)

    def _check_supported(self) -> None:
        super()._check_supported()
        if self.ring_state.cp_size == 1:
            return
        refuse_placement(self.ring_state, type(self).__name__, "its chosen and rejected rows")
        if self.ref_model is None:
            raise NotImplementedError(
                "under context parallelism RingDPOTrainer needs a reference model (PEFT without one would run "
                "the reference outside the ring); pass ref_model="
            )
        check_reference_attention(self.ref_model, self.ring_state.cp_size, "load it with")

    def _pad_token_id(self) -> int:
        pad = getattr(self.data_collator, "pad_token_id", None)
        return int(pad) if pad is not None else 0

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Optional[torch.Tensor] = None,
    ) -> Any:
        """TRL's DPO loss of the CP group's batch (the same on every rank of the group)."""
        if self.ring_state.cp_size == 1:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if return_outputs:
            raise NotImplementedError(
                "RingDPOTrainer under context parallelism returns no model outputs (TRL would recompute full "
                "logits outside the ring); use prediction_loss_only / no compute_metrics"
            )
        self._check_gradients_averaged_over_world(model)
        # TRL calls the reference model itself: it runs through the ring while the loss is computed.
        ring_reference = RingFusedForward(self.ref_model, self.ring_state, self._pad_token_id())
        with trl_patches.reference_model_replaced(self, ring_reference):
            ring_model = RingFusedForward(model, self.ring_state, self._pad_token_id())
            return super().compute_loss(ring_model, inputs, False, num_items_in_batch)
