"""``RingRolloutTrainer``: what ``RingGRPOTrainer`` and ``RingRLOOTrainer`` share under CP.

TRL's ``GRPOTrainer`` and ``RLOOTrainer`` run a step the same way: a generation batch of
prompts, completions generated inside the trainer, rewards and advantages gathered over every
process, then the per-token log-probabilities of the prompt + completion rows (old policy,
reference, policy with its backward). Under context parallelism (``cp_size > 1``):

- **data**: :class:`~hf_ring.RingAttentionPlugin` gives every rank of a CP group the same
  prompts (the group's ``per_device_train_batch_size`` rollouts); each rank keeps its slice
  (rank ``r`` the ``r``-th of ``cp_size`` contiguous parts). TRL's code runs unchanged on that
  slice, and its gathers over every process (rewards and their group-wise advantages,
  completion lengths, token counts, KL, entropy and clip-ratio metrics) see each rollout
  once, in the order one process holds them; the group's batch is shuffled as one, and
  TRL's ``generation_batch_size`` counts data-parallel ranks only (CP ranks share prompts).
- **generation** (:mod:`hf_ring.training.trl.rollouts`): TRL's transformers ``generate``,
  without CP, once per group, on its first rank, for the whole group's prompts in one call
  (what one process would generate, sample for sample); the completions reach every rank
  of the group by a broadcast. Under FSDP2 every process unshards the policy first, together
  (``hf_ring.patches.torch.fsdp2_unsharded``), so that the first rank generates from whole
  weights without a collective per decoding step; all reshard afterwards.
- **log-probabilities** (:mod:`hf_ring.training.trl.completion_rows`): every model runs the
  group's rows through the ring with TRL's fused LM head (per-token log-probabilities by
  chunks of positions, never full-vocabulary logits), gathered back into whole rows; each
  rank reads its own rows, and TRL's loss, KL, clipping and metrics run on exactly the
  tensors they see without CP. With ``padding_free=True`` the group's rows run as one
  packed row of documents (:mod:`hf_ring.sharding.row_packing`), at cp 1 too.
- **loss**: each rank returns TRL's loss of its slice; the wrapper's (DDP) average over the
  dp x cp processes of what the gathered rows' backward gives each rank is the gradient of
  the mean of the group's losses, as between TRL's own processes. Where that mean is not
  the loss of the group's batch, the subclass rescales it (:meth:`_group_loss`).

A CP group is therefore one of TRL's processes. At cp 1 every method is TRL's own. Each
override reaches TRL's through ``super()`` (the subclass is
``RingGRPOTrainer(RingRolloutTrainer, GRPOTrainer)``: this class and
:class:`~hf_ring.training.trainer_base.RingTrainerBase` come first in the method order), so a
class placed between them and TRL's (a user's subclass of ``GRPOTrainer``) is not skipped.

Must not import a TRL trainer class (the subclass derives from it and names it as
``_trl_trainer``, whose private methods :mod:`hf_ring.patches.trl` checks).
"""

from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import transformers

from hf_ring.distributed.errors import raise_together
from hf_ring.patches import torch as torch_patches
from hf_ring.patches import transformers as transformers_patches
from hf_ring.patches import trl as trl_patches
from hf_ring.training.plugin import RingAttentionPlugin
from hf_ring.training.trainer_base import RingTrainerBase
from hf_ring.training.trainer_checks import RING_ATTENTION, check_reference_attention, refuse_placement
from hf_ring.training.trl.completion_rows import completion_log_probs
from hf_ring.training.trl.fused_forward import RingFusedForward
from hf_ring.training.trl.rollouts import generate_for_group, group_shuffle


@contextmanager
def _generating_alone(model: torch.nn.Module, under_cp: bool) -> Iterator[None]:
    """``model.generate`` with ``synced_gpus=False``: transformers turns it on by itself for an
    FSDP-managed model (every process then runs each decoding step together), but here one
    rank generates alone, or a CP group's ranks in step, from weights every process unsharded
    beforehand. ``under_cp``: with ``use_cache=True`` too, which generation under CP runs with
    (the policy's config may turn the cache off for training)."""
    own = vars(model).get("generate")  # FSDP2 registers generate as an instance method of its own
    model.generate = functools.partial(model.generate, synced_gpus=False, **({"use_cache": True} if under_cp else {}))
    try:
        yield
    finally:
        if own is None:
            del model.generate
        else:
            model.generate = own


class RingRolloutTrainer(RingTrainerBase):
    """The CP methods of the rollout trainers; a subclass also derives from TRL's trainer,
    names it (``_trl_trainer``) and its config check (``_check_config(args, kwargs, cp_size)``)."""

    _trl_trainer: type
    _check_config: Callable[[Any, dict[str, Any], int], None]
    # Whether TRL's _generate_single_turn returns (completion ids, sampling log-probs) or the ids alone.
    _generation_returns_logprobs: bool

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, *rest: Any,
                 ring_plugin: Optional[RingAttentionPlugin] = None, padding_free: bool = False,
                 generate_under_cp: bool = False, **kwargs: Any):
        trl_patches.check_version()
        # TRL's GRPOConfig / RLOOConfig have no padding_free: hf_ring's option, named as SFTConfig's.
        self.padding_free = bool(padding_free)
        self.generate_under_cp = bool(generate_under_cp)
        trl_patches.check_rollout_hooks(self._trl_trainer)
        plugin = ring_plugin if ring_plugin is not None else RingAttentionPlugin(cp_size=1)
        if plugin.cp_size > 1:
            type(self)._check_config(args, kwargs, plugin.cp_size)  # the same config everywhere: raised on every rank
        super().__init__(model, reward_funcs, args, *rest, ring_plugin=plugin, **kwargs)
        if self.padding_free and self.ring_state.layout != "zigzag":
            raise ValueError(f"padding_free=True shards each packed document in zigzag order; the plugin's layout "
                             f"is {self.ring_state.layout!r}: use layout='zigzag' or set padding_free=False")
        if self.ring_state.cp_size > 1:
            raise_together(self._check_cp_setup)
            # The config counted every process as holding its own prompts; the data-parallel ranks do. TRL's
            # sampler cuts the prompts into generation batches of this size (repeated num_iterations times).
            self.args.generation_batch_size = (
                self.args.per_device_train_batch_size * self.ring_state.dp_size * self.args.steps_per_generation)
            if self.args.generation_batch_size % self.args.num_generations:
                raise ValueError(
                    f"the generation batch ({self.args.generation_batch_size} rollouts: per_device_train_batch_size x "
                    f"{self.ring_state.dp_size} data-parallel ranks; CP ranks share theirs) must be a multiple of "
                    f"num_generations={self.args.num_generations}")
            # TRL seeded each process with seed + its index; every rank of a CP group takes the seed of
            # one process per data-parallel rank, so the group's first rank samples what that process would.
            transformers.set_seed(self.args.seed + self.ring_state.dp_rank)
        elif self.padding_free:
            raise_together(self._check_packing_attention)

    def _check_cp_setup(self) -> None:
        name = type(self).__name__
        refuse_placement(self.ring_state, name, "its completion rows")
        if self.aux_loss_enabled:
            raise NotImplementedError(f"{name} under CP does not compute the MoE router auxiliary loss; set "
                                      "router_aux_loss_coef=0.0 in the config")
        if not isinstance(self.processing_class, transformers.PreTrainedTokenizerBase):
            raise NotImplementedError(f"{name} under CP takes text rollouts only (a tokenizer as "
                                      "processing_class); image-text rollouts are not supported yet")
        if self.ref_model is not None:  # TRL builds it like the policy
            check_reference_attention(self.ref_model, self.ring_state.cp_size, "load the policy with")

    def _check_packing_attention(self) -> None:
        """padding_free at cp 1: the documents of the packed row are kept apart by ring_flash
        (it reads their boundaries); SDPA or eager attention would let them attend to each other."""
        for what, model in (("policy", self.model), ("reference model", self.ref_model)):
            if model is None:
                continue
            impl = transformers_patches.attn_implementation(getattr(getattr(model, "module", model), "config", None))
            if impl != RING_ATTENTION:
                raise ValueError(f"padding_free=True packs the rollouts into one row of documents, which only "
                                 f"{RING_ATTENTION!r} keeps apart; the {what} uses attn_implementation={impl!r}: "
                                 f"load it with attn_implementation={RING_ATTENTION!r} or set padding_free=False")

    # ---- data and generation ----

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        """TRL's, on this rank's slice of the CP group's prompts, the group's batch shuffled as one."""
        state = self.ring_state
        if state.cp_size == 1:
            return super()._prepare_inputs(generation_batch)
        rows = len(generation_batch)
        if rows % state.cp_size:
            raise ValueError(f"the CP group's generation batch has {rows} rollouts, not a multiple of cp_size="
                             f"{state.cp_size}; make per_device_train_batch_size a multiple of it")
        share = rows // state.cp_size
        mine = generation_batch[state.cp_rank * share : (state.cp_rank + 1) * share]
        with trl_patches.shuffle_replaced(self._trl_trainer, group_shuffle(state)):
            return super()._prepare_inputs(mine)

    def _generate_single_turn(self, prompt_ids: list, images: Any, multimodal_fields: Any, *rest: Any) -> Any:
        """TRL's generation (``rest``: GRPO's ``num_generations``, ...), returning what TRL's
        does (GRPO: completion ids and sampling log-probs; RLOO: the ids); under CP once per CP
        group: on its first rank without CP, or with ``generate_under_cp`` by the group's ranks
        together, the prompts prefilled by the ring."""
        generate_one = super()._generate_single_turn
        if self.ring_state.cp_size == 1:
            return generate_one(prompt_ids, images, multimodal_fields, *rest)
        if images is not None or multimodal_fields:
            raise NotImplementedError("image-text rollouts are not supported under context parallelism")

        def generate(group_prompt_ids: list) -> tuple[list, Optional[list]]:
            with _generating_alone(self.model, self.generate_under_cp):
                out = generate_one(group_prompt_ids, None, {}, *rest)
            return out if self._generation_returns_logprobs else (out, None)

        if self.generate_under_cp and not getattr(self, "_said_under_cp", False):
            logging.getLogger("hf_ring").info(
                f"[hf_ring] rollouts generated under CP by the {self.ring_state.cp_size} ranks of each CP group "
                "(the prompts prefilled by the ring into a sharded cache)")
            self._said_under_cp = True
        # FSDP2: every process gathers the whole weights together, then generates from them without a
        # collective of FSDP's per decoding step (the first ranks alone, or each group's ranks in step).
        with torch_patches.fsdp2_unsharded(self.model):
            completions, logprobs = generate_for_group(self.ring_state, prompt_ids, generate, self.generate_under_cp)
        return (completions, logprobs) if self._generation_returns_logprobs else completions

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
        if state.cp_size == 1 and not self.padding_free:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, **multimodal)
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if compute_aux_loss or given:
            raise NotImplementedError(f"under context parallelism or padding_free the rollouts are text only "
                                      f"(got {given}, compute_aux_loss={compute_aux_loss})")
        ring = RingFusedForward(model, state, self.processing_class.pad_token_id or 0, packed=self.padding_free)
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
        """TRL's loss of this rank's slice, as the group's loss share (:meth:`_group_loss`)."""
        state = self.ring_state
        if state.cp_size == 1:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self._check_gradients_averaged_over_world(model)
        return self._group_loss(super().compute_loss(model, inputs, return_outputs, num_items_in_batch), inputs)

    def _group_loss(self, loss: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """TRL's loss of this rank's slice turned into its share of the group's loss (here: as it
        is; the mean over equal slices of their losses is the group's)."""
        return loss
