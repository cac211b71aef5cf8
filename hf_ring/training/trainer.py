"""``RingTrainer``: the HF Trainer with context parallelism.

What changes against the stock Trainer, and why:

- data: the Accelerator is hooked by :class:`RingAttentionPlugin` so batches are sharded over
  the data-parallel ranks only; every rank of a CP group gets the same batch and the
  :class:`RingDataCollator` keeps its shard of the sequence;
- training loss: the stock per-rank loss is a mean over the rank's tokens, which under CP is
  the mean of a shard. Each rank computes its share of the mean the stock Trainer trains the
  model on (:mod:`hf_ring.training.loss`: the step's token mean, or for
  ``accepts_loss_kwargs = False`` the mean of micro-batch means), times the number of
  processes the wrapper averages gradients over (:mod:`hf_ring.training.weight_sharding`).
  Gradients and the logged loss are then the stock run's;
- eval loss: each batch's loss is its token mean over the CP group's tokens
  (:meth:`RingTrainer.prediction_step`); the stock loop around it, its losses gathered over
  data-parallel ranks only, and ``eval_token_loss`` beside it (the token mean over the
  whole set) are every Ring trainer's (:mod:`hf_ring.training.trainer_base`, with the
  plugin, the batch-size bookkeeping, the gradient multiplier and saving).

Works with transformers 4.57 and 5.x (it overrides only public or long-stable methods:
``compute_loss``, ``get_batch_samples``, ``prediction_step``, and in the base
``evaluation_loop``, ``get_total_train_batch_size``, ``save_model``; under pipeline
parallelism the checkpoint steps, :mod:`hf_ring.training.pp.checkpoint`). The Trainer's and the
config's private attributes it needs are read through :mod:`hf_ring.patches.transformers`,
which checks them against the versions it was written for.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from transformers import Trainer
from transformers.utils import logging as hf_logging

from hf_ring.distributed.errors import raise_together
from hf_ring.distributed.rows import gather_rows
from hf_ring.hf.support.router_balance import router_balance_loss, router_balance_of
from hf_ring.memory.chunked_loss import ChunkedLossConfig, model_token_loss_sum
from hf_ring.training.loss import (
    all_reduce_sum,
    check_loss_mean,
    count_valid_tokens,
    departure_from_stock,
    loss_share,
    resolve_loss_mean,
    scale_for_ddp,
    token_loss_sum,
)
from hf_ring.training.collator import RingCollatorConfig
from hf_ring.training.plugin import RingAttentionPlugin
from hf_ring.training.pp.checkpoint import PipelineCheckpoints
from hf_ring.training.pp.trainer import TrainerPipeline
from hf_ring.training.trainer_base import RingTrainerBase
from hf_ring.patches import transformers as transformers_patches


logger = hf_logging.get_logger(__name__)


def _shift_labels(batch: dict[str, Any]) -> torch.Tensor:
    if "shift_labels" not in batch:
        raise ValueError(
            "the batch has no 'shift_labels'; under context parallelism labels must be shifted on "
            "the full sequence before sharding: use hf_ring.RingDataCollator as data_collator"
        )
    return batch["shift_labels"]


def _model_inputs(inputs: dict[str, Any], config: Any) -> tuple[dict[str, Any], torch.Tensor]:
    """The forward's arguments without the labels (the model computes no loss of its own; it
    would average over this rank's shard) and without a KV cache (no use in training, and a
    cache would hold only this rank's shard); plus shift_labels."""
    shift_labels = _shift_labels(inputs)
    kwargs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
    if getattr(config, "use_cache", None) is not None:
        kwargs.setdefault("use_cache", False)
    return kwargs, shift_labels


class RingTrainer(PipelineCheckpoints, RingTrainerBase, Trainer):
    """``transformers.Trainer`` for context-parallel training.

    Args:
        ring_plugin: the :class:`RingAttentionPlugin` (its ``cp_size`` and layout); default
            ``RingAttentionPlugin(cp_size=1)``.
        chunked_loss: compute the LM head and the loss chunk by chunk, never holding the
            shard's full logits (:mod:`hf_ring.memory.chunked_loss`): a
            :class:`ChunkedLossConfig`, True / False, or None (default: on under context or
            tensor parallelism; beside TP on each rank's vocabulary rows; under pipeline
            parallelism in the last stage). The training and eval losses are the same;
            ``outputs.logits`` of a chunked forward are empty.
        loss_mean: ``"auto"`` (the stock Trainer's mean for the model), ``"tokens"`` or
            ``"micro_batches"`` (:mod:`hf_ring.training.loss`; warned where not stock).
        *args, **kwargs: as for ``transformers.Trainer``. ``data_collator`` must produce
            ``shift_labels`` (use :class:`RingDataCollator`, e.g. ``ring_plugin.make_collator``,
            or for an image-text model :class:`RingVisionDataCollator`,
            ``ring_plugin.make_vision_collator``);
            with ``cp_size > 1`` the model must use ``attn_implementation="ring_flash"``.

    ``predict()`` returns what it returns at cp 1 under CP too: every row's logits and
    ``shift_labels``, gathered over the CP group in token order (padded rows; packed rows are
    refused there), and ``test_loss``.

    Not supported (clear error at construction): ``compute_loss_func``, label smoothing,
    ``compute_metrics`` with ``cp_size > 1`` (not tested; use ``predict()``), the legacy
    prediction loop, the ``batch_rebalance`` sampling strategy, ``torch.nn.DataParallel``,
    loss terms the model adds to its own loss other than an MoE router load-balancing loss of
    Mixtral's form (which is computed over the CP group's whole sequence and added as the
    stock loss adds it), a z-loss, a
    quantised base model (QLoRA) with ``cp_size > 1``, and ``torch_compile=True`` with
    ``cp_size > 1`` beyond what is compiled and checked (the ring, all-gather and Ulysses
    patterns on dense and packed rows; the error names the rest: trainer_checks.py).
    """

    # compute_loss returns a share already normalised over the whole accumulated step.
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        *args: Any,
        ring_plugin: Optional[RingAttentionPlugin] = None,
        chunked_loss: ChunkedLossConfig | bool | None = None,
        loss_mean: str = "auto",
        **kwargs: Any,
    ):
        check_loss_mean(loss_mean)  # refused before any model is prepared
        self.chunked_loss = chunked_loss if isinstance(chunked_loss, ChunkedLossConfig) else ChunkedLossConfig(chunked_loss)
        self._chunked_loss_notice_given = False
        super().__init__(*args, ring_plugin=ring_plugin, **kwargs)
        # The stock flag decides the stock mean; then True: compute_loss normalises for accumulation.
        stock_accepts = bool(getattr(self, "model_accepts_loss_kwargs", True))
        self.loss_mean = resolve_loss_mean(loss_mean, stock_accepts)
        if departure := departure_from_stock(self.loss_mean, stock_accepts, type(self.model).__name__,
                                             self.args.gradient_accumulation_steps, self.ring_state.dp_size):
            logger.warning(departure)
        self.model_accepts_loss_kwargs = True
        # The MoE load-balancing loss the model adds to its own (checked at construction), or None.
        self.router_balance = router_balance_of(self.model)
        collator = getattr(self.data_collator, "config", None)
        if self.router_balance is not None and isinstance(collator, RingCollatorConfig) and (
                collator.packing or not collator.return_attention_mask):
            # What _router_term would refuse at the first batch, refused before any step.
            raise ValueError(
                f"{self.router_balance.model}'s router load-balancing loss counts the tokens an attention_mask "
                "marks (padding out, as with the stock collator) and runs on padded rows only; build the collator "
                "with make_collator(..., packing=False, return_attention_mask=True)")
        # Pipeline parallelism: this rank's stages and the schedule (hf_ring.training.pp), the model cut now.
        self.pipeline: Optional[TrainerPipeline] = None
        if self.ring_state.mesh.size("pp") > 1:
            raise_together(self._build_pipeline)

    def _build_pipeline(self) -> None:
        transformers_patches.check_checkpoint_methods(Trainer)  # the checkpoint steps PipelineCheckpoints overrides
        self.pipeline = TrainerPipeline(self)
        logger.info(f"[hf_ring] {self.pipeline.describe()}")

    def _computes_token_loss(self) -> bool:
        return type(self).compute_loss is RingTrainer.compute_loss

    # ---- training ----

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """The step's micro-batches and their valid-token count over the whole dp x cp world."""
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        if not batch_samples:
            return batch_samples, None
        local = sum(count_valid_tokens(_shift_labels(b)).to(device) for b in batch_samples)
        return batch_samples, self.ring_plugin.global_token_count(local)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The stock step; under pipeline parallelism the batch through the schedule
        (:class:`~hf_ring.training.pp.trainer.TrainerPipeline`), its loss the same on every rank."""
        if self.pipeline is None:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        inputs = transformers_patches.prepare_inputs(self, inputs)
        _shift_labels(inputs)
        return self.pipeline.train_step(inputs, num_items_in_batch, self.accelerator.sync_gradients)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The stock ``save_model`` (and the base's); under pipeline parallelism one whole model
        gathered from the stages (call on every rank)."""
        if self.pipeline is not None:
            return self.pipeline.save(self, output_dir)
        return super().save_model(output_dir, _internal_call)

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Optional[torch.Tensor] = None,
    ) -> Any:
        """This rank's share of the token-mean loss, scaled for the wrapper's (DDP, FSDP2,
        ZeRO) average over the processes it reduces gradients over."""
        kwargs, shift_labels = _model_inputs(inputs, getattr(self.model, "config", None))
        multiplier = self._loss_multiplier(model)
        token_sum, outputs = self._token_loss_sum(model, kwargs, shift_labels)
        # The router's term: the stock loss adds coef x aux once per micro-batch; the CP ranks share it.
        router_share = self._router_term(outputs, kwargs) / self.ring_state.cp_size
        loss = self._loss_for_backward(token_sum, count_valid_tokens(shift_labels), num_items_in_batch, multiplier,
                                       router_share)
        return (loss, outputs) if return_outputs else loss

    def _loss_for_backward(
        self, token_sum: torch.Tensor, count: torch.Tensor, num_items_in_batch: Optional[torch.Tensor], multiplier: int,
        router_share: torch.Tensor | float = 0.0,
    ) -> torch.Tensor:
        """This rank's share of the step's loss (scalars), times ``multiplier``.
        ``num_items_in_batch``: the step's valid tokens over the world (None outside a
        training step). Under ``loss_mean="micro_batches"`` the micro-batch's count over the
        CP group, divided over the step's micro-batches and the dp ranks (stock's rule).
        ``router_share``: this rank's share of the micro-batch's router loss term, added as
        the stock loss adds it (to the mean of the micro-batch in micro-batch mode)."""
        if num_items_in_batch is not None and self.loss_mean == "micro_batches":
            micro_batch_count = all_reduce_sum(count, self.ring_state.cp_group)
            means = self.current_gradient_accumulation_steps * self.ring_state.dp_size
            return scale_for_ddp((loss_share(token_sum, micro_batch_count) + router_share) / means, multiplier)
        if num_items_in_batch is None:
            num_items_in_batch = self.ring_plugin.global_token_count(count)
        return scale_for_ddp(loss_share(token_sum, num_items_in_batch) + router_share, multiplier)

    def _router_term(self, outputs: Any, kwargs: dict[str, Any]) -> torch.Tensor | float:
        """``coef x`` the router's load-balancing loss over the CP group's whole sequence
        (:mod:`hf_ring.hf.support.router_balance`), the same on every CP rank; 0.0 for a model
        that adds none."""
        if self.router_balance is None:
            return 0.0
        # The stock collator's attention_mask keeps padding out of the loss's token counts; without
        # one the padding, whose amount changes with cp_size, would be counted.
        if "cu_seq_lens_q" in kwargs:
            raise NotImplementedError(
                f"{self.router_balance.model}'s router load-balancing loss on packed rows: each document's padding "
                "(to a multiple of 2 x cp_size) would count among its tokens; train on padded rows "
                "(make_collator(..., packing=False, return_attention_mask=True)) or set "
                "config.output_router_logits=False")
        if kwargs.get("attention_mask") is None:
            raise ValueError(
                f"{self.router_balance.model}'s router load-balancing loss counts the tokens the attention_mask marks "
                "(padding out, as with the stock collator), but the batch has none; build the collator with "
                "make_collator(..., return_attention_mask=True)")
        logits = getattr(outputs, "router_logits", None)
        if not logits:
            raise RuntimeError(f"{self.router_balance.model} has output_router_logits=True but its forward returned no "
                               "router_logits; hf_ring cannot add its load-balancing loss")
        aux = router_balance_loss(tuple(logits), self.router_balance, kwargs.get("attention_mask"),
                                  self.ring_state.cp_group)
        return self.router_balance.coef * aux

    def _token_loss_sum(
        self, model: torch.nn.Module, kwargs: dict[str, Any], shift_labels: torch.Tensor, chunked: bool = True
    ) -> tuple[torch.Tensor, Any]:
        """This rank's token-loss sum and the model's outputs, by chunks when configured."""
        if chunked and self._chunks_the_loss():
            return model_token_loss_sum(model, self.model, kwargs, shift_labels, self.chunked_loss)
        outputs = model(**kwargs)
        return token_loss_sum(outputs.logits, shift_labels), outputs

    def _chunks_the_loss(self) -> bool:
        """Whether the loss is computed by chunks: as configured (None: under CP or TP), with
        FSDP2 and ZeRO-3 too (the loss runs inside the LM head's call, where they hold its
        whole weight). Says so once, naming the wrapper that gathers the weight (read from
        the gradient reduction when a training step has read it: transformers' own FSDP2
        beside TP is no Trainer flag) and the TP split of the vocabulary."""
        tp = self.ring_state.tp_size
        if not self.chunked_loss.active(self.ring_state.cp_size, tp):
            return False
        if not self._chunked_loss_notice_given:
            self._chunked_loss_notice_given = True
            wrapper = ("fsdp2" if getattr(self, "is_fsdp_enabled", False)
                       else "deepspeed" if getattr(self, "is_deepspeed_enabled", False) else "none")
            kind = getattr(self.gradient_reduction, "kind", None)
            if wrapper == "none" and kind in ("fsdp2", "hsdp"):
                wrapper = kind
            split = f", the vocabulary's rows over tp {tp}" if tp > 1 else ""
            logger.info(f"[hf_ring] chunked loss on (weights sharded by: {wrapper}{split}): no full logits")
        return True

    # ---- evaluation ----

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: Optional[list[str]] = None,
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Loss of the CP group's batch (its token mean); adds this rank's totals for eval_loss.

        Returns ``(loss, logits, labels)``; logits and labels only when ``prediction_loss_only``
        is False: the whole rows' logits ``(batch, seq, vocab)`` and ``shift_labels``
        ``(batch, seq)`` (what each position predicts, -100 where nothing), gathered over the
        CP group in token order (:meth:`_whole_rows`).
        """
        inputs = transformers_patches.prepare_inputs(self, inputs)
        if self.pipeline is not None:
            if not prediction_loss_only:
                raise NotImplementedError("predictions (logits) under pipeline parallelism are not composed yet (the "
                                          "last stage alone holds them); evaluate the loss, or predict with pp_size=1")
            token_sum = self.pipeline.eval_token_sum(inputs)
            return self._record_eval_batch(token_sum, count_valid_tokens(_shift_labels(inputs))), None, None
        kwargs, shift_labels = _model_inputs(inputs, getattr(self.model, "config", None))
        with torch.no_grad():
            # Predictions need the full logits; the loss alone does not.
            token_sum, outputs = self._token_loss_sum(model, kwargs, shift_labels, chunked=prediction_loss_only)
            count = count_valid_tokens(shift_labels)
            router_term = self._router_term(outputs, kwargs)
        loss = self._record_eval_batch(token_sum, count) + router_term  # the stock model's loss: CE mean + coef x aux
        if prediction_loss_only:
            return loss, None, None
        return loss, self._whole_rows(outputs.logits.detach(), inputs), self._whole_rows(shift_labels, inputs)

    def _whole_rows(self, local: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """This rank's shard ``(batch, local_seq, ...)`` of a batch's rows, as whole rows
        ``(batch, seq, ...)`` in token order (collective over the CP group; itself at cp 1).

        Raises:
            NotImplementedError: packed rows under CP (each document is sharded on its own).
        """
        state = self.ring_state
        if state.cp_size == 1:
            return local
        if "cu_seq_lens_q" in inputs:
            raise NotImplementedError(
                "predictions of packed rows under context parallelism are not supported (each document is "
                "sharded on its own); predict on padded rows (make_collator(..., packing=False)), or with cp_size=1"
            )
        return gather_rows(local, state.cp_group, state.cp_size, state.layout)

