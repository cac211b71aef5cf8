"""What hf_ring reads of a PEFT model, in one place.

The chunked LM-head loss (``hf_ring.memory.chunked_loss``) never runs the head: it records
the head's input and computes the logits chunk by chunk from the head's weight. Under PEFT
that needs two things PEFT does not say in one public call:

- the causal LM under the adapters (``PeftModel.get_base_model()``, public), whose
  ``lm_head`` is the head (``PeftModelForCausalLM`` holds it two modules down);
- with ``modules_to_save=["lm_head"]``, the module a ``ModulesToSaveWrapper`` runs in its
  forward now: the active adapter's trained copy, or the original head when adapters are
  disabled or the active one has no copy. Read from the wrapper's attributes
  (``disable_adapters``, ``active_adapters``, ``_adapters``, ``modules_to_save``,
  ``original_module``), as its ``forward`` reads them (peft 0.21.2, ``peft/utils/other.py``).

A wrapper without those attributes (another PEFT release changed them) is refused with an
error naming what is missing, never guessed at. PEFT is imported only when installed and
only when a function runs: ``import hf_ring`` does not need it.

Must not import hf_ring's other layers.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch.nn as nn

from . import versions

_WRAPPER_ATTRIBUTES = ("disable_adapters", "active_adapters", "_adapters", "modules_to_save", "original_module")


class UnsupportedPEFTVersion(RuntimeError):
    """The installed PEFT holds a module in a shape this module was not written for."""


def _peft():
    if importlib.util.find_spec("peft") is None:
        return None
    import peft

    return peft


def base_model(model: nn.Module) -> nn.Module:
    """The model under PEFT's adapters (``model`` itself when it is not a ``PeftModel``)."""
    peft = _peft()
    if peft is not None and isinstance(model, peft.PeftModel):
        return model.get_base_model()
    return model


def module_run_by(module: nn.Module) -> Optional[nn.Module]:
    """The module a PEFT ``ModulesToSaveWrapper`` runs in its forward now, or None when
    ``module`` is not one.

    Raises:
        NotImplementedError: several active adapters (the wrapper would run only the first,
            a set-up hf_ring has not checked).
        UnsupportedPEFTVersion: a wrapper without the attributes its forward reads in peft
            0.21.2.
    """
    peft = _peft()
    if peft is None:
        return None
    from peft.utils import ModulesToSaveWrapper

    if not isinstance(module, ModulesToSaveWrapper):
        return None
    missing = [name for name in _WRAPPER_ATTRIBUTES if not hasattr(module, name)]
    if missing:
        raise UnsupportedPEFTVersion(
            f"PEFT {peft.__version__}'s ModulesToSaveWrapper has no {', '.join(missing)}: hf_ring reads which head "
            f"it runs from them (written for PEFT {versions.TESTED['peft'].tested_text()}); turn the chunked loss off, or "
            "report it"
        )
    active = list(module.active_adapters)
    if module.disable_adapters or not active or any(name not in module._adapters for name in active):
        return module.original_module
    if len(active) > 1:
        raise NotImplementedError(
            f"a ModulesToSaveWrapper with {len(active)} active adapters ({', '.join(active)}): hf_ring's chunked "
            "loss computes the head of one; activate one adapter, or turn the chunked loss off"
        )
    return module.modules_to_save[active[0]]
