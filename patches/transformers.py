"""Monkey-patches of transformers internals that ``attn_implementation="ring_flash"`` needs.

Written for transformers 4.57.6 (the last 4.x, the oldest with the attention registry)
and 5.24.0; applied to the release lines they belong to (4.57.x and 5.x) and refused,
with an error that says what to install, on any other version.

1. ``flash_name_check`` (5.x only). Transformers 5 takes every implementation name
   containing "flash" for a flash-attention kernel (``utils.generic.
   is_flash_attention_requested``): model creation then tries to load ``ring_flash`` from
   the Hub and fails with "Could not find the currently requested flash attention
   implementation at `ring_flash`", models whose ``_compatible_flash_implementations`` is
   set would silently swap it for a Hub kernel, and vision encoders, generation and mask
   code switch to flash calling conventions (unpadded 2-D masks, ``cu_seqlens``).
   ``ring_flash`` follows SDPA's conventions (4-D masks without context parallelism), so
   the check is wrapped to answer False for it and exactly as before for every other
   name. 4.57.x compares names exactly (``== "flash_attention_2"``,
   ``startswith("flash_attention")``) and needs no such patch.
2. ``model_hook`` (4.57.x and 5.x). ``PreTrainedModel.post_init`` and
   ``set_attn_implementation`` call a hook after they ran, so that every model that asks
   for ``ring_flash`` gets the guard that detects a bypassed ring
   (``hf_ring.hf.guard``) without the user doing anything.

Each patch checks that what it replaces has the shape it was written for, and raises
``UnsupportedTransformersVersion`` otherwise. ``apply`` is idempotent.

The private attributes hf_ring reads are read here too, through accessors that check the
installed release line and the attribute's shape first, so that a transformers release
that renames or reshapes one fails with a clear error instead of a wrong answer (the same
in 4.57.6 and 5.24.0):

- ``attn_implementation(config)``: ``config._attn_implementation``, the attention
  implementation a model runs (transformers has no public reader of it);
- ``train_batch_size(trainer)``: ``Trainer._train_batch_size``, the per-device batch size
  the Trainer trains with (``auto_find_batch_size`` changes it, so the argument's value
  may be stale);
- ``prepare_inputs(trainer, inputs)``: ``Trainer._prepare_inputs``, what moves a batch to
  the device before the model's forward (the stock ``prediction_step`` calls it first);
- ``logit_transform(model, head_attr)``: what a causal LM's forward does to its LM head's
  output before returning it (read from the forward's source), for the chunked loss;
- ``set_checkpoint_function(model, fn)``: ``PreTrainedModel._set_gradient_checkpointing``,
  to checkpoint layers with hf_ring's CPU-offloading checkpoint.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from typing import Any, Callable, Iterable

from packaging.version import Version

WRITTEN_FOR = ("4.57.6", "5.24.0")
_MARK = "_hf_ring_patched"


class UnsupportedTransformersVersion(RuntimeError):
    """The installed transformers is one these patches do not know how to patch."""


def release_line(version: str) -> str:
    """``"4.57"`` or ``"5"``: which set of patches a transformers version gets.

    Raises ``UnsupportedTransformersVersion`` for any other version.
    """
    v = Version(version)
    if Version("4.57") <= v < Version("4.58"):
        return "4.57"
    if Version("5.0.0.dev0") <= v < Version("6"):
        return "5"
    raise UnsupportedTransformersVersion(
        f"hf_ring's transformers patches were written for transformers {' and '.join(WRITTEN_FOR)} "
        f"(release lines 4.57.x and 5.x) and do not know how to patch transformers {version}; "
        'install a supported release, e.g. `pip install "transformers>=4.57,<6"`'
    )


def _fail(what: str, version: str) -> UnsupportedTransformersVersion:
    return UnsupportedTransformersVersion(
        f"cannot patch transformers {version}: {what}. hf_ring's patches were written for "
        f"transformers {' and '.join(WRITTEN_FOR)}; install one of those releases or report "
        "this with your transformers version"
    )


def _patch_flash_name_check(not_flash: frozenset[str], version: str) -> None:
    generic = importlib.import_module("transformers.utils.generic")
    original = getattr(generic, "is_flash_attention_requested", None)
    if original is None:
        raise _fail("transformers.utils.generic.is_flash_attention_requested is missing", version)
    if getattr(original, _MARK, False):
        return
    params = list(inspect.signature(original).parameters)
    if params != ["config", "requested_attention_implementation", "version"]:
        raise _fail(f"is_flash_attention_requested has parameters {params}", version)

    @functools.wraps(original)
    def is_flash_attention_requested(config=None, requested_attention_implementation=None, version=None):
        # Both given is an error upstream; let the original raise it.
        if config is None or requested_attention_implementation is None:
            name = requested_attention_implementation if config is None else config._attn_implementation
            if name in not_flash:
                return False
        return original(config, requested_attention_implementation, version)

    setattr(is_flash_attention_requested, _MARK, True)
    is_flash_attention_requested.original = original
    # Modules already imported hold the function under their own name; modules imported
    # later take it from utils.generic, which now holds the wrapper.
    for name, module in list(sys.modules.items()):
        if (name == "transformers" or name.startswith("transformers.")) and module is not None:
            if vars(module).get("is_flash_attention_requested") is original:
                setattr(module, "is_flash_attention_requested", is_flash_attention_requested)


def _wrap_method(cls: type, name: str, hook: Callable, version: str) -> None:
    original = cls.__dict__.get(name)
    if original is None or not callable(original):
        raise _fail(f"{cls.__name__}.{name} is missing", version)
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        hook(self)
        return result

    setattr(wrapper, _MARK, True)
    wrapper.original = original
    setattr(cls, name, wrapper)


def apply(
    not_flash: Iterable[str], model_hook: Callable, init_hook: Callable | None = None, version: str | None = None
) -> None:
    """Apply the patches for the installed transformers (or ``version``, for tests of the
    version check only: the patches themselves act on the installed package).

    Args:
        not_flash: attention implementation names that transformers must not take for
            flash-attention kernels (``{"ring_flash"}``).
        model_hook: called with every ``PreTrainedModel`` after ``post_init`` and after
            ``set_attn_implementation``.
        init_hook: called with every ``PreTrainedModel`` at the end of
            ``PreTrainedModel.__init__``: the config's attention implementation is resolved,
            the subclass has not built its layers yet (a model that picks its attention
            class by implementation name fails there, e.g. Falcon's ``KeyError``).
        version: defaults to ``transformers.__version__``.

    Raises:
        UnsupportedTransformersVersion: a version or an internal shape these patches were
            not written for.
    """
    import transformers
    from transformers import PreTrainedModel

    version = version or transformers.__version__
    line = release_line(version)
    if line == "5":
        _patch_flash_name_check(frozenset(not_flash), version)
    _wrap_method(PreTrainedModel, "post_init", model_hook, version)
    _wrap_method(PreTrainedModel, "set_attn_implementation", model_hook, version)
    if init_hook is not None:
        _wrap_method(PreTrainedModel, "__init__", init_hook, version)


@functools.lru_cache(maxsize=None)
def _checked_version(version: str) -> str:
    release_line(version)
    return version


def _installed_version() -> str:
    """The installed transformers' version, once it is known to be on a supported line."""
    import transformers

    return _checked_version(transformers.__version__)


def attn_implementation(config: Any) -> str | None:
    """``config._attn_implementation``: the attention implementation the model of ``config``
    runs (``"sdpa"``, ``"ring_flash"``, ...), or None when the config names none yet.

    Raises:
        UnsupportedTransformersVersion: an unsupported transformers version, or a config
            class whose ``_attn_implementation`` is not the property 4.57.6 and 5.24.0 have.
    """
    version = _installed_version()
    if not isinstance(getattr(type(config), "_attn_implementation", None), property):
        raise _fail(f"{type(config).__name__}._attn_implementation is not a property", version)
    name = config._attn_implementation
    if name is not None and not isinstance(name, str):
        raise _fail(f"{type(config).__name__}._attn_implementation is {name!r}, not a name", version)
    return name


def train_batch_size(trainer: Any) -> int:
    """``trainer._train_batch_size``: the per-device batch size of the current training run.

    Raises:
        UnsupportedTransformersVersion: an unsupported transformers version, or a Trainer
            that holds no int ``_train_batch_size`` (set by ``Trainer.__init__``).
    """
    version = _installed_version()
    size = vars(trainer).get("_train_batch_size")
    if not isinstance(size, int) or isinstance(size, bool):
        raise _fail(f"{type(trainer).__name__}._train_batch_size is {size!r}, not an int", version)
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
    version = _installed_version()
    params = _prepare_inputs_parameters(type(trainer))
    if params != ["self", "inputs"]:
        raise _fail(f"{type(trainer).__name__}._prepare_inputs has parameters {params}", version)
    return trainer._prepare_inputs(inputs)


# ---- what a causal LM does between its LM head and its returned logits (chunked loss) ----

# The statements that rebind ``logits`` after the head in the forwards of transformers
# 4.57.6 and 5.24.0 (ast.unparse'd), and the transformation each sequence computes.
# ``hf_ring.memory.chunked_loss`` recomputes exactly these, chunk by chunk; any other sequence
# is refused there.
_KNOWN_LOGIT_TRANSFORMS: dict[tuple[str, ...], str] = {
    (): "identity",
    (
        "logits = logits / self.config.final_logit_softcapping",
        "logits = torch.tanh(logits)",
        "logits = logits * self.config.final_logit_softcapping",
    ): "final_logit_softcapping",
    ("logits = logits * self.logit_scale",): "logit_scale",
    ("logits = logits / self.config.logits_scaling",): "logits_scaling",
}


def _statements_in_order(tree: Any) -> list:
    import ast

    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr))]
    return sorted(nodes, key=lambda n: (n.lineno, n.col_offset))


@functools.lru_cache(maxsize=None)
def _logit_statements(model_class: type, head_attr: str) -> tuple[str, tuple[str, ...]] | str:
    """(the head statement, the statements that rebind ``logits`` after it), or a reason."""
    import ast
    import textwrap

    try:
        source = textwrap.dedent(inspect.getsource(model_class.forward))
    except (OSError, TypeError) as exc:
        return f"the source of {model_class.__name__}.forward cannot be read ({exc})"
    tree = ast.parse(source)

    def is_head_call(node: Any) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == head_attr and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "self")

    head_calls = [n for n in ast.walk(tree) if is_head_call(n)]
    if len(head_calls) != 1:
        return f"{model_class.__name__}.forward calls self.{head_attr}(...) {len(head_calls)} times, not once"
    head, after = None, []
    for node in _statements_in_order(tree):
        if isinstance(node, ast.Expr):
            call = node.value
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == "logits"
                    and call.func.attr.endswith("_")):
                return f"{model_class.__name__}.forward changes the logits in place: {ast.unparse(node)}"
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if not any(isinstance(t, ast.Name) and t.id == "logits" for t in targets):
            continue
        if head is None:
            if not is_head_call(node.value) or not isinstance(node, ast.Assign):
                return f"{model_class.__name__}.forward computes its logits as {ast.unparse(node)}"
            head = ast.unparse(node)
        else:
            after.append(ast.unparse(node))
    if head is None:
        return f"{model_class.__name__}.forward does not assign self.{head_attr}(...) to logits"
    return head, tuple(after)


def logit_transform(model: Any, head_attr: str) -> str:
    """Which transformation ``type(model).forward`` applies to the LM head's output before
    returning it as logits: ``"identity"``, ``"final_logit_softcapping"`` (Gemma 2/3),
    ``"logit_scale"`` (Cohere) or ``"logits_scaling"`` (Granite).

    Read from the forward's source (how transformers writes its causal-LM forwards is an
    implementation detail, hence here, gated on the versions it was checked against).

    Args:
        model: a causal LM (``LlamaForCausalLM``, ...), not wrapped.
        head_attr: the attribute of ``model`` that holds its output embeddings (``"lm_head"``).

    Raises:
        UnsupportedTransformersVersion: an unsupported transformers version.
        NotImplementedError: a forward whose logits are anything else (the message quotes it).
    """
    _installed_version()
    found = _logit_statements(type(model), head_attr)
    if isinstance(found, str):
        raise NotImplementedError(found)
    _, after = found
    kind = _KNOWN_LOGIT_TRANSFORMS.get(after)
    if kind is None:
        raise NotImplementedError(
            f"{type(model).__name__}.forward transforms the LM head's output in a way hf_ring's chunked "
            f"loss does not reproduce: {'; '.join(after)}"
        )
    return kind


def set_checkpoint_function(model: Any, checkpoint_function: Callable) -> None:
    """Make every checkpointed layer of ``model`` call ``checkpoint_function(fn, *args)``
    instead of ``torch.utils.checkpoint.checkpoint`` (``PreTrainedModel._set_gradient_checkpointing``,
    the same in 4.57.6 and 5.24.0). Activation checkpointing must already be enabled.

    Raises:
        UnsupportedTransformersVersion: an unsupported version, or a model whose
            ``_set_gradient_checkpointing`` takes other parameters.
    """
    version = _installed_version()
    method = getattr(model, "_set_gradient_checkpointing", None)
    params = list(inspect.signature(method).parameters) if callable(method) else None
    if params is None or params[:2] != ["enable", "gradient_checkpointing_func"]:
        raise _fail(f"{type(model).__name__}._set_gradient_checkpointing has parameters {params}", version)
    method(enable=True, gradient_checkpointing_func=checkpoint_function)
