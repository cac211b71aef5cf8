"""The private internals of DeepSpeed that hf_ring relies on, in one place.

- ``count_data_parallel_ranks``: the world DeepSpeed's batch arithmetic counts. DeepSpeed
  checks ``train_batch_size == micro_batch * gradient_accumulation * world_size``, with
  ``world_size`` every process of the job (when it was handed no model-parallel unit).
  Under hf_ring's context parallelism the ``cp_size`` ranks of a CP group share one batch,
  so the examples per optimizer step are ``micro_batch * gradient_accumulation * dp_size``,
  which fails that check. DeepSpeed has no public way to say "these ranks share batches"
  without engaging its own sequence parallelism (an ``mpu``, or ``sequence_parallel_size``
  with ``data_parallel_size``), which would also change the groups it reduces gradients
  over; hf_ring wants ZeRO to partition and reduce over the whole dp x cp world, exactly as
  without CP. So ``DeepSpeedConfig._configure_train_batch_size`` (the step that fills and
  checks the batch triple, run from ``DeepSpeedConfig.__init__`` right after ``world_size``
  is set) is wrapped to divide ``world_size`` by ``cp_size`` for that step only, and only
  when ``world_size`` is the whole world. Nothing else of DeepSpeed reads that attribute of
  the config (the engine and ZeRO take their world from the process groups).
- ``skip_cpu_shm_comm_build``: no C++ op build when DeepSpeed's communication starts on CPU
  (``deepspeed.ops.__compatible_ops__``).
- ``zero3_model_state`` / ``zero_reduction_group``: what a ZeRO engine holds and the group
  it reduces over (attributes of its ZeRO optimizer), for the memory benchmark and for the
  check that ZeRO reduces over every process.
- ``gathered_when_partitioned``: a ZeRO-3 parameter's whole value outside its module's
  forward (``deepspeed.zero.GatheredParameters``, public), when ZeRO holds only its
  partition now (``param.ds_status``, the attribute ZeRO-3 adds to every parameter). The
  chunked loss recomputes the LM head's logits in backward, after DeepSpeed's hooks have
  released the head's weight.

Written for DeepSpeed 0.19.8: ``DeepSpeedConfig.__init__``, ``_configure_train_batch_size``,
``_set_batch_related_parameters``, ``_batch_assertion``, ``comm.torch.TorchBackend``,
``ops.__init__`` and the stage-1/2 and stage-3 optimizers' constructors were read there.
A newer 0.x (0.19.9, 0.20, ...) is accepted with one warning naming the tested range (the
table: ``hf_ring.patches.versions``), because each function checks the shape of what it
touches and raises ``UnsupportedDeepSpeedVersion`` naming what changed: DeepSpeed's minor
releases may break things, and what they break is refused by name, not by number. An older
release or another major line (1.x) is refused.
deepspeed is imported only when a function runs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Optional

from . import versions

# The tested and accepted ranges are the table's (``versions``), the one source of truth.
_TESTED = versions.TESTED["deepspeed"]
_INSTALL_HINT = _TESTED.install_hint()
# Marks the wrapper installed here, so a second install is a no-op.
_MARK = "_hf_ring_counts_data_parallel_ranks"


class UnsupportedDeepSpeedVersion(RuntimeError):
    """The installed deepspeed is one this module does not know the internals of."""


def check_version(version: Optional[str] = None) -> str:
    """``version`` (default: the installed deepspeed's) when the table accepts it (warns
    once for a release newer than the tested range).

    Raises:
        UnsupportedDeepSpeedVersion: an older release, or one outside 0.x.
    """
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    return versions.check("deepspeed", version, UnsupportedDeepSpeedVersion)


def count_data_parallel_ranks(cp_size: int, world_size: int) -> None:
    """Make every ``DeepSpeedConfig`` built from now on count ``world_size // cp_size`` ranks
    in its batch arithmetic (``train_batch_size = micro_batch * accumulation * dp_size``).

    Applies only to a config whose ``world_size`` is ``world_size`` (the whole job: no other
    data-parallel group was given to DeepSpeed). Installing again with the same sizes is a
    no-op; with other sizes it is refused (one process has one dp x cp grid).

    Raises:
        UnsupportedDeepSpeedVersion: another deepspeed, or the method is not what it was.
        ValueError: sizes that do not divide, or that differ from those installed before.
    """
    version = check_version()
    if cp_size < 1 or world_size % cp_size != 0:
        raise ValueError(f"cp_size={cp_size} does not divide the world of {world_size} processes")
    from deepspeed.runtime.config import DeepSpeedConfig

    current = DeepSpeedConfig.__dict__.get("_configure_train_batch_size")
    params = list(inspect.signature(current).parameters) if callable(current) else None
    if params != ["self"]:
        raise UnsupportedDeepSpeedVersion(
            f"deepspeed {version}: DeepSpeedConfig._configure_train_batch_size is "
            f"{'missing' if params is None else f'taking {params}'}; hf_ring's deepspeed patches were "
            f"written for {_TESTED.tested_text()} (`{_INSTALL_HINT}`)"
        )
    installed = getattr(current, _MARK, None)
    if installed is not None:
        if installed != (cp_size, world_size):
            raise ValueError(
                f"DeepSpeed already counts batches for cp_size={installed[0]} in a world of {installed[1]}; "
                f"one process cannot also use cp_size={cp_size} in a world of {world_size}"
            )
        return
    original = current

    @functools.wraps(original)
    def configure_train_batch_size(self) -> None:
        whole_world = getattr(self, "world_size", None)
        if whole_world != world_size:
            return original(self)
        self.world_size = world_size // cp_size
        try:
            return original(self)
        finally:
            self.world_size = whole_world

    setattr(configure_train_batch_size, _MARK, (cp_size, world_size))
    DeepSpeedConfig._configure_train_batch_size = configure_train_batch_size


_SHM_OP = "deepspeed_shm_comm"


def skip_cpu_shm_comm_build() -> bool:
    """Keep DeepSpeed's communication layer from building its CPU shared-memory op.

    On the CPU accelerator, DeepSpeed's ``TorchBackend`` builds the C++ op
    ``deepspeed_shm_comm`` (torch's JIT extension builder, 1-3 minutes on a small machine,
    guarded by a lock file that a killed build leaves behind, on which every later start
    then waits forever) whenever ``deepspeed.ops.__compatible_ops__`` marks it compatible.
    The op serves only ``inference_all_reduce`` (tensor-parallel inference), which falls back
    to ``torch.distributed.all_reduce`` without it; training never calls it. Marking it
    incompatible in that dict (which DeepSpeed keeps as one module-level dict precisely so
    that edits persist) means no op is built at all. Call before DeepSpeed's communication
    starts. Returns whether the op was marked (False on other accelerators).

    Raises:
        UnsupportedDeepSpeedVersion: another deepspeed, or the dict lacks the op.
    """
    version = check_version()
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__
    if not isinstance(compatible, dict) or _SHM_OP not in compatible:
        raise UnsupportedDeepSpeedVersion(
            f"deepspeed {version}: deepspeed.ops.__compatible_ops__ has no {_SHM_OP!r}; hf_ring's deepspeed "
            f"patches were written for {_TESTED.tested_text()} (`{_INSTALL_HINT}`)"
        )
    compatible[_SHM_OP] = False
    return True


def zero3_model_state(engine: Any) -> dict[str, list]:
    """The tensors that make up a ZeRO-3 engine's model state on this rank, by kind.

    ``parameters``: each parameter's partition (``ds_tensor``, a view of the flat partition
    buffers ``fp16_partitioned_groups_flat``) and its (normally freed) whole tensor; ``gradients``: the flat buffer of gradient partitions and any gradient
    still attached; ``optimizer``: the fp32 master partitions (the parameters' own storage
    when those are float32) and every tensor of the wrapped optimizer's state. Read from the
    stage-3 optimizer's ``fp32_partitioned_groups_flat`` and ``grad_partitions_flat_buffer``.

    Raises:
        UnsupportedDeepSpeedVersion: another deepspeed, or those attributes are missing.
    """
    version = check_version()
    zero = engine.optimizer
    missing = [a for a in ("fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat", "grad_partitions_flat_buffer",
                           "optimizer")
               if not hasattr(zero, a)]
    if missing:
        raise UnsupportedDeepSpeedVersion(
            f"deepspeed {version}: the ZeRO-3 optimizer has no {missing}; hf_ring's deepspeed patches were "
            f"written for {_TESTED.tested_text()} (`{_INSTALL_HINT}`)"
        )
    params = list(engine.module.parameters())
    inner_state = [v for s in zero.optimizer.state.values() for v in s.values() if hasattr(v, "untyped_storage")]
    masters = list(zero.fp32_partitioned_groups_flat)
    return {
        "parameters": [p.ds_tensor for p in params] + [p.data for p in params] + list(zero.fp16_partitioned_groups_flat),
        "gradients": [zero.grad_partitions_flat_buffer] + [p.grad for p in params] + [m.grad for m in masters],
        "optimizer": masters + inner_state,
    }


def zero_reduction_group(engine: Any) -> Any:
    """The process group a ZeRO engine partitions and reduces gradients over (its ZeRO
    optimizer's ``dp_process_group``, stages 1-3).

    Raises:
        UnsupportedDeepSpeedVersion: another deepspeed, or the optimizer has no such group.
    """
    version = check_version()
    if not hasattr(engine.optimizer, "dp_process_group"):
        raise UnsupportedDeepSpeedVersion(
            f"deepspeed {version}: the ZeRO optimizer {type(engine.optimizer).__name__} has no dp_process_group; "
            f"hf_ring's deepspeed patches were written for {_TESTED.tested_text()} (`{_INSTALL_HINT}`)"
        )
    return engine.optimizer.dp_process_group


def gathered_when_partitioned(*params: Any) -> Any:
    """A context in which each of ``params`` (tensors or None) holds its whole value:
    ``GatheredParameters`` (read-only: ``modifier_rank=None``, nothing is written back) over
    the ZeRO-3 parameters that hold only their partition now (collective over ZeRO's group:
    every rank must enter it together); the others are left alone (plain tensors, and ZeRO-3
    parameters gathered already, e.g. by their module's hooks, which release them)."""
    zero3 = [p for p in params if p is not None and hasattr(p, "ds_id")]
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for param in zero3:
        if not isinstance(getattr(param, "ds_status", None), ZeroParamStatus):
            raise UnsupportedDeepSpeedVersion(
                f"a ZeRO-3 parameter's ds_status is {getattr(param, 'ds_status', None)!r}, not a ZeroParamStatus, "
                f"in deepspeed {deepspeed.__version__}; hf_ring was written for {_TESTED.tested_text()} "
                f"(`{_INSTALL_HINT}`)"
            )
    partitioned = [p for p in zero3 if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if not partitioned:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
