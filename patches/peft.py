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
  ``original_module``), as its ``forward`` reads them (peft 0.21.2 and 0.22.0, the same in
  both: ``peft/utils/other.py``).

A wrapper without those attributes (another PEFT release changed them) is refused with an
error naming what is missing, never guessed at. The version is checked where a PEFT object
is met (``check_version``, the table ``hf_ring.patches.versions``): a newer 0.x than the
tested range is used with one warning, behind those shape checks; another major line or
a release older than the tested range is refused. ``import hf_ring``, and a model without
adapters, never check it.

Beside transformers' tensor parallelism, PEFT splits a LoRA adapter as its base layer is split
(``lora_B`` column-wise under a column-parallel layer, ``lora_A`` row-wise under a row-parallel
one) and installs transformers' forward on it. The two tested releases build it differently
(``peft/tuners/tuners_utils.py``'s ``_get_in_out_features``, ``peft/tuners/lora/model.py``'s
``add_lora_tp_hooks_dtensor``):

- PEFT 0.21.2 sizes the adapter from the local shard of the base weight (``to_local()``) and
  wraps it as a DTensor, leaving that *local* width in ``in_features`` / ``out_features``,
  where transformers' forwards read the *global* width there (``_from_local_last_dim_shard``):
  a row-parallel adapter then fails on its first call. Under a load-time FSDP2 shard
  (``DistributedConfig(fsdp_size=...)``) that local shard is FSDP2's too, and the adapters
  come out the wrong size (every ``lora_B``: its output width).
- PEFT 0.22.0 sizes it from the base layer's whole widths and splits it with transformers'
  own ``shard_param`` (``distribute_tensor(..., src_data_rank=None)``: each rank keeps its
  part of its *own* draw), then broadcasts the unsplit half over the TP group
  (``LoraLayer._sync_tp_replicated_lora_weights``). The widths are global and right under
  ``fsdp_size`` as well. With every process seeded alike, each rank's draw is the whole
  one-process draw and the adapter starts as on one process; seeded otherwise, the split
  parts differ between the dp x cp ranks of one TP coordinate (nothing in PEFT syncs over
  them), which ``hf_ring.training.adapters`` refuses.

:func:`mend_tensor_parallel_widths` sets the global widths, read from the base layer (on
0.22.0 they are already), and refuses by their shape the adapters sized from an FSDP2 shard.
PEFT is imported only when installed and only when a function runs: ``import hf_ring`` does
not need it.

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


def check_version(version: Optional[str] = None) -> str:
    """``version`` (default: the installed PEFT's) when the table accepts it (warns once
    for a release newer than the tested range).

    Raises:
        UnsupportedPEFTVersion: a release older than the tested range, or outside 0.x.
    """
    if version is None:
        import peft

        version = peft.__version__
    return versions.check("peft", version, UnsupportedPEFTVersion)


def _peft():
    if importlib.util.find_spec("peft") is None:
        return None
    import peft

    return peft


def base_model(model: nn.Module) -> nn.Module:
    """The model under PEFT's adapters (``model`` itself when it is not a ``PeftModel``)."""
    peft = _peft()
    if peft is not None and isinstance(model, peft.PeftModel):
        check_version(peft.__version__)
        return model.get_base_model()
    return model


def module_run_by(module: nn.Module) -> Optional[nn.Module]:
    """The module a PEFT ``ModulesToSaveWrapper`` runs in its forward now, or None when
    ``module`` is not one.

    Raises:
        NotImplementedError: several active adapters (the wrapper would run only the first,
            a set-up hf_ring has not checked).
        UnsupportedPEFTVersion: a release the table refuses, or a wrapper without the
            attributes its forward reads in peft 0.21.2.
    """
    peft = _peft()
    if peft is None:
        return None
    from peft.utils import ModulesToSaveWrapper

    if not isinstance(module, ModulesToSaveWrapper):
        return None
    check_version(peft.__version__)
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


def _holds_its_part(weight, dim: int, width: int) -> bool:
    """Whether ``weight`` (a plain tensor, or a DTensor split along ``dim`` by one placement)
    is ``width`` wide along ``dim`` and, split, holds this rank's ``torch.chunk`` part of it."""
    if weight.shape[dim] != width:
        return False
    if not hasattr(weight, "to_local"):
        return True
    size, rank = weight.device_mesh.size(), weight.device_mesh.get_local_rank()
    per = -(-width // size)
    split = any(not p.is_replicate() for p in weight.placements)
    return weight.to_local().shape[dim] == (max(0, min(per, width - rank * per)) if split else width)


def mend_tensor_parallel_widths(model: nn.Module) -> int:
    """Give every LoRA ``lora_A`` / ``lora_B`` of a tensor-parallel ``model`` the global
    ``in_features`` / ``out_features`` of its base layer (see the module docstring).

    Returns:
        How many LoRA layers were mended (0 for a model without adapters).

    Raises:
        NotImplementedError: adapters PEFT sized from an FSDP2 shard of their base layer
            (PEFT 0.21 reads the local weight's shape of a model sharded over ``fsdp_size`` at load).
        UnsupportedPEFTVersion: a LoRA layer without ``get_base_layer``, ``lora_A`` or ``lora_B``.
    """
    peft = _peft()
    if peft is None:
        return 0
    from peft.tuners.lora import LoraLayer

    mended, wrong = 0, []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        check_version(peft.__version__)
        missing = [a for a in ("get_base_layer", "lora_A", "lora_B") if not hasattr(module, a)]
        if missing:
            raise UnsupportedPEFTVersion(f"PEFT {peft.__version__}'s {type(module).__name__} has no {', '.join(missing)} "
                                         f"(written for PEFT {versions.TESTED['peft'].tested_text()}); report it")
        base = module.get_base_layer()
        if not isinstance(base, nn.Linear):  # embeddings and convolutions: not split by transformers' TP styles
            continue
        for adapter in module.lora_A.values():
            adapter.in_features = base.in_features
            if not _holds_its_part(adapter.weight, 1, base.in_features):
                wrong.append(f"{name}.lora_A")
        for adapter in module.lora_B.values():
            adapter.out_features = base.out_features
            if not _holds_its_part(adapter.weight, 0, base.out_features):
                wrong.append(f"{name}.lora_B")
        mended += 1
    if wrong:
        raise NotImplementedError(
            f"PEFT {peft.__version__} sized {len(wrong)} LoRA weights from their base layer's local FSDP2 shard, not "
            f"its whole width ({', '.join(wrong[:2])}{' ...' if len(wrong) > 2 else ''}): transformers had sharded the "
            "model over fsdp_size ranks as it loaded it. Load it with DistributedConfig(tp_size=T, "
            "dp_replicate_size=<dp x cp>) instead (the frozen base weights replicated, only TP splitting them), or "
            "install PEFT >= 0.22.0, which sizes them from the whole layer")
    return mended


def modules_to_save_copies(model: nn.Module) -> list[str]:
    """The paths of PEFT's ``ModulesToSaveWrapper`` modules in ``model`` (trained copies of
    whole modules, ``modules_to_save``); empty without PEFT."""
    peft = _peft()
    if peft is None:
        return []
    from peft.utils import ModulesToSaveWrapper

    copies = [name for name, module in model.named_modules() if isinstance(module, ModulesToSaveWrapper)]
    if copies:
        check_version(peft.__version__)
    return copies
