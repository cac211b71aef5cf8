"""DeepSpeed ZeRO with context parallelism: what must hold, set up once, and refused otherwise.

ZeRO (stages 1-3) partitions and reduces gradients over DeepSpeed's data-parallel group,
which, when DeepSpeed is handed no model-parallel unit, is every process: the whole
dp x cp world, as with DDP. Its reduction averages over that world, so hf_ring's loss
share scaled by ``world_size`` (:func:`hf_ring.training.loss.scale_for_ddp`) gives exactly the
gradient of a run without CP, and the CP replicas stay identical. What differs from DDP:

- DeepSpeed's communication layer must be initialised over the process group that
  Accelerate built (on CPU, Accelerate builds a gloo group and never tells DeepSpeed, whose
  ZeRO-3 ``zero.Init`` then sees a world of one);
- ``train_batch_size`` counts examples per optimizer step, which under CP is
  ``micro_batch * accumulation * dp_size`` (CP ranks share a batch): the value the HF
  Trainer fills in for ``"auto"`` counts every process and is corrected here, and DeepSpeed's
  own check is made to count data-parallel ranks (:mod:`hf_ring.patches.deepspeed`);
- DeepSpeed's own sequence parallelism (Ulysses: ``sequence_parallel_size`` in the config,
  Accelerate's ``parallelism_config.sp_size``) would split the sequence a second time and
  change the reduction groups: refused together with hf_ring's;
- DeepSpeed requested but not in effect (the model not wrapped in a DeepSpeed engine) is a
  silent downgrade: refused.

:func:`configure` runs when the dp x cp groups are built (before the model is created, so
that ZeRO-3's ``zero.Init`` partitions over the right world); :func:`check_trainer` from
``RingTrainer.__init__``; :func:`check_engine` on the wrapped model once training starts.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch.distributed as dist
from transformers import TrainerCallback

from hf_ring.patterns.state import ContextParallelState

# Keys of a DeepSpeed config that switch on DeepSpeed's own sequence parallelism.
_DS_SEQUENCE_PARALLEL_KEYS = ("sequence_parallel_size", "data_parallel_size", "ulysses")


def hf_deepspeed_config() -> Optional[dict]:
    """The DeepSpeed config the HF ``TrainingArguments`` registered (``"auto"`` values filled
    from them), or None when DeepSpeed is not configured or not installed."""
    try:
        from transformers.integrations import deepspeed_config
    except ImportError:
        return None
    return deepspeed_config()


def _refuse_deepspeed_sequence_parallelism(config: dict, cp_size: int) -> None:
    found = {k: config[k] for k in _DS_SEQUENCE_PARALLEL_KEYS if k in config}
    sp = found.get("sequence_parallel_size", 1)
    if found and (sp not in (1, None) or "ulysses" in found or "data_parallel_size" in found):
        raise ValueError(
            f"the DeepSpeed config asks for DeepSpeed's own sequence parallelism ({found}); hf_ring "
            f"splits the sequence itself (cp_size={cp_size}) and ZeRO must reduce over every process: "
            "remove those keys from the DeepSpeed config and give the CP size to RingAttentionPlugin"
        )


def _train_batch_size(config: dict, state: ContextParallelState) -> None:
    """Make ``train_batch_size`` count data-parallel ranks only (in place)."""
    micro = config.get("train_micro_batch_size_per_gpu")
    accumulation = config.get("gradient_accumulation_steps")
    total = config.get("train_batch_size")
    if not all(isinstance(v, int) for v in (micro, accumulation, total)):
        # The HF Trainer fills "auto" when TrainingArguments are built; anything else is the
        # user's and DeepSpeed resolves it with the data-parallel count (patches.deepspeed).
        return
    per_step = micro * accumulation
    if total == per_step * state.dp_size:
        return
    if total == per_step * state.world_size:
        # What "auto" becomes (every process counted): CP ranks share their batch.
        config["train_batch_size"] = per_step * state.dp_size
        return
    raise ValueError(
        f"the DeepSpeed config's train_batch_size={total} is neither micro_batch x accumulation x "
        f"dp_size = {micro} x {accumulation} x {state.dp_size} = {per_step * state.dp_size} (context-"
        f"parallel ranks share a batch) nor what 'auto' gives; set it to \"auto\" or to "
        f"{per_step * state.dp_size}"
    )


def configure(state: ContextParallelState) -> bool:
    """Set DeepSpeed up for the dp x cp grid of ``state`` when a DeepSpeed config is registered.

    Initialises DeepSpeed's communication over the existing default process group, corrects
    ``train_batch_size`` to count data-parallel ranks, and makes DeepSpeed's batch check
    count them. Idempotent. Returns whether DeepSpeed is configured.

    Raises:
        ValueError: DeepSpeed's own sequence parallelism in the config; a ``train_batch_size``
            that counts neither the data-parallel ranks nor every process.
    """
    config = hf_deepspeed_config()
    if config is None:
        return False
    _refuse_deepspeed_sequence_parallelism(config, state.cp_size)
    _train_batch_size(config, state)
    from hf_ring.patches import deepspeed as deepspeed_patches

    deepspeed_patches.count_data_parallel_ranks(state.cp_size, state.world_size)
    if dist.is_available() and dist.is_initialized():
        import deepspeed

        if not deepspeed.comm.is_initialized():
            # No C++ op build on CPU (its one op serves only inference): see patches.deepspeed.
            deepspeed_patches.skip_cpu_shm_comm_build()
            # Wraps the process group that exists (gloo on CPU, NCCL on GPU); creates none.
            deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)
    return True


@contextmanager
def constructed_whole(training_args: Any) -> Iterator[None]:
    """Build models inside this block whole, not partitioned by ZeRO-3 as they are created.

    Under a ZeRO-3 config, transformers creates a model inside ``deepspeed.zero.Init`` and
    initialises its weights afterwards, gathering one module at a time: random weights then
    consume the random stream in another order than without DeepSpeed, and the same seed
    gives other weights. A model created whole in this block draws exactly what it draws
    without DeepSpeed; ZeRO-3 partitions it when the Trainer wraps it (each rank then holds
    the whole model until that point: use it for models initialised at random, and load a
    checkpoint, whose weights come from the file, outside it). A no-op without a ZeRO-3
    config.
    """
    from transformers.integrations.deepspeed import (
        is_deepspeed_zero3_enabled,
        set_hf_deepspeed_config,
        unset_hf_deepspeed_config,
    )

    hf_config = getattr(training_args, "hf_deepspeed_config", None)
    if hf_config is None or not is_deepspeed_zero3_enabled():
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(hf_config)


def deepspeed_requested(args: Any) -> bool:
    """Whether the user asked for DeepSpeed: ``TrainingArguments.deepspeed`` or ``accelerate
    launch --use_deepspeed`` (``ACCELERATE_USE_DEEPSPEED``)."""
    env = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    return bool(getattr(args, "deepspeed", None)) or env


def check_trainer(trainer: Any, state: ContextParallelState) -> None:
    """Refuse DeepSpeed requested but not in effect, and DeepSpeed's (or Accelerate's) own
    sequence parallelism together with hf_ring's; configure DeepSpeed for the grid."""
    in_effect = bool(getattr(trainer, "is_deepspeed_enabled", False))
    if deepspeed_requested(trainer.args) and not in_effect:
        raise ValueError(
            "DeepSpeed was requested (TrainingArguments.deepspeed or accelerate's --use_deepspeed) but "
            f"the Accelerator runs {trainer.accelerator.distributed_type}: the model would be trained "
            "unsharded (plain DDP) without a word. Create the Accelerator (the Trainer) from a "
            "DeepSpeed config and check the launcher's settings"
        )
    if not in_effect:
        return
    sp = getattr(getattr(trainer.accelerator, "parallelism_config", None), "sp_size", 1) or 1
    if sp > 1:
        raise ValueError(
            f"the Accelerator's parallelism_config asks for DeepSpeed's sequence parallelism (sp_size={sp}) "
            "and hf_ring brings its own: leave sp_size at 1 and give the CP size to RingAttentionPlugin"
        )
    if not configure(state):
        raise ValueError(
            "DeepSpeed is in effect but transformers has no DeepSpeed config registered; pass the config "
            "as TrainingArguments(deepspeed=...)"
        )
    trainer.add_callback(_EngineCheck(trainer, state))


class _EngineCheck(TrainerCallback):
    """Checks the wrapped model once the Trainer has wrapped it (training begins); keeps the
    summary as ``trainer.deepspeed_engine_summary``."""

    def __init__(self, trainer: Any, state: ContextParallelState):
        self._trainer, self._state = trainer, state

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._trainer.deepspeed_engine_summary = check_engine(self._trainer.model_wrapped, self._state)


@dataclass(frozen=True)
class EngineSummary:
    """What a DeepSpeed engine holds on this rank.

    Attributes:
        zero_stage: the ZeRO stage the engine runs.
        partitioned: parameters ZeRO-3 partitioned (each has a ``ds_tensor`` shard).
        parameters: all parameters of the model.
        local_elements: parameter elements this rank holds (its ZeRO-3 shards, or whole
            parameters below stage 3).
        total_elements: parameter elements of the whole model.
        train_batch_size: the examples per optimizer step DeepSpeed counts.
    """

    zero_stage: int
    partitioned: int
    parameters: int
    local_elements: int
    total_elements: int
    train_batch_size: int

    def describe(self) -> str:
        return (
            f"DeepSpeed engine, ZeRO stage {self.zero_stage}: {self.partitioned}/{self.parameters} parameters "
            f"partitioned, this rank holds {self.local_elements} of {self.total_elements} parameter elements; "
            f"train_batch_size {self.train_batch_size}"
        )


def check_engine(model: Any, state: ContextParallelState) -> EngineSummary:
    """Refuse a model that is not a DeepSpeed engine reducing over the whole dp x cp world.

    Args:
        model: what the Trainer trains (``trainer.model_wrapped``).
    """
    from deepspeed import DeepSpeedEngine

    if not isinstance(model, DeepSpeedEngine):
        raise ValueError(
            f"DeepSpeed is configured but the model is a {type(model).__name__}, not a DeepSpeed engine: "
            "its weights are not sharded (a silent downgrade)"
        )
    from hf_ring.patches import deepspeed as deepspeed_patches

    zero = model.zero_optimization()
    dp_world = dist.get_world_size(deepspeed_patches.zero_reduction_group(model)) if zero else None
    if dp_world is not None and dp_world != state.world_size:
        raise ValueError(
            f"ZeRO reduces gradients over {dp_world} ranks but the dp x cp world has {state.world_size}: the "
            "context-parallel ranks of a group would keep different gradients; do not hand DeepSpeed a "
            "data-parallel group (mpu) of its own"
        )
    params = list(model.module.parameters())
    partitioned = [p for p in params if hasattr(p, "ds_tensor")]
    total = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
    local = sum(int(p.ds_tensor.numel()) if hasattr(p, "ds_tensor") else p.numel() for p in params)
    return EngineSummary(
        zero_stage=int(model.zero_optimization_stage()),
        partitioned=len(partitioned),
        parameters=len(params),
        local_elements=local,
        total_elements=total,
        train_batch_size=int(model.train_batch_size()),
    )


def gradient_reduction(model: Any, state: ContextParallelState) -> "weight_sharding.GradientReduction":
    """How the DeepSpeed engine ``model`` reduces gradients: ZeRO averages over its data-parallel
    group, which :func:`check_engine` requires to be the whole dp x cp world."""
    from hf_ring.training import weight_sharding

    check_engine(model, state)
    return weight_sharding.GradientReduction(weight_sharding.ZERO, state.world_size)
