"""The private attributes of transformers' configs, models and ``Trainer`` that hf_ring reads
or calls, each through an accessor that checks the release line and the attribute's shape
first (the same in 4.57.6 and 5.24.0).

Owns: ``attn_implementation``, ``train_batch_size``, ``prepare_inputs``,
``set_checkpoint_function``, ``wrap_checkpoint_function``, ``drop_absent_no_split_modules``, ``eval_gather_replaced``,
``tensor_parallel_forward``, ``tensor_parallel_output_whole``, ``distributed_config_takes_sizes``,
``check_checkpoint_methods``. Imports nothing of transformers itself (it is handed the objects).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator

from .versions import fail, installed_version


def attn_implementation(config: Any) -> str | None:
    """``config._attn_implementation``: the attention implementation the model of ``config``
    runs (``"sdpa"``, ``"ring_flash"``, ...), or None when the config names none yet.

    Raises:
        UnsupportedTransformersVersion: an unsupported transformers version, or a config
            class whose ``_attn_implementation`` is not the property 4.57.6 and 5.24.0 have.
    """
    version = installed_version()
    if not isinstance(getattr(type(config), "_attn_implementation", None), property):
        raise fail(f"{type(config).__name__}._attn_implementation is not a property", version)
    name = config._attn_implementation
    if name is not None and not isinstance(name, str):
        raise fail(f"{type(config).__name__}._attn_implementation is {name!r}, not a name", version)
    return name


def train_batch_size(trainer: Any) -> int:
    """``trainer._train_batch_size``: the per-device batch size of the current training run.

    Raises:
        UnsupportedTransformersVersion: an unsupported transformers version, or a Trainer
            that holds no int ``_train_batch_size`` (set by ``Trainer.__init__``).
    """
    version = installed_version()
    size = vars(trainer).get("_train_batch_size")
    if not isinstance(size, int) or isinstance(size, bool):
        raise fail(f"{type(trainer).__name__}._train_batch_size is {size!r}, not an int", version)
    return size


@functools.lru_cache(maxsize=None)
def _prepare_inputs_parameters(trainer_class: type) -> list[str] | None:
    method = getattr(trainer_class, "_prepare_inputs", None)
    return list(inspect.signature(method).parameters) if callable(method) else None


def prepare_inputs(trainer: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """``trainer._prepare_inputs(inputs)``: the batch as the model's forward takes it (tensors
    on the Trainer's device).

    Raises:
        UnsupportedTransformersVersion: an unsupported transformers version, or a Trainer
            whose ``_prepare_inputs`` is missing or takes other parameters than ``inputs``.
    """
    version = installed_version()
    params = _prepare_inputs_parameters(type(trainer))
    if params != ["self", "inputs"]:
        raise fail(f"{type(trainer).__name__}._prepare_inputs has parameters {params}", version)
    return trainer._prepare_inputs(inputs)


def set_checkpoint_function(model: Any, checkpoint_function: Callable) -> None:
    """Make every checkpointed layer of ``model`` call ``checkpoint_function(fn, *args)``
    instead of ``torch.utils.checkpoint.checkpoint`` (``PreTrainedModel._set_gradient_checkpointing``,
    the same in 4.57.6 and 5.24.0). Activation checkpointing must already be enabled.

    Raises:
        UnsupportedTransformersVersion: an unsupported version, or a model whose
            ``_set_gradient_checkpointing`` takes other parameters.
    """
    version = installed_version()
    method = getattr(model, "_set_gradient_checkpointing", None)
    params = list(inspect.signature(method).parameters) if callable(method) else None
    if params is None or params[:2] != ["enable", "gradient_checkpointing_func"]:
        raise fail(f"{type(model).__name__}._set_gradient_checkpointing has parameters {params}", version)
    method(enable=True, gradient_checkpointing_func=checkpoint_function)


def wrap_checkpoint_function(layer: Any, wrap: Callable[[Callable], Callable]) -> None:
    """Replace the checkpoint function of ``layer``, a checkpointed decoder layer with
    checkpointing on, by ``wrap(function)``, unless it is one ``wrap`` made already (marked
    ``_hf_ring_wrapped``). The function is called as ``function(partial_forward, *args)``
    (``layer._gradient_checkpointing_func``, set by ``_set_gradient_checkpointing``; the
    same in 4.57.6 and 5.24.0) and the partial holds the layer's keyword arguments.

    Raises:
        UnsupportedTransformersVersion: an unsupported version, or a layer with
            checkpointing on and no callable ``_gradient_checkpointing_func``.
    """
    if not getattr(layer, "gradient_checkpointing", False):
        return
    version = installed_version()
    function = getattr(layer, "_gradient_checkpointing_func", None)
    if not callable(function):
        raise fail(f"{type(layer).__name__}._gradient_checkpointing_func is {function!r}", version)
    if not getattr(function, "_hf_ring_wrapped", False):
        wrapped = wrap(function)
        wrapped._hf_ring_wrapped = True
        layer._gradient_checkpointing_func = wrapped


def drop_absent_no_split_modules(model: Any) -> list[str]:
    """Drop from ``model._no_split_modules`` the class names that no module of ``model`` has;
    returns the names dropped.

    Why: accelerate's FSDP auto-wrap wraps the classes the model lists there and raises
    when one is missing, and transformers 5.24's ``Qwen3_5ForCausalLM`` (text only) lists
    its vision block. The list is set on the model itself, shadowing the class's.
    """
    names = getattr(model, "_no_split_modules", None)
    if not isinstance(names, (list, tuple, set)):
        return []
    present = {type(m).__name__ for m in model.modules()}
    dropped = [n for n in names if n not in present]
    if dropped:
        model._no_split_modules = [n for n in names if n in present]
    return dropped


@contextlib.contextmanager
def eval_gather_replaced(trainer: Any, gather: Callable[[Any], Any]) -> Iterator[None]:
    """While open, ``trainer.gather_function`` is ``gather``: what the stock
    ``evaluation_loop`` calls on every batch's ``losses.repeat(batch_size)`` (and on logits,
    labels, inputs) to collect them over the processes (4.57.6 and 5.24.0: set to
    ``accelerator.gather_for_metrics`` in ``create_accelerator_and_postprocess``, reset to it
    at the end of the loop). Restored to what it was on exit.

    Raises:
        UnsupportedTransformersVersion: an unsupported version, or a Trainer without a
            callable ``gather_function``.
    """
    version = installed_version()
    before = vars(trainer).get("gather_function")
    if not callable(before):
        raise fail(f"{type(trainer).__name__}.gather_function is {before!r}, not a callable", version)
    trainer.gather_function = gather
    try:
        yield
    finally:
        trainer.gather_function = before


# The name of the forward transformers' tensor parallelism installs on a sharded module
# (``TensorParallelLayer.install_forward``, read in 5.24.0): it replaces ``module.forward`` by a
# closure that transforms the inputs, runs the original forward and transforms its output.
_TP_FORWARD = "TensorParallelLayer.install_forward.<locals>.tp_forward"


def tensor_parallel_forward(module: Any) -> bool:
    """Whether ``module``'s own ``forward`` attribute is the one transformers' tensor
    parallelism installed on it (and nothing else's)."""
    forward = vars(module).get("forward")
    return forward is not None and getattr(forward, "__qualname__", "") == _TP_FORWARD


def distributed_config_takes_sizes() -> bool:
    """Whether transformers' ``DistributedConfig`` takes ``tp_size`` and ``fsdp_size`` (5.x;
    4.57's takes neither), i.e. whether a model can be loaded tensor-parallel beside CP."""
    import dataclasses

    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return False
    return dataclasses.is_dataclass(DistributedConfig) and {"tp_size", "fsdp_size"} <= {
        f.name for f in dataclasses.fields(DistributedConfig)}


def tensor_parallel_output_whole(module: Any) -> "bool | None":
    """Whether the forward transformers' tensor parallelism installed on ``module`` leaves
    both its input and its output whole on every TP rank (None: no such forward).

    Reads the style object the installed forward closes over (``self`` of
    ``TensorParallelLayer.install_forward``, 5.24.0): a ``ColwiseParallel`` or
    ``RowwiseParallel`` whose ``input_layouts`` and ``output_layouts`` are both
    ``Replicate`` (``colwise_gather_output``, ``colwise_rep``, ``rowwise_rep``,
    ``rowwise_split_input``), or the plain ``TensorParallelLayer`` of ``replicate``. Any
    other style splits what it computes (``ReplicatedWithGradAllReduce`` too: it sits on
    norms that see one rank's heads).
    """
    if not tensor_parallel_forward(module):
        return None
    forward = vars(module)["forward"]
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
    if "self" not in cells:
        raise fail("TensorParallelLayer.install_forward's tp_forward no longer closes over its style (self)",
                   installed_version())
    style = cells["self"].cell_contents
    name = type(style).__name__
    if name == "TensorParallelLayer":
        return True
    layouts = [getattr(style, a, None) for a in ("input_layouts", "output_layouts")]
    if name in ("ColwiseParallel", "RowwiseParallel") and all(
            layout is not None and layout.is_replicate() for layout in layouts):
        return True
    return False


# The Trainer's checkpoint steps a Ring trainer overrides under pipeline parallelism
# (hf_ring.training.pp.checkpoint), with their parameters: the same in 4.57.6 and 5.25.0.
_CHECKPOINT_METHODS = {
    "_load_from_checkpoint": ["self", "resume_from_checkpoint", "model"],
    "_save_optimizer_and_scheduler": ["self", "output_dir"],
    "_load_optimizer_and_scheduler": ["self", "checkpoint"],
}


def check_checkpoint_methods(trainer_class: type) -> None:
    """Check that ``trainer_class`` (transformers' ``Trainer``) has the private checkpoint
    steps a Ring trainer overrides under pipeline parallelism, with the parameters it
    overrides them with: renamed ones would no longer be called, and the stock steps would
    write the first stage's optimizer state alone and load it into every stage.

    Raises:
        UnsupportedTransformersVersion: an unsupported version, or a step missing or with
            other parameters.
    """
    version = installed_version()
    for name, want in _CHECKPOINT_METHODS.items():
        method = getattr(trainer_class, name, None)
        params = list(inspect.signature(method).parameters) if callable(method) else None
        if params != want:
            raise fail(f"{trainer_class.__name__}.{name} has parameters {params}, not {want}", version)
