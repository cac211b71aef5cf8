"""``RingTrainerBase``: what every Ring trainer shares, composed in front of a stock trainer.

Each Ring trainer is ``class RingX(<its own methods>, RingTrainerBase, X)`` for a stock
trainer class ``X`` (transformers' ``Trainer``, TRL's ``SFTTrainer``, ``DPOTrainer``,
``GRPOTrainer``, ``RLOOTrainer``), so that an override here or in a Ring trainer reaches
``X``'s (or a user's subclass of ``X`` placed before it) through ``super()``, never by
naming a class. The base owns:

- construction: the ``ring_plugin`` argument; before ``X`` builds its Accelerator, what
  FSDP on CPU needs (accelerate would otherwise drop FSDP silently); after, the plugin
  attached to the Accelerator (``ring_state``) and the trainer's refusals
  (:meth:`_check_supported`) raised on every rank together;
- bookkeeping: the total train batch size counts data-parallel ranks only;
- the gradient multiplier: how many processes the wrapped model averages gradients over
  (DDP, FSDP2, ZeRO), which a rank's loss share is multiplied by;
- PEFT adapters on a model sharded at load, and saving one whose weights are sharded
  (:mod:`hf_ring.training.adapters`);
- evaluation: the stock loop with its losses gathered over data-parallel ranks only
  (:mod:`hf_ring.training.eval_loss`), and the token mean over the set beside it.

The model and the training arguments are found by binding the constructor's arguments to
``X``'s own signature (``DPOTrainer`` takes ``(model, ref_model, args)``, ``GRPOTrainer``
``(model, reward_funcs, args)``), not by guessing from positions or types.

Must not import TRL or ``hf_ring.training.trainer`` (``RingTrainer`` builds on this).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from transformers import Trainer
from transformers.utils import logging as hf_logging

from hf_ring.distributed.errors import raise_together
from hf_ring.memory.sequence_parallel import enable_sequence_parallel
from hf_ring.patches import accelerate as accelerate_patches
from hf_ring.patches import peft as peft_patches
from hf_ring.patches import transformers as transformers_patches
from hf_ring.training import adapters, deepspeed_support, parallelism_config, weight_sharding
from hf_ring.training.eval_loss import batch_token_mean, data_parallel_gather
from hf_ring.training.loss import LossTotals
from hf_ring.training.plugin import RingAttentionPlugin
from hf_ring.training.trainer_checks import check_trainer_supported

logger = hf_logging.get_logger(__name__)


def stock_trainer_class(cls: type) -> type:
    """The first class after the Ring classes in ``cls``'s method resolution order that is a
    ``transformers.Trainer``: the one whose constructor and methods the Ring trainer extends."""
    for base in cls.__mro__:
        if issubclass(base, Trainer) and not issubclass(base, RingTrainerBase):
            return base
    raise TypeError(f"{cls.__name__} derives from RingTrainerBase but from no transformers.Trainer; "
                    "compose it as class RingX(RingTrainerBase, X) for a Trainer class X")


def model_and_training_args(cls: type, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``(model, args)`` of a call ``cls(*args, **kwargs)``, bound to the stock trainer's signature
    (either may be None: a ``model_init``, the Trainer's default arguments)."""
    stock = stock_trainer_class(cls)
    try:
        bound = inspect.signature(stock.__init__).bind_partial(None, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{cls.__name__} takes the arguments of {stock.__name__} (and ring_plugin=): {e}") from None
    return bound.arguments.get("model"), bound.arguments.get("args")


def _plugin_for(ring_plugin: Optional[RingAttentionPlugin], config: Optional[Any]) -> RingAttentionPlugin:
    """The given plugin, checked against the run's ``ParallelismConfig``; without one, the
    plugin that config describes (or ``cp_size=1``). A config of data axes only sizes nothing."""
    if not parallelism_config.asks_for_sizes(config):
        return ring_plugin if ring_plugin is not None else RingAttentionPlugin(cp_size=1)
    if dist.is_available() and dist.is_initialized():  # TrainingArguments initialise it
        parallelism_config.check_fills_world(config, dist.get_world_size())
    if ring_plugin is None:
        return RingAttentionPlugin.from_parallelism_config(config)
    parallelism_config.check_plugin_agrees(config, ring_plugin.cp_size, ring_plugin.tp_size)
    return ring_plugin


def _prepare_weight_sharding(model: Any, training_args: Any, config: Optional[Any] = None) -> None:
    """What sharded weights need before the Trainer builds its Accelerator: on CPU, accelerate's
    FSDP enabled (it would drop it silently) and, for a model transformers sharded at load
    (``DistributedConfig``: tensor parallelism) or a run given a ``ParallelismConfig``, the
    parallelism config accelerate gets accepted (it would refuse a CPU state); layer classes
    to wrap that the model lacks, dropped."""
    on_cpu = training_args is None or training_args.device.type == "cpu"
    if on_cpu and (getattr(model, "is_distributed_loading_by_transformers", False) or config is not None):
        accelerate_patches.allow_parallelism_config_on_cpu()
    if not weight_sharding.fsdp_requested(training_args, None):
        return
    if on_cpu:
        accelerate_patches.enable_fsdp_on_cpu()
    if model is not None and not isinstance(model, str):
        dropped = transformers_patches.drop_absent_no_split_modules(model)
        if dropped:
            logger.info(f"[hf_ring] FSDP: {type(model).__name__} lists layer classes it does not have "
                        f"({', '.join(dropped)}) among those to wrap; dropped")


class RingTrainerBase:
    """The part of every Ring trainer that is not its loss (see the module docstring).

    Args:
        *args, **kwargs: the stock trainer's.
        ring_plugin: the :class:`RingAttentionPlugin` (its ``cp_size`` and layout); default
            ``RingAttentionPlugin(cp_size=1)``.
    """

    def __init__(self, *args: Any, ring_plugin: Optional[RingAttentionPlugin] = None, **kwargs: Any):
        model, training_args = model_and_training_args(type(self), args, kwargs)
        # TrainingArguments' parallelism_config (or accelerate launch's) sizes hf_ring's CP and TP.
        self._parallelism_config = parallelism_config.requested_parallelism_config(training_args)
        self.ring_plugin = _plugin_for(ring_plugin, self._parallelism_config)
        _prepare_weight_sharding(model, training_args, self._parallelism_config)
        # How the wrapped model reduces gradients; read from it at the first training step.
        self.gradient_reduction: Optional[weight_sharding.GradientReduction] = None
        self._eval_totals: Optional[LossTotals] = None
        super().__init__(*args, **kwargs)
        self.ring_state = self.ring_plugin.attach(self.accelerator)
        # A set-up refused on some ranks only (a collator built for another CP rank) is raised on every
        # rank, instead of leaving the others to die in their next collective with nothing named.
        raise_together(self._check_supported)
        raise_together(self._prepare_sequence_parallel)
        raise_together(lambda: adapters.prepare_adapters(self.model, self.ring_state))

    def _prepare_sequence_parallel(self) -> None:
        """A model loaded with ``DistributedConfig(enable_sequence_parallel=True)``, which
        transformers reserves and does not wire, gets hf_ring's sequence parallelism inside TP
        (``memory/sequence_parallel.py``): each TP rank keeps 1/tp of its tokens between blocks."""
        base = peft_patches.base_model(self.model)
        config = getattr(getattr(base, "config", None), "distributed_config", None)
        if getattr(config, "enable_sequence_parallel", False):
            plan = enable_sequence_parallel(base)
            logger.info(f"[hf_ring] sequence parallelism inside TP: {plan.layers} decoder layers keep 1/{plan.tp_size} "
                        "of each rank's tokens between their attention and MLP")

    def create_accelerator_and_postprocess(self) -> None:
        """The stock Accelerator, given the run's ``ParallelismConfig`` with its CP axis folded
        into ``dp_shard`` (:func:`parallelism_config.accelerate_view`): hf_ring runs the CP,
        so Accelerate must not engage torch's (nor build it from accelerate launch's
        environment)."""
        if self._parallelism_config is None:
            return super().create_accelerator_and_postprocess()
        view = parallelism_config.accelerate_view(
            self._parallelism_config, fsdp=weight_sharding.fsdp_requested(self.args, None),
            sharded_at_load=getattr(self.model, "is_distributed_loading_by_transformers", False))
        with parallelism_config.given_to_accelerate(self.args, view):
            return super().create_accelerator_and_postprocess()

    def _check_supported(self) -> None:
        """Raise for what this trainer cannot run exactly; called once, at construction, on every
        rank together. Ring trainers extend it with their own refusals (``super()`` first)."""
        check_trainer_supported(self, subclass_loss=not self._computes_token_loss())
        deepspeed_support.check_trainer(self, self.ring_state)

    def _computes_token_loss(self) -> bool:
        """Whether the loss is ``RingTrainer``'s token cross-entropy (then the terms a model adds
        to its own loss are refused); a trainer with a loss of its own handles them."""
        return False

    # ---- training ----

    def get_total_train_batch_size(self, args: Any) -> int:
        """Examples per optimizer step: CP ranks share a batch, so only data-parallel ranks count."""
        return transformers_patches.train_batch_size(self) * args.gradient_accumulation_steps * self.ring_state.dp_size

    def _loss_multiplier(self, model: torch.nn.Module) -> int:
        """What this rank's loss share is multiplied by: the number of processes the wrapped
        ``model`` averages gradients over. Call it before the forward (FSDP2's parameters
        are sharded then). Without gradients (a subclass evaluating through compute_loss) no
        wrapper reduces anything; every multiplier that gradient_reduction accepts equals the
        dp x cp ranks (the world without tensor parallelism)."""
        return self._gradient_multiplier(model) if torch.is_grad_enabled() else self.ring_state.loss_size

    def _check_gradients_averaged_over_world(self, model: torch.nn.Module) -> None:
        """The TRL trainers' gathered rows give each rank ``cp_size`` times its share: exact
        under a wrapper averaging over every process; checked (and recorded) with gradients."""
        multiplier = self._loss_multiplier(model)
        if multiplier != self.ring_state.loss_size:
            raise NotImplementedError(f"{type(self).__name__} needs gradients averaged over all "
                                      f"{self.ring_state.loss_size} dp x cp processes; the wrapper averages over "
                                      f"{multiplier}")

    def _gradient_multiplier(self, model: torch.nn.Module) -> int:
        """The loss multiplier for how ``model`` (wrapped) reduces gradients; checked once."""
        if self.gradient_reduction is None and getattr(self, "is_deepspeed_enabled", False):
            self.gradient_reduction = deepspeed_support.gradient_reduction(model, self.ring_state)
        if self.gradient_reduction is None:
            self.gradient_reduction = weight_sharding.gradient_reduction(
                model, fsdp_requested=weight_sharding.fsdp_requested(self.args, self.accelerator),
                tp_size=self.ring_state.tp_size,
            )
        return self.gradient_reduction.multiplier

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The stock ``save_model``, except that a PEFT adapter under FSDP2 with a sharded state
        dict is gathered and written (call on every rank, as the Trainer does)."""
        if adapters.saves_sharded_adapter(self):
            adapters.save_sharded_adapter(self, output_dir if output_dir is not None else self.args.output_dir)
            return
        super().save_model(output_dir, _internal_call)

    # ---- evaluation ----

    def _record_eval_batch(self, token_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """Add this rank's ``(token loss sum, valid count)`` (scalars) to the eval totals; return the
        batch's token-mean loss over the CP group (float32 scalar, NaN without a valid token, as
        the stock model's; collective over the CP group)."""
        if self._eval_totals is not None:
            self._eval_totals.add(token_sum, count)
        return batch_token_mean(token_sum, count, self.ring_state.cp_group)

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: Optional[bool] = None,
        ignore_keys: Optional[list[str]] = None,
        metric_key_prefix: str = "eval",
    ) -> Any:
        """The stock loop and its ``{prefix}_loss`` (the mean over samples of their batch's loss),
        with the losses gathered over data-parallel ranks under CP; adds ``{prefix}_token_loss``,
        the token mean over the whole set, when the batches had tokens to count."""
        self._eval_totals = LossTotals()
        gather = self.gather_function
        if self.ring_state.cp_size > 1 or self.ring_state.mesh.size("pp") > 1:
            gather = data_parallel_gather(self.accelerator, self.ring_state)
        try:
            with transformers_patches.eval_gather_replaced(self, gather):
                output = super().evaluation_loop(
                    dataloader,
                    description,
                    prediction_loss_only=prediction_loss_only,
                    ignore_keys=ignore_keys,
                    metric_key_prefix=metric_key_prefix,
                )
            token_mean = self._eval_totals.global_mean(self.args.device, self.ring_state.loss_group)
            if not math.isnan(token_mean):  # the same on every rank: the totals are reduced
                output.metrics[f"{metric_key_prefix}_token_loss"] = token_mean
        finally:
            self._eval_totals = None
        return output
