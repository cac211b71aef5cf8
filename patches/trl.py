"""The private internals of TRL that ``hf_ring.training.trl`` relies on.

``RingSFTTrainer`` computes its loss itself (each rank's share of the token mean over the
whole dp x cp world), so it also keeps the metrics TRL's own ``compute_loss`` would have
logged; and ``RingDPOTrainer`` gives every rank of a CP group the same whole batch, so
TRL's token count, gathered over all processes, repeats each token once per CP rank.
TRL keeps both in private attributes, read and written only here:

- ``metrics(trainer)``: ``SFTTrainer._metrics`` / ``DPOTrainer._metrics``, the per-mode
  lists that ``log`` averages (``{"train": defaultdict(list), "eval": ...}``);
- ``add_train_tokens(trainer, n)``: ``_total_train_tokens``, the running token count
  logged as ``num_tokens``;
- ``set_batch_replicas(trainer, n)``: ``_tp_size``, the number of processes that share
  one batch (TRL's name is for tensor parallelism; DPO divides its token count by it);
- ``reference_model_replaced(trainer, replacement)``: ``DPOTrainer.compute_loss`` calls
  ``self.ref_model`` itself (TRL has no argument for the model it computes the reference
  log-probabilities with), so ``RingDPOTrainer`` points it at the ring for that call;
- ``check_rollout_hooks(cls)``: ``RingGRPOTrainer`` and ``RingRLOOTrainer`` override three
  private methods of TRL's ``GRPOTrainer`` / ``RLOOTrainer`` (``_prepare_inputs``,
  ``_generate_single_turn``, ``_get_per_token_logps_and_entropies``); checked that each
  still exists with the parameters it was written for and that TRL still calls it where the
  override expects;
- ``shuffle_replaced(cls, replacement)``: ``_prepare_inputs`` shuffles each process's
  generation batch with ``shuffle_sequence_dict`` (a global of the trainer's module), drawn
  from the process's own RNG; under CP the CP group's rows are shuffled as one batch
  (:mod:`hf_ring.training.trl.rollouts`);
- ``language_modeling_collator_class()`` / ``vision_collator_class()`` /
  ``fused_output_class()``: TRL's ``DataCollatorForLanguageModeling`` and
  ``DataCollatorForVisionLanguageModeling`` (``trl.trainer.sft_trainer``) and
  ``FusedCausalLMOutput`` (``trl.trainer.utils``), which TRL does not export.

Written for TRL 1.16.0 (the source of ``SFTTrainer`` and ``DPOTrainer``, and of the
modules the two classes above live in, was read for it). A newer 1.x is accepted with one
warning naming the tested range (the table: ``hf_ring.patches.versions``), because each
accessor checks that the attribute or class has the shape it was written for and raises
``UnsupportedTRLVersion`` naming what changed; an older TRL or another major line is refused.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections import defaultdict
from typing import Any, Iterator, Optional

from . import versions

WRITTEN_FOR = ("1.16.0",)
_INSTALL_HINT = versions.TESTED["trl"].install_hint()


class UnsupportedTRLVersion(RuntimeError):
    """The installed TRL is one this module does not know the internals of."""


def check_version(version: Optional[str] = None) -> str:
    """``version`` (default: the installed TRL's) when the table accepts it (warns once
    for a release newer than the tested range).

    Raises:
        UnsupportedTRLVersion: a version older than the tested range or outside TRL 1.x.
    """
    if version is None:
        import trl

        version = trl.__version__
    return versions.check("trl", version, UnsupportedTRLVersion)


def _fail(what: str) -> UnsupportedTRLVersion:
    return UnsupportedTRLVersion(
        f"cannot use this TRL: {what}. hf_ring.training.trl was written for TRL {', '.join(WRITTEN_FOR)}; "
        f"install one of those (`{_INSTALL_HINT}`)"
    )


def metrics(trainer: Any, mode: str) -> defaultdict:
    """The list-of-values dict TRL's ``log`` averages for ``mode`` ("train" or "eval")."""
    check_version()
    table = getattr(trainer, "_metrics", None)
    if not isinstance(table, dict) or not isinstance(table.get(mode), defaultdict):
        raise _fail(f"{type(trainer).__name__}._metrics is not {{'train': defaultdict, 'eval': defaultdict}}")
    return table[mode]


def add_train_tokens(trainer: Any, count: int) -> int:
    """Add ``count`` to TRL's running token count; return the new total."""
    check_version()
    total = getattr(trainer, "_total_train_tokens", None)
    if not isinstance(total, int):
        raise _fail(f"{type(trainer).__name__}._total_train_tokens is {total!r}, not an int")
    trainer._total_train_tokens = total + int(count)
    return trainer._total_train_tokens


@functools.lru_cache(maxsize=None)
def _method_source(cls: type, name: str) -> str:
    try:
        return inspect.getsource(getattr(cls, name))
    except (AttributeError, TypeError, OSError):
        return ""


def _check_reads(cls: type, methods: tuple[str, ...], text: str, what: str) -> None:
    """Raise unless the source of one of ``cls``'s ``methods`` contains ``text``: an attribute
    written here is only worth writing while TRL still reads it there."""
    if not any(text in _method_source(cls, m) for m in methods):
        raise _fail(f"{cls.__name__}.{' / '.join(methods)} no longer {what} (no `{text}` in its source)")


def _trl_class(trainer: Any) -> type:
    for cls in type(trainer).__mro__:
        if cls.__module__.startswith("trl."):
            return cls
    raise _fail(f"{type(trainer).__name__} is not a TRL trainer")


def set_batch_replicas(trainer: Any, replicas: int) -> None:
    """Tell TRL that ``replicas`` processes share each batch (its token count divides by it)."""
    check_version()
    _check_reads(_trl_class(trainer), ("_compute_loss", "compute_loss"), "// self._tp_size",
                 "divides its token count by _tp_size")
    current = getattr(trainer, "_tp_size", None)
    if not isinstance(current, int):
        raise _fail(f"{type(trainer).__name__}._tp_size is {current!r}, not an int")
    if current != 1 and replicas != 1:
        raise ValueError(
            f"tensor parallelism (tp_size={current}) together with context parallelism is not supported; "
            "use one of them"
        )
    trainer._tp_size = current * replicas


@contextlib.contextmanager
def reference_model_replaced(trainer: Any, replacement: Any) -> Iterator[None]:
    """While open, ``trainer.ref_model`` is ``replacement`` (what ``DPOTrainer.compute_loss``
    calls for the reference log-probabilities); the trainer's own is put back on exit.

    Raises:
        UnsupportedTRLVersion: an unsupported TRL version, or a trainer without a
            ``ref_model`` attribute (set by ``DPOTrainer.__init__``).
    """
    check_version()
    if not hasattr(trainer, "ref_model"):
        raise _fail(f"{type(trainer).__name__} has no ref_model attribute")
    original = trainer.ref_model
    trainer.ref_model = replacement
    try:
        yield
    finally:
        trainer.ref_model = original


# The private methods of GRPOTrainer / RLOOTrainer that hf_ring's rollout trainers override,
# the parameters each was written for, and where TRL calls it (a method whose source holds the call).
_ROLLOUT_HOOKS = {
    "_prepare_inputs": (("self", "generation_batch"), "training_step", "_prepare_inputs("),
    "_generate_single_turn": (("self", "prompt_ids", "images", "multimodal_fields"),
                              "_generate", "self._generate_single_turn("),
    "_get_per_token_logps_and_entropies": (("self", "model", "input_ids", "attention_mask", "logits_to_keep",
                                            "batch_size", "compute_entropy", "compute_aux_loss"),
                                           "_compute_loss", "self._get_per_token_logps_and_entropies("),
}


def check_rollout_hooks(cls: type) -> None:
    """Raise unless TRL's ``GRPOTrainer`` or ``RLOOTrainer`` (``cls``) still has the private
    methods hf_ring's rollout trainers override, with the parameters they were written for,
    called where they were (an override TRL no longer calls would leave its rows outside the ring)."""
    check_version()
    for name, (params, caller, call) in _ROLLOUT_HOOKS.items():
        method = getattr(cls, name, None)
        if method is None:
            raise _fail(f"{cls.__name__} has no method {name}")
        have = tuple(inspect.signature(method).parameters)
        if have[: len(params)] != params:
            raise _fail(f"{cls.__name__}.{name} takes {have}, not {params} first")
        if caller != "training_step":  # the Trainer's training_step calls _prepare_inputs
            _check_reads(cls, (caller,), call, f"calls {name}")
    _check_reads(cls, ("_prepare_inputs",), "shuffle_sequence_dict(", "shuffles with shuffle_sequence_dict")


@contextlib.contextmanager
def shuffle_replaced(cls: type, replacement: Any) -> Iterator[None]:
    """While open, TRL's ``cls._prepare_inputs`` (``GRPOTrainer`` / ``RLOOTrainer``) shuffles
    its generation batch with ``replacement`` (a function ``dict -> dict``, as
    ``trl.trainer.utils.shuffle_sequence_dict``)."""
    check_version()
    module = importlib.import_module(cls.__module__)
    original = getattr(module, "shuffle_sequence_dict", None)
    if not callable(original):
        raise _fail(f"{cls.__module__} has no shuffle_sequence_dict")
    module.shuffle_sequence_dict = replacement
    try:
        yield
    finally:
        module.shuffle_sequence_dict = original


def language_modeling_collator_class() -> type:
    """TRL's ``DataCollatorForLanguageModeling``: the collator ``SFTTrainer`` builds by default."""
    return _trl_member("trl.trainer.sft_trainer", "DataCollatorForLanguageModeling")


def vision_collator_class() -> type:
    """TRL's ``DataCollatorForVisionLanguageModeling``: the collator ``SFTTrainer`` builds for a
    dataset with images (its fields ``processor``, ``max_length`` and ``pad_to_multiple_of``
    are read)."""
    return _trl_member("trl.trainer.sft_trainer", "DataCollatorForVisionLanguageModeling")


def fused_output_class() -> type:
    """TRL's ``FusedCausalLMOutput``: what a model called with ``fused_lm_head=True`` returns."""
    return _trl_member("trl.trainer.utils", "FusedCausalLMOutput")


def _trl_member(module: str, name: str) -> type:
    check_version()
    member = getattr(importlib.import_module(module), name, None)
    if not isinstance(member, type):
        raise _fail(f"{module} has no class {name}")
    return member
