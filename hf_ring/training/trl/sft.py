"""``RingSFTTrainer``: TRL's ``SFTTrainer`` with context parallelism.

TRL prepares the data (chat templates, completion-only and assistant-only loss masks,
packing) exactly as it does without CP; :class:`~hf_ring.training.trl.sft_collator.RingSFTCollator`
collates it from TRL's own settings into this rank's shard (a vision dataset: TRL's own vision
collator makes the rows and labels, and
:class:`~hf_ring.training.trl.sft_vision_collator.RingSFTVisionCollator` hands the full batch to
every rank, the labels sharded); :class:`~hf_ring.RingTrainer`
brings the dp x cp groups, the data-parallel sharding of batches, the token-mean loss
over the whole dp x cp world and the stock Trainer's eval loss. The loss is computed with TRL's
fused LM head (no ``(tokens, vocab)`` logits), fed the collator's ``shift_labels``, and
TRL's metrics (``entropy``, ``mean_token_accuracy``, ``num_tokens``) are summed over every
rank, so they too are those of a run without CP.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from trl import SFTTrainer

from hf_ring.distributed.errors import raise_together
from hf_ring.training.collator import RingDataCollator
from hf_ring.hf.guard import per_token_labels
from hf_ring.training.loss import all_reduce_sum, count_valid_tokens
from hf_ring.training.plugin import RingAttentionPlugin
from hf_ring.training.trainer import RingTrainer, _model_inputs
from hf_ring.patches import transformers as transformers_patches
from hf_ring.patches import trl as trl_patches
from hf_ring.training.trl.sft_collator import NUM_TOKENS_KEY, RingSFTCollator
from hf_ring.training.trl.sft_vision_collator import RingSFTVisionCollator


class RingSFTTrainer(RingTrainer, SFTTrainer):
    """``trl.SFTTrainer`` for context-parallel training.

    Args:
        ring_plugin: the :class:`~hf_ring.RingAttentionPlugin` (``cp_size``, layout); default
            ``cp_size=1``.
        *args, **kwargs: as for ``trl.SFTTrainer``. Leave ``data_collator`` unset: the
            collator is built from TRL's settings (``padding_free``, ``packing`` and
            ``packing_strategy``, ``pad_to_multiple_of``); padding-free batches (TRL's
            best-fit packing) become hf_ring's per-document zigzag packing. A vision dataset
            (``images`` / ``image``, with a processor as ``processing_class``) is collated by
            TRL's vision collator, whose rows and labels
            :class:`~hf_ring.training.trl.sft_vision_collator.RingSFTVisionCollator` hands
            whole to every rank of a CP group, the labels sharded.

    Refused (besides what :class:`~hf_ring.RingTrainer` refuses, and what TRL refuses for vision
    datasets itself: packing, padding-free, ``truncation_mode="keep_end"``): a data collator other
    than TRL's language-modeling or vision one or hf_ring's, an MoE router auxiliary loss,
    Accelerate's sequence parallelism, ``chunked_loss=`` (TRL's fused head is used instead).
    """

    def __init__(self, *args: Any, ring_plugin: Optional[RingAttentionPlugin] = None, **kwargs: Any):
        trl_patches.check_version()
        if "chunked_loss" in kwargs:
            # Accepted and ignored it would promise a setting that changes nothing.
            raise ValueError(
                "RingSFTTrainer takes no chunked_loss=: its loss comes from TRL's fused LM head, which already "
                "computes it without full-vocabulary logits; chunked_loss= is RingTrainer's. Drop the argument"
            )
        super().__init__(*args, ring_plugin=ring_plugin, **kwargs)
        # A collator refused on one rank only (built for another CP rank) is refused on every rank.
        raise_together(self._install_ring_collator)

    def _install_ring_collator(self) -> None:
        self.data_collator = self._ring_collator(self.data_collator)

    def _check_supported(self) -> None:
        super()._check_supported()
        if self.aux_loss_enabled:
            raise NotImplementedError(
                "RingSFTTrainer does not compute the MoE router auxiliary loss; set router_aux_loss_coef=0.0 "
                "in the SFTConfig"
            )
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        if parallelism is not None and getattr(parallelism, "sp_enabled", False):
            raise ValueError(
                "Accelerate's sequence parallelism splits sequences its own way; RingSFTTrainer brings context "
                "parallelism: leave parallelism_config's sp_size at 1 and give the CP size to RingAttentionPlugin"
            )

    def _ring_collator(self, collator: Any) -> Any:
        if isinstance(collator, (RingSFTCollator, RingSFTVisionCollator)):
            if not collator.matches(self.ring_state):
                raise ValueError(f"the {type(collator).__name__} shards for another CP rank or layout; leave "
                                 "data_collator unset")
            return collator
        if isinstance(collator, RingDataCollator):
            return RingSFTCollator(collator)  # RingTrainer checked it shards as this process's state says
        if type(collator) is trl_patches.vision_collator_class():
            return RingSFTVisionCollator.for_trl(self.ring_state, collator, self.model.config)
        if type(collator) is not trl_patches.language_modeling_collator_class():
            raise ValueError(
                f"RingSFTTrainer builds its collator from TRL's settings; got data_collator of type "
                f"{type(collator).__name__}. Leave data_collator unset (TRL's own collator, for text or vision "
                "datasets, is then wrapped), or pass ring_plugin.make_collator(...) for a text dataset"
            )
        return RingSFTCollator.for_trl(
            self.ring_state,
            pad_token_id=collator.pad_token_id,
            padding_free=collator.padding_free,
            pad_to_multiple_of=collator.pad_to_multiple_of,
        )

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``predict`` without context parallelism; refused under it (not tested there)."""
        if self.ring_state.cp_size > 1:
            raise NotImplementedError(
                f"RingSFTTrainer.predict() under context parallelism (cp_size={self.ring_state.cp_size}) is not "
                "tested; predict with cp_size=1 (the model is the same), or with hf_ring.RingTrainer and "
                "ring_plugin.make_collator(...) on padded rows (its predict gathers whole rows under CP)"
            )
        return super().predict(*args, **kwargs)

    # ---- the loss and TRL's metrics ----

    def _token_losses(self, model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Sum of this rank's token losses (float32 scalar), its valid-token count and the fused outputs."""
        inputs = dict(inputs)
        num_tokens = int(inputs.pop(NUM_TOKENS_KEY, 0))
        kwargs, shift_labels = _model_inputs(inputs, getattr(self.model, "config", None))
        with per_token_labels():  # only the per-token log_probs are read, never outputs.loss
            outputs = model(**kwargs, shift_labels=shift_labels, fused_lm_head=True)
        log_probs = outputs.log_probs.float()  # zero where the label is -100
        per_token = -log_probs
        if self.args.loss_type == "dft":  # https://huggingface.co/papers/2508.05629: weighted by p (no gradient)
            per_token = per_token * log_probs.exp().detach()
        count = count_valid_tokens(shift_labels)
        self._record_metrics(outputs, count, num_tokens)
        return per_token.sum(), count, outputs

    def _record_metrics(self, outputs: Any, count: torch.Tensor, num_tokens: int) -> None:
        """TRL's entropy, token accuracy and token count, summed over every rank (collective)."""
        mode = "train" if self.model.training else "eval"
        # Every rank of a CP group holds the same batch's count: only CP rank 0 adds it.
        tokens = num_tokens if self.ring_state.cp_rank == 0 else 0
        local = torch.stack(
            [
                outputs.entropy.detach().double().sum(),
                outputs.is_top1.double().sum(),
                count.double(),
                torch.tensor(float(tokens), dtype=torch.float64, device=count.device),
            ]
        )
        entropy, correct, valid, tokens = all_reduce_sum(local).tolist()
        metrics = trl_patches.metrics(self, mode)
        metrics["entropy"].append(entropy / valid if valid > 0 else 0.0)
        metrics["mean_token_accuracy"].append(correct / valid if valid > 0 else 0.0)
        # TRL logs the running count of training tokens, in eval too.
        metrics["num_tokens"] = [trl_patches.add_train_tokens(self, int(tokens) if mode == "train" else 0)]

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Optional[torch.Tensor] = None,
    ) -> Any:
        """This rank's share of the token-mean loss over the whole dp x cp world, scaled for the
        wrapper's (DDP, FSDP2, ZeRO) average over processes."""
        multiplier = self._loss_multiplier(model)
        token_sum, count, outputs = self._token_losses(model, inputs)
        loss = self._loss_for_backward(token_sum, count, num_items_in_batch, multiplier)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: Optional[list[str]] = None,
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The batch's token-mean loss over the CP group (what the stock loop averages into
        eval_loss); adds this rank's totals for eval_token_loss.

        Logits (a second forward, as TRL does) only when ``prediction_loss_only`` is False, which
        happens without CP only (``compute_metrics`` and :meth:`predict` are refused under it).
        """
        inputs = transformers_patches.prepare_inputs(self, inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            token_sum, count, _ = self._token_losses(model, inputs)
        loss = self._record_eval_batch(token_sum, count)
        if prediction_loss_only:
            return loss, None, None
        kwargs, shift_labels = _model_inputs({k: v for k, v in inputs.items() if k != NUM_TOKENS_KEY}, self.model.config)
        with torch.no_grad():
            logits = model(**kwargs).logits.detach()
        return loss, logits, shift_labels
