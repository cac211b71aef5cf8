"""``RingGRPOTrainer``: TRL's ``GRPOTrainer`` with context parallelism.

How a step runs under CP (``cp_size > 1``):

- **data**: :class:`~hf_ring.RingAttentionPlugin` gives every rank of a CP group the same
  prompts (the group's ``per_device_train_batch_size`` rollouts); each rank then keeps its
  slice (rank ``r`` the ``r``-th of ``cp_size`` contiguous parts). TRL's code runs unchanged
  on that slice, and its gathers over every process (rewards and their group-wise
  advantages, completion lengths, token counts, KL, entropy and clip-ratio metrics) see each
  rollout once, in the order one process holds them.
- **generation** (:mod:`hf_ring.training.trl.rollouts`): TRL's transformers ``generate``,
  without CP, once per group, on its first rank, for the whole group's prompts in one call
  (what one process would generate, sample for sample); the completions reach every rank
  of the group by a broadcast.
- **log-probabilities** (:mod:`hf_ring.training.trl.completion_rows`): the policy (with its
  backward), the old policy and the reference model run the group's prompt + completion rows
  through the ring with TRL's fused LM head (per-token log-probabilities by chunks of
  positions, never full-vocabulary logits), gathered back into whole rows; each rank reads its
  own rows. TRL's loss, KL, clipping and metrics then run on exactly the tensors they see
  without CP.
- **loss**: each rank returns TRL's loss of its slice. The wrapper's (DDP) average over the
  dp x cp processes of what the gathered rows' backward gives each rank is then the gradient
  of the mean of the group's losses, as between TRL's own processes. That mean is the loss
  of the group's whole batch for ``grpo`` (a mean of per-sequence means over equal slices),
  ``dr_grpo`` (a sum over a constant) and ``dapo`` (normalised by TRL's global token
  count); ``bnpo`` normalises by the process's own token count, so its loss is rescaled here
  to the group's count (``cp_size * local / group``), which makes it one process's.

A CP group is therefore one of TRL's processes: cp 2 logs what cp 1 logs on the same prompts.
At cp 1 every method is TRL's own. What is not exact yet is refused
(:mod:`hf_ring.training.trl.grpo_checks`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import transformers
from trl import GRPOTrainer

from hf_ring.distributed.errors import raise_together
from hf_ring.patches import trl as trl_patches
from hf_ring.training.plugin import RingAttentionPlugin
from hf_ring.training.trainer import RingTrainer
from hf_ring.training.trainer_checks import check_reference_attention
from hf_ring.training.trl.completion_rows import completion_log_probs
from hf_ring.training.trl.fused_forward import RingFusedForward
from hf_ring.training.trl.grpo_checks import check_grpo_config
from hf_ring.training.trl.rollouts import generate_for_group, group_shuffle

# What TRL passes for image-text rollouts; refused under CP.
_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
               "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


class RingGRPOTrainer(RingTrainer, GRPOTrainer):
    """``trl.GRPOTrainer`` for context-parallel training.

    Args:
        model, reward_funcs, args, ...: as for ``trl.GRPOTrainer``. Under CP the model (and the
            reference model TRL builds from its checkpoint when ``beta > 0``) must use
            ``attn_implementation="ring_flash"``; ``per_device_train_batch_size`` counts the
            rollouts of one CP group per step and must be a multiple of ``cp_size``.
        ring_plugin: the :class:`~hf_ring.RingAttentionPlugin`; default ``cp_size=1``.

    Refused under CP (see :func:`~hf_ring.training.trl.grpo_checks.check_grpo_config`): vLLM
    and continuous-batching generation, tools / environments / ``rollout_func``, PEFT, loss
    types other than ``grpo``, ``dapo``, ``dr_grpo``, ``bnpo``, ``steps_per_generation > 1``,
    the entropy bonus and entropy masks, the off-policy mask, sequence-level importance
    sampling, evaluation, FSDP / DeepSpeed, image-text rollouts, an MoE auxiliary loss.
    """

    # TRL's GRPO loss is already normalised for gradient accumulation.
    loss_is_scaled_for_ga = True

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, *rest: Any,
                 ring_plugin: Optional[RingAttentionPlugin] = None, **kwargs: Any):
        trl_patches.check_version()
        trl_patches.check_grpo_hooks(GRPOTrainer)
        plugin = ring_plugin if ring_plugin is not None else RingAttentionPlugin(cp_size=1)
        if plugin.cp_size > 1:
            check_grpo_config(args, kwargs, plugin.cp_size)  # the same config everywhere: raised on every rank
        super().__init__(model, reward_funcs, args, *rest, ring_plugin=plugin, **kwargs)
        if self.ring_state.cp_size > 1:
            raise_together(self._check_cp_setup)
            # TRL seeded each process with seed + its index; every rank of a CP group takes the seed of
            # one process per data-parallel rank, so the group's first rank samples what that process would.
            transformers.set_seed(self.args.seed + self.ring_state.dp_rank)

    def _check_cp_setup(self) -> None:
        if self.aux_loss_enabled:
            raise NotImplementedError("RingGRPOTrainer under CP does not compute the MoE router auxiliary loss; set "
                                      "router_aux_loss_coef=0.0 in the GRPOConfig")
        if not isinstance(self.processing_class, transformers.PreTrainedTokenizerBase):
            raise NotImplementedError("RingGRPOTrainer under CP takes text rollouts only (a tokenizer as "
                                      "processing_class); image-text rollouts are not supported yet")
        if self.ref_model is not None:  # TRL builds it like the policy
            check_reference_attention(self.ref_model, self.ring_state.cp_size, "load the policy with")

    # ---- data and generation ----

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """TRL's (the stock Trainer's): GRPO counts its tokens after generation."""
        return GRPOTrainer.get_batch_samples(self, epoch_iterator, num_batches, device)

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        """TRL's, on this rank's slice of the CP group's prompts, the group's batch shuffled as one."""
        state = self.ring_state
        if state.cp_size == 1:
            return GRPOTrainer._prepare_inputs(self, generation_batch)
        rows = len(generation_batch)
        if rows % state.cp_size:
            raise ValueError(f"the CP group's generation batch has {rows} rollouts, not a multiple of cp_size="
                             f"{state.cp_size}; make per_device_train_batch_size a multiple of it")
        share = rows // state.cp_size
        mine = generation_batch[state.cp_rank * share : (state.cp_rank + 1) * share]
        with trl_patches.grpo_shuffle_replaced(group_shuffle(state)):
            return GRPOTrainer._prepare_inputs(self, mine)

    def _generate_single_turn(
        self, prompt_ids: list, images: Any, multimodal_fields: Any, num_generations: int, has_tool_images: bool = False
    ) -> tuple[list, Optional[list]]:
        """TRL's generation; under CP once per CP group, on its first rank, without CP."""
        if self.ring_state.cp_size == 1:
            return GRPOTrainer._generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                                     has_tool_images)
        if images is not None or multimodal_fields:
            raise NotImplementedError("image-text rollouts are not supported under context parallelism")

        def generate(group_prompt_ids: list) -> tuple[list, Optional[list]]:
            return GRPOTrainer._generate_single_turn(self, group_prompt_ids, None, {}, num_generations, False)

        return generate_for_group(self.ring_state, prompt_ids, generate)

    # ---- log-probabilities and loss ----

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: Optional[int] = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """TRL's per-completion-token log-probs ``(rows, C)`` and entropies; under CP computed
        as a ring over the CP group's rows (:func:`completion_log_probs`), ``batch_size`` rows at a time."""
        state = self.ring_state
        if state.cp_size == 1:
            return GRPOTrainer._get_per_token_logps_and_entropies(
                self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, **multimodal)
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if compute_aux_loss or given:
            raise NotImplementedError(f"under context parallelism the rollouts are text only (got {given}, "
                                      f"compute_aux_loss={compute_aux_loss})")
        ring = RingFusedForward(model, state, self.processing_class.pad_token_id or 0)
        batch_size = batch_size or input_ids.size(0)
        log_probs, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            with self.accelerator.autocast():
                lp, ent = completion_log_probs(ring, input_ids[start : start + batch_size],
                                               attention_mask[start : start + batch_size], logits_to_keep,
                                               compute_entropy)
            log_probs.append(lp)
            entropies.append(ent)
        return torch.cat(log_probs), (torch.cat(entropies) if compute_entropy else None), None

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Optional[torch.Tensor] = None) -> Any:
        """TRL's loss of this rank's slice (``bnpo``: over the CP group's token count, see the module docstring)."""
        state = self.ring_state
        if state.cp_size == 1:
            return GRPOTrainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        if torch.is_grad_enabled():
            multiplier = self._loss_multiplier(model)
            if multiplier != state.world_size:
                raise NotImplementedError(
                    f"RingGRPOTrainer needs gradients averaged over all {state.world_size} processes (DDP); this "
                    f"model's wrapper averages over {multiplier}"
                )
        loss = GRPOTrainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        if self.loss_type == "bnpo":
            loss = loss * self._bnpo_rescale(inputs["completion_mask"])
        return loss

    def _bnpo_rescale(self, completion_mask: torch.Tensor) -> torch.Tensor:
        """``cp_size * local / group`` completion tokens (each clamped to 1, as TRL's): turns TRL's
        per-process token mean into this rank's share of the group's (collective over the CP group)."""
        local = completion_mask.sum().to(torch.float64)
        group = local.clone()
        dist.all_reduce(group, op=dist.ReduceOp.SUM, group=self.ring_state.cp_group)
        return (self.ring_state.cp_size * local.clamp(min=1.0) / group.clamp(min=1.0)).float()

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: Any,
        prediction_loss_only: bool,
        ignore_keys: Optional[list[str]] = None,
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
        """TRL's (evaluation is refused under CP)."""
        return GRPOTrainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)
