"""The private internals of Accelerate that ``RingAttentionPlugin`` relies on.

Under context parallelism every rank of one CP group must load the same batches, so data
loaders are sharded over the data-parallel ranks, not over every process. Accelerate has
no public way to say so: ``Accelerator.prepare`` hands each DataLoader to the Accelerator's
own ``prepare_data_loader``, which shards over the world and registers the result in the
private list ``Accelerator._dataloaders`` (what ``save_state`` / ``load_state``,
``join_uneven_inputs`` and the end-of-data tracking of gradient accumulation read); a
loader it prepared carries the private flag ``_is_accelerate_prepared``. This module is
the one place in hf_ring that knows those names:

- ``install_prepare_data_loader``: puts another DataLoader preparation on one Accelerator,
  so that ``accelerator.prepare(loader)`` (the HF Trainer's path too) runs it;
  ``keep_model_unwrapped``: one model prepared without DDP (pipeline stages);
- ``prepare_data_loader``: ``Accelerator.prepare_data_loader`` with the process
  coordinates given by the caller instead of the world's;
- ``register_data_loader`` / ``is_prepared``: ``_dataloaders`` and
  ``_is_accelerate_prepared``;
- ``enable_fsdp_on_cpu``: ``AcceleratorState.__init__`` keeps an FSDP request on CPU, which
  accelerate 1.15 and 1.16 drop silently (its own section below; written for 1.15.0 and 1.16.0).
- ``allow_parallelism_config_on_cpu``: ``ParallelismConfig._validate_accelerator`` accepts a
  CPU state, for a tensor-parallel model that the Trainer gives a parallelism config (its
  own section below; written for 1.15.0 and 1.16.0).

Written for accelerate 1.10.0 to 1.16.0: the source of ``Accelerator.prepare_data_loader``, of
``accelerate.data_loader.prepare_data_loader``'s signature, of ``_dataloaders``'s creation and of
the ``prepare`` path that calls ``self.prepare_data_loader`` was read in every release from 1.10.0
to 1.16.0 (1.10.0, 1.10.1, 1.11.0, 1.12.0, 1.13.0, 1.14.0, 1.15.0, 1.16.0) and is the same in each
(1.16.0's ``prepare`` remaps optimizer parameters on every backend, not only XLA, and no longer
requires an optimizer beside an FSDP2 model; neither touches the data loaders). A newer 1.x is
accepted with one warning (the table of tested ranges: ``hf_ring.patches.versions``); a version
outside 1.10.0 to 1.x is refused, with an error that names the tested range. Each function also
checks that what it touches has the shape it was written for, and raises
``UnsupportedAccelerateVersion`` otherwise.

accelerate is imported only when a function runs: ``import hf_ring`` needs only torch.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

from packaging.version import Version

from . import versions

# The tested and accepted ranges are the table's (``versions``), the one source of truth.
_TESTED = versions.TESTED["accelerate"]
_INSTALL_HINT = _TESTED.install_hint()

# Accelerator.prepare calls self.prepare_data_loader with these; a replacement must take them.
_PREPARE_PARAMETERS = ["self", "data_loader", "device_placement", "slice_fn_for_dispatch"]
_DATA_LOADER_OPTIONS = frozenset(
    {
        "num_processes",
        "process_index",
        "split_batches",
        "put_on_device",
        "rng_types",
        "dispatch_batches",
        "even_batches",
        "slice_fn_for_dispatch",
        "use_seedable_sampler",
        "data_seed",
        "non_blocking",
        "use_stateful_dataloader",
    }
)

# (data_loader, device_placement, slice_fn_for_dispatch) -> the prepared data loader
PrepareDataLoader = Callable[[Any, Optional[bool], Optional[Callable]], Any]


class UnsupportedAccelerateVersion(RuntimeError):
    """The installed accelerate is one this module does not know the internals of."""


def check_version(version: Optional[str] = None) -> str:
    """``version`` (default: the installed accelerate's) when this module was written for it.

    Raises:
        UnsupportedAccelerateVersion: any version outside accelerate 1.10.0 to 1.x.
    """
    if version is None:
        import accelerate

        version = accelerate.__version__
    return versions.check("accelerate", version, UnsupportedAccelerateVersion)


def _fail(what: str, version: str) -> UnsupportedAccelerateVersion:
    return UnsupportedAccelerateVersion(
        f"cannot use accelerate {version}: {what}. hf_ring's accelerate patches were written for "
        f"accelerate {_TESTED.tested_text()}; install one of those releases (`{_INSTALL_HINT}`) or report "
        "this with your accelerate version"
    )


def _registered_loaders(accelerator: Any, version: str) -> list:
    loaders = getattr(accelerator, "_dataloaders", None)
    if not isinstance(loaders, list):
        raise _fail(
            f"{type(accelerator).__name__}._dataloaders is {type(loaders).__name__}, not the list of "
            "prepared data loaders",
            version,
        )
    return loaders


def is_prepared(data_loader: Any) -> bool:
    """Whether Accelerate already prepared ``data_loader`` (its ``_is_accelerate_prepared``).

    Accelerate sets the flag on what ``Accelerator.prepare`` returned and found registered;
    preparing such a loader again would shard it twice.
    """
    version = check_version()
    flag = getattr(data_loader, "_is_accelerate_prepared", False)
    if not isinstance(flag, bool):
        raise _fail(f"a data loader's _is_accelerate_prepared is {flag!r}, not a bool", version)
    return flag


def register_data_loader(accelerator: Any, data_loader: Any) -> None:
    """Add ``data_loader`` to ``accelerator._dataloaders`` unless it is there (idempotent).

    Registered loaders are the ones ``save_state`` / ``load_state`` checkpoint, and the
    ones whose end of data closes a gradient-accumulation step.
    """
    loaders = _registered_loaders(accelerator, check_version())
    if data_loader not in loaders:
        loaders.append(data_loader)


def prepare_data_loader(
    accelerator: Any,
    data_loader: Any,
    *,
    num_processes: int,
    process_index: int,
    device_placement: Optional[bool] = None,
    slice_fn_for_dispatch: Optional[Callable] = None,
) -> Any:
    """``accelerator.prepare_data_loader(data_loader, ...)`` as Accelerate does it, for
    ``num_processes`` processes of which this is ``process_index``.

    The samplers, seeding, even batches, device placement and ``skip_first_batches``
    support all come from Accelerate; only the coordinates differ. Batches are never
    dispatched from one process: every process loads its own (the caller refuses an
    Accelerator configured with ``dispatch_batches=True``).

    Returns:
        The prepared loader, registered with ``accelerator``; ``data_loader`` itself (now
        registered) when it was prepared already.
    """
    version = check_version()
    from accelerate.data_loader import prepare_data_loader as accelerate_prepare_data_loader
    from accelerate.utils import DistributedType

    missing = _DATA_LOADER_OPTIONS - set(inspect.signature(accelerate_prepare_data_loader).parameters)
    if missing:
        raise _fail(f"accelerate.data_loader.prepare_data_loader takes no {sorted(missing)}", version)
    if is_prepared(data_loader):
        register_data_loader(accelerator, data_loader)
        return data_loader
    if device_placement is None:
        device_placement = accelerator.device_placement and accelerator.distributed_type != DistributedType.XLA
    # Accelerate also passes its device mesh, from which prepare_data_loader recomputes
    # num_processes and process_index; that would undo the coordinates given here.
    prepared = accelerate_prepare_data_loader(
        data_loader,
        accelerator.device,
        num_processes=num_processes,
        process_index=process_index,
        split_batches=accelerator.split_batches,
        put_on_device=device_placement,
        rng_types=list(accelerator.rng_types),
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        slice_fn_for_dispatch=slice_fn_for_dispatch,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )
    register_data_loader(accelerator, prepared)
    return prepared


def install_prepare_data_loader(accelerator: Any, prepare: PrepareDataLoader) -> None:
    """Make ``accelerator.prepare(loader)`` call ``prepare`` for data loaders.

    ``Accelerator.prepare`` hands every DataLoader to ``self.prepare_data_loader(obj,
    device_placement=...)``; an attribute of that name on this one Accelerator shadows the
    class's method, so other Accelerators are untouched. Installing again replaces the
    previous one.
    """
    version = check_version()
    method = getattr(type(accelerator), "prepare_data_loader", None)
    if not callable(method):
        raise _fail(f"{type(accelerator).__name__}.prepare_data_loader is missing", version)
    params = list(inspect.signature(method).parameters)
    if params != _PREPARE_PARAMETERS:
        raise _fail(f"{type(accelerator).__name__}.prepare_data_loader has parameters {params}", version)
    # What prepare() returns is registered in _dataloaders: an Accelerator without that list
    # is refused here rather than at its first prepare().
    _registered_loaders(accelerator, version)

    def prepare_data_loader(
        data_loader: Any, device_placement: Optional[bool] = None, slice_fn_for_dispatch: Optional[Callable] = None
    ) -> Any:
        return prepare(data_loader, device_placement, slice_fn_for_dispatch)

    accelerator.prepare_data_loader = prepare_data_loader


def keep_model_unwrapped(accelerator: Any, model: Any) -> None:
    """``accelerator.prepare`` (via ``self.prepare_model``, read in 1.16.0) wraps ``model`` in no DDP."""
    version = check_version()
    method = getattr(type(accelerator), "prepare_model", None)
    if not callable(method) or "evaluation_mode" not in inspect.signature(method).parameters:
        raise _fail(f"{type(accelerator).__name__}.prepare_model takes no evaluation_mode", version)

    def prepare_model(obj: Any, device_placement: Optional[bool] = None, evaluation_mode: bool = False) -> Any:
        return method(accelerator, obj, device_placement, evaluation_mode or obj is model)

    accelerator.prepare_model = prepare_model


# ---- FSDP on CPU (MULTI_CPU) ----
#
# Accelerate 1.15 turns an FSDP request (an FSDP plugin, or ACCELERATE_USE_FSDP=true from
# `accelerate launch` with an FSDP config) into DistributedType.FSDP only for GPU-like
# distributed types; on CPU the state stays MULTI_CPU, the plugin is never kept and
# prepare() wraps the model in plain DDP, with correct-looking losses. PyTorch's FSDP2 runs
# on CPU with gloo, so the same request is honoured here the way the GPU branch of
# ``AcceleratorState.__init__`` honours it (that branch's source was read in 1.15.0 and
# 1.16.0, the same but for an fp8 error message;
# older releases are refused, newer 1.x accepted behind the shape check of
# ``enable_fsdp_on_cpu``: a release that keeps the request itself leaves nothing to patch,
# since the wrapper acts only on a state that stayed MULTI_CPU).
_CPU_FSDP_WRITTEN_FOR = ("1.15.0", "1.16.0")
_CPU_FSDP_MARK = "_hf_ring_cpu_fsdp"


def _check_cpu_fsdp_version(version: str) -> None:
    if Version(version) < Version(_CPU_FSDP_WRITTEN_FOR[0]):
        raise UnsupportedAccelerateVersion(
            f"FSDP on CPU needs hf_ring's patch of AcceleratorState, written for accelerate "
            f"{', '.join(_CPU_FSDP_WRITTEN_FOR)}; accelerate {version} is older. Install "
            f'`pip install "accelerate>=1.15,<2"`, or train on GPUs (where accelerate builds FSDP itself)'
        )


def fsdp_requested_by_environment() -> bool:
    """Whether ``accelerate launch`` asked for FSDP (an FSDP config sets ACCELERATE_USE_FSDP)."""
    import os

    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def enable_fsdp_on_cpu() -> None:
    """Make ``AcceleratorState`` keep an FSDP request on CPU, as it does on GPUs.

    Idempotent; applies to every Accelerator created afterwards in this process. It changes
    nothing unless FSDP was requested and the state would otherwise be MULTI_CPU (the case
    where accelerate silently falls back to DDP).

    Raises:
        UnsupportedAccelerateVersion: accelerate is not a release whose ``AcceleratorState``
            this patch was written for.
    """
    version = check_version()
    _check_cpu_fsdp_version(version)
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, _CPU_FSDP_MARK, False):
        return
    params = inspect.signature(original).parameters
    if "fsdp_plugin" not in params or not hasattr(AcceleratorState, "_shared_state"):
        raise _fail("AcceleratorState.__init__ takes no fsdp_plugin", version)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        shared = type(self)._shared_state
        already = bool(shared) and shared != PartialState._shared_state
        original(self, *args, **kwargs)
        if already or self.distributed_type != DistributedType.MULTI_CPU:
            return
        plugin = inspect.signature(original).bind(self, *args, **kwargs).arguments.get("fsdp_plugin")
        if plugin is None and not fsdp_requested_by_environment():
            return
        if plugin is None:
            raise _fail("FSDP was requested through the environment but no FSDP plugin was built", version)
        # What the GPU branch does for MULTI_GPU and the like.
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no":
            plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = plugin
        PartialState._shared_state["distributed_type"] = self.distributed_type

    setattr(__init__, _CPU_FSDP_MARK, True)
    AcceleratorState.__init__ = __init__


# A model loaded with transformers' ``DistributedConfig(tp_size=...)`` makes the Trainer build
# ``ParallelismConfig(tp_size=..., dp_shard_size=...)`` for its Accelerator, whose
# ``ParallelismConfig._validate_accelerator`` accepts only FSDP2, GPU-like and DeepSpeed states:
# on CPU (MULTI_CPU, gloo) it raises, though the model owns its placement and gradient
# reduction and nothing of that config needs a GPU. The check is run as for a GPU state;
# everything else it checks (sizes against the world, FSDP's dimensions) still runs. Read in
# accelerate 1.15.0 and 1.16.0 (the same there; the versions of the CPU FSDP patch above).
_CPU_PARALLELISM_MARK = "_hf_ring_cpu_parallelism"


def allow_parallelism_config_on_cpu() -> None:
    """Make ``ParallelismConfig`` validate a MULTI_CPU Accelerator as a multi-device one.

    Idempotent; for every Accelerator created afterwards in this process.

    Raises:
        UnsupportedAccelerateVersion: accelerate is not a release this patch was written for.
    """
    version = check_version()
    _check_cpu_fsdp_version(version)
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    original = getattr(ParallelismConfig, "_validate_accelerator", None)
    if original is None or len(inspect.signature(original).parameters) != 2:
        raise _fail("ParallelismConfig has no _validate_accelerator(self, accelerator)", version)
    if getattr(original, _CPU_PARALLELISM_MARK, False):
        return

    @functools.wraps(original)
    def _validate_accelerator(self: Any, accelerator: Any) -> None:
        state = accelerator.state
        if state.distributed_type != DistributedType.MULTI_CPU:
            return original(self, accelerator)
        state.distributed_type = DistributedType.MULTI_GPU
        try:
            return original(self, accelerator)
        finally:
            state.distributed_type = DistributedType.MULTI_CPU

    setattr(_validate_accelerator, _CPU_PARALLELISM_MARK, True)
    ParallelismConfig._validate_accelerator = _validate_accelerator
