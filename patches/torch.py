"""The private internals of PyTorch that hf_ring's layers above the kernels rely on.

- ``has_forward_hooks(module)``: ``nn.Module._forward_hooks``, the hooks registered with
  ``register_forward_hook`` on one module. The chunked loss never runs the LM head (it
  swaps the head's forward for one that records its input), so a hook there would see an
  empty output and its effect on the logits would be lost; torch has no public way to ask
  whether a module has forward hooks. ``foreign_forward_hooks(module)`` is the same
  question leaving out the hooks of the sharding wrappers (FSDP2's and DeepSpeed ZeRO-3's
  gather / release hooks), which the chunked loss runs under: it computes the loss inside
  the head's call, with the weight those hooks gathered.
- ``fsdp2_reshards_after_forward(module)``: whether the FSDP2 unit ``module`` frees its
  unsharded parameters after its forward (``FSDPModule._get_fsdp_state()._fsdp_param_group
  .post_forward_mesh_info`` is not None; ``set_reshard_after_forward`` is public, its
  getter is not). The chunked loss's backward reuses the LM head's unsharded weight: right
  for Accelerate's tail unit ``[final norm, lm_head]`` (``reshard_after_forward=False``) and
  for the root (never resharded after forward), not for a unit that reshards.

- ``fsdp2_unsharded(model)``: FSDP2's ``FSDPParamGroup.post_forward_mesh_info`` (whether a
  group reshards after its forward) and the root state's ``_lazy_init`` (run on every process
  first: the root's first forward sets its own setting). The rollout
  trainers generate on one rank of each CP group from whole weights that every process
  unsharded together (``FSDPModule.unshard``, public); the forwards of that generation must
  not reshard (the next one would all-gather with the other ranks absent), and afterwards
  each group must reshard after forward as it did before. ``set_reshard_after_forward`` is
  public but writes one value for every module (the root's is specially False), so the
  previous settings are read and put back here.

- ``fsdp2_gradient_divide_factors(model)``: each FSDP2 parameter's ``FSDPParamGroup
  .gradient_divide_factor`` (None: FSDP2's default, the size of the group it reduces over),
  keyed by the module and name its ``FSDPParam._module_info`` holds (the parameter object
  itself is swapped until FSDP2's lazy init). ``set_gradient_divide_factor`` is public, its
  getter is not. transformers sets it on the experts of an expert-parallel model (their gradient
  covers the batches of every data-parallel rank, not of their ``efsdp`` group), and the
  loss multiplier must match what each gradient is really divided by.

Written for torch 2.13.0 and read again on 2.14.1 (``Module.__init__`` and
``register_forward_hook``: ``_forward_hooks`` is an ``OrderedDict`` from handle id to hook
in both). torch is not
refused by version here, since pyproject's range (``torch>=2.5``) is what hf_ring supports;
instead each accessor checks that the attribute has the shape it was written for and
raises ``UnsupportedTorchVersion`` otherwise.

Not here: the private ATen ops the kernels call (``torch.ops.aten._flash_attention_forward``
and its kin). They are the kernels themselves; each backend in ``hf_ring.kernels`` checks
the op's schema before its first call (``cuda_glue.check_op_schema``).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn

WRITTEN_FOR = ("2.13.0", "2.14.1")


class UnsupportedTorchVersion(RuntimeError):
    """The installed torch holds an internal in another shape than the one read here."""


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward hooks of its own (``register_forward_hook``, with or
    without ``with_kwargs``); global hooks (``register_module_forward_hook``) are not counted.

    Raises:
        UnsupportedTorchVersion: a module without the ``_forward_hooks`` dict torch 2.13.0 has.
    """
    hooks = vars(module).get("_forward_hooks")
    if not isinstance(hooks, dict):
        raise UnsupportedTorchVersion(
            f"{type(module).__name__}._forward_hooks is {type(hooks).__name__}, not a dict, in torch "
            f"{torch.__version__}; hf_ring's torch accessors were written for torch {', '.join(WRITTEN_FOR)}: "
            "report this with your torch version"
        )
    return bool(hooks)


def _fsdp2_param_groups(state: object) -> list:
    groups = vars(state).get("_fsdp_param_groups")
    if not isinstance(groups, list) or not all(hasattr(g, "post_forward_mesh_info") for g in groups):
        raise UnsupportedTorchVersion(
            f"FSDP2's state has no _fsdp_param_groups with post_forward_mesh_info in torch {torch.__version__}; "
            f"hf_ring's torch accessors were written for torch {', '.join(WRITTEN_FOR)}: report this with your "
            "torch version")
    return groups


def fsdp2_gradient_divide_factors(model: nn.Module) -> dict[tuple[int, str], "float | None"]:
    """``(id(module), parameter name) -> divide factor`` (None: FSDP2's default) for every
    parameter an FSDP2 unit of ``model`` manages, the module being the one that holds it."""
    from torch.distributed.fsdp import FSDPModule

    factors: dict[tuple[int, str], "float | None"] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in _fsdp2_param_groups(module._get_fsdp_state()):
            params = getattr(group, "fsdp_params", None)
            infos = [getattr(p, "_module_info", None) for p in params] if isinstance(params, list) else [None]
            if not hasattr(group, "gradient_divide_factor") or not all(
                    hasattr(i, "module") and hasattr(i, "param_name") for i in infos):
                raise UnsupportedTorchVersion(
                    f"FSDP2's FSDPParamGroup has no gradient_divide_factor / fsdp_params[i]._module_info in torch "
                    f"{torch.__version__}; hf_ring's torch accessors were written for torch "
                    f"{', '.join(WRITTEN_FOR)}: report this with your torch version")
            for info in infos:
                factors[(id(info.module), info.param_name)] = group.gradient_divide_factor
    return factors


@contextmanager
def fsdp2_unsharded(model: nn.Module) -> Iterator[None]:
    """Every FSDP2 module of ``model`` unsharded (collective over each module's mesh: every
    process must enter together), not resharded by the forwards run inside (which then
    need no collective, so one rank may run them alone), resharded on exit (local), each
    group's reshard-after-forward setting restored. Nothing happens for a model without FSDP2.

    Raises:
        UnsupportedTorchVersion: FSDP2's state not in the shape torch 2.13.0 has.
    """
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        yield
        return
    root = modules[0]._get_fsdp_state()
    if not callable(getattr(root, "_lazy_init", None)):
        raise UnsupportedTorchVersion(f"FSDP2's state has no _lazy_init in torch {torch.__version__}; hf_ring's "
                                      f"torch accessors were written for torch {', '.join(WRITTEN_FOR)}")
    # The root's first forward decides it keeps its weights after forward: on every process now, not
    # inside a generation that one rank runs alone.
    root._lazy_init()
    saved = [(g, g.post_forward_mesh_info) for m in modules for g in _fsdp2_param_groups(m._get_fsdp_state())]
    for module in modules:
        module.unshard()
    for group, _ in saved:
        group.post_forward_mesh_info = None
    try:
        yield
    finally:
        for group, info in saved:
            group.post_forward_mesh_info = info
        for module in modules:
            module.reshard()


# The modules whose forward hooks gather and release parameters around a module's call.
_WRAPPER_HOOK_MODULES = ("torch.distributed.fsdp.", "deepspeed.")


def _defined_in(hook: object) -> str:
    while isinstance(hook, functools.partial):
        hook = hook.func
    return getattr(hook, "__module__", None) or ""


def foreign_forward_hooks(module: nn.Module) -> list[object]:
    """``module``'s own forward hooks (``register_forward_hook``) other than those FSDP2 and
    DeepSpeed register to gather and release its parameters.

    Raises:
        UnsupportedTorchVersion: as :func:`has_forward_hooks`.
    """
    if not has_forward_hooks(module):
        return []
    return [h for h in vars(module)["_forward_hooks"].values() if not _defined_in(h).startswith(_WRAPPER_HOOK_MODULES)]


def fsdp2_reshards_after_forward(module: nn.Module) -> bool:
    """Whether the FSDP2 unit ``module`` (an ``FSDPModule``) reshards its parameters after its
    forward (any of its param groups does). Before the first forward the root's answer may
    still be True: FSDP2 clears it for the root at its lazy initialisation (the first forward).

    Raises:
        UnsupportedTorchVersion: an FSDP2 state without the param groups torch 2.13.0 has.
    """
    return any(g.post_forward_mesh_info is not None for g in _fsdp2_param_groups(module._get_fsdp_state()))
