"""The monkey-patches of transformers that ``attn_implementation="ring_flash"`` needs:
``apply`` wraps the flash-name check (5.x) and hooks ``PreTrainedModel`` (see the package
docstring for why each exists).

Owns: ``apply`` and the wrappers it installs. Must not import hf_ring (the hooks are passed in).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from typing import Callable, Iterable

from .versions import fail, release_line

_MARK = "_hf_ring_patched"


def _patch_flash_name_check(not_flash: frozenset[str], version: str) -> None:
    generic = importlib.import_module("transformers.utils.generic")
    original = getattr(generic, "is_flash_attention_requested", None)
    if original is None:
        raise fail("transformers.utils.generic.is_flash_attention_requested is missing", version)
    if getattr(original, _MARK, False):
        return
    params = list(inspect.signature(original).parameters)
    if params != ["config", "requested_attention_implementation", "version"]:
        raise fail(f"is_flash_attention_requested has parameters {params}", version)

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
        raise fail(f"{cls.__name__}.{name} is missing", version)
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
