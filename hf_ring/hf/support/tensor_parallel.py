"""A tensor-parallel model under context parallelism: its TP group must be the state's.

Why: under tensor parallelism (transformers' ``DistributedConfig(tp_size=T)``) each rank's
attention sees its own heads only, as plain tensors: q/k/v are split column-wise by whole
heads. A ring over those local heads is exact if every rank of a CP group holds the **same**
heads, i.e. the CP group holds ranks of one TP coordinate. hf_ring's mesh puts TP
innermost (``hf_ring.distributed.mesh``), as transformers' dense mesh
``(pp, dp_replicate, fsdp, tp)`` does, so with ``setup_context_parallel(cp_size=C,
tp_size=T)`` a CP group's ranks are ``T`` apart. Built with ``tp_size=1`` for a TP model, a
CP group would be a TP group: ranks holding different heads would pass each other keys and
values of the same shape, and the ring would compute a wrong attention without a word.

The model's TP group is read from its weights: the DTensor parameters' mesh dimension
named ``"tp"`` (transformers' and torchtitan's name; an FSDP2 mesh has none), once per model.

Part of the transformers integration: must not import Trainer, TRL, or hf_ring's training
or memory layers.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
import torch.nn as nn

from hf_ring.patches import transformers as transformers_patches

_TP_RANKS = "_hf_ring_tp_ranks"
_TP_AXIS = "tp"


def _dtensor_type() -> Optional[type]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed: no model can be tensor-parallel
        return None
    return DTensor


def model_tp_ranks(model: nn.Module) -> Optional[tuple[int, ...]]:
    """The global ranks of ``model``'s tensor-parallel group (this rank's), in order, or None
    when no parameter is a DTensor on a mesh with a ``"tp"`` dimension; read once per model."""
    if _TP_RANKS in model.__dict__:
        return model.__dict__[_TP_RANKS]
    group = model_tp_group(model)
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else None
    model.__dict__[_TP_RANKS] = ranks
    return ranks


def model_tp_group(model: nn.Module) -> Optional[dist.ProcessGroup]:
    """This rank's tensor-parallel process group of ``model`` (the ``"tp"`` mesh dimension of
    its DTensor weights), or None when no weight is on one."""
    dtensor = _dtensor_type()
    for param in model.parameters() if dtensor is not None else ():
        if isinstance(param, dtensor) and _TP_AXIS in (param.device_mesh.mesh_dim_names or ()):
            return param.device_mesh.get_group(_TP_AXIS)
    return None


def _state_tp_ranks(state: Any) -> tuple[int, ...]:
    return state.tp_ranks or (dist.get_rank(),)


def check_tensor_parallel_layout(model: nn.Module, state: Any) -> None:
    """Refuse a tensor-parallel ``model`` whose TP group is not the context-parallel state's.

    Args:
        model: the guarded (base) model, its weights possibly DTensors of transformers' TP.
        state: the active ``ContextParallelState`` (``cp_size > 1``).

    Raises:
        ValueError: naming both groups and the call that lays CP out beside TP.
    """
    tp_ranks = model_tp_ranks(model)
    if tp_ranks is None or len(tp_ranks) == 1:
        if state.tp_size > 1:
            raise ValueError(
                f"the context-parallel state was built with tp_size={state.tp_size}, but "
                f"{type(model).__name__} is not tensor-parallel (no weight is a DTensor on a mesh with a 'tp' "
                "dimension); load it with transformers' DistributedConfig(tp_size=...) or build the state with "
                "tp_size=1"
            )
        return
    if tp_ranks == _state_tp_ranks(state):
        return
    if state.tp_size == 1:
        raise ValueError(
            f"{type(model).__name__} is tensor-parallel over ranks {tp_ranks} (tp_size={len(tp_ranks)}), but the "
            f"context-parallel state was built with tp_size=1: its CP group {state.cp_ranks} would pass keys and "
            "values between ranks that hold different heads, and the ring would compute a wrong attention. Build it "
            f"with hf_ring.setup_context_parallel(cp_size={state.cp_size}, tp_size={len(tp_ranks)}): each CP group "
            f"then holds ranks of one TP coordinate, {len(tp_ranks)} apart (TP innermost, as transformers' "
            "DistributedConfig lays it out)"
        )
    raise ValueError(
        f"{type(model).__name__} is tensor-parallel over ranks {tp_ranks}, but hf_ring's mesh (TP innermost) "
        f"puts this rank's TP group at {_state_tp_ranks(state)}, so its CP group {state.cp_ranks} would mix ranks "
        "that hold different heads; load the model with a mesh whose 'tp' dimension is innermost (transformers' "
        "DistributedConfig does) and the same tp_size as setup_context_parallel's"
    )


def _splits(module: nn.Module) -> Optional[str]:
    """What of transformers' tensor parallelism splits ``module``'s own computation, or None:
    a TP forward that does not keep its input and output whole, or, without one, a weight
    sharded over a ``tp`` mesh dimension."""
    whole = transformers_patches.tensor_parallel_output_whole(module)
    if whole is not None:
        return None if whole else "a TP forward that splits it"
    dtensor = _dtensor_type()
    for name, param in module.named_parameters(recurse=False):
        if dtensor is not None and isinstance(param, dtensor):
            names = tuple(param.device_mesh.mesh_dim_names or ())
            if any(not p.is_replicate() and names[i:i + 1] == (_TP_AXIS,) for i, p in enumerate(param.placements)):
                return f"its {name} sharded over TP"
    return None


def _split_inside(root: nn.Module, paths: tuple[str, ...], skip: Optional[nn.Module] = None) -> list[str]:
    """``"<module path>: <what splits it>"`` for every module under ``paths`` of ``root`` (``""``:
    all of it) that tensor parallelism split, leaving out ``skip`` and what is inside it.
    Read from what was applied (installed forwards, sharded weights), not from a plan: a
    ``DistributedConfig(tp_plan=...)`` override reaches only the top model's plan."""
    found = []
    for path in paths:
        top = root.get_submodule(path) if path else root
        inside_skip = {id(m) for m in skip.modules()} if skip is not None else set()
        for name, module in top.named_modules():
            if id(module) in inside_skip:
                continue
            why = _splits(module)
            if why is not None:
                found.append(f"{'.'.join(p for p in (path, name) if p)}: {why}")
    return found


def _shown(entries: list[str]) -> str:
    return ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")


# Per model: the parts TP split, read once (the placement is fixed at load).
_SPLIT = "_hf_ring_tp_split"


def _split_once(model: nn.Module, key: tuple, read) -> list[str]:
    cache = model.__dict__.setdefault(_SPLIT, {})
    if key not in cache:
        cache[key] = read()
    return cache[key]


def check_mixers_beside_tp(model: nn.Module, tp_size: int, mixers: tuple[str, ...]) -> None:
    """Refuse token mixers that tensor parallelism splits.

    Args:
        model: the guarded (base) model.
        tp_size: the context-parallel state's tensor-parallel size (1: nothing to refuse).
        mixers: the paths of the token mixers hf_ring routes in ``model`` (convolutions,
            linear recurrences). Accepted where TP left every module inside them whole
            (Qwen3.5's and Qwen3-Next's gated delta nets: every projection
            ``colwise_gather_output``; mixers no plan names), refused where it splits their
            heads and states: read from what was applied (:func:`_split_inside`).

    Raises:
        NotImplementedError: naming the split modules and what to do.
    """
    if tp_size == 1:
        return
    split = _split_once(model, ("mixers", mixers), lambda: _split_inside(model, mixers))
    if split:
        raise NotImplementedError(
            f"{type(model).__name__}'s token mixers beside tensor parallelism (tp_size={tp_size}): TP splits them "
            f"({_shown(split)}), so each TP rank would run a part of their heads and states, which has not been "
            "checked against one process; train this model with tp_size=1"
        )


def check_image_text_beside_tp(base: nn.Module, language_model: nn.Module, tp_size: int) -> None:
    """Refuse an image-text model that tensor parallelism splits outside its language model.

    The language model beside TP is what text models run (its heads split, its CP groups of
    one TP coordinate); the vision tower and the projector run whole on every rank, fed the
    full batch, as without TP (tests/test_tp_cp.py checks LLaVA and Qwen2-VL). Split ones
    have not been checked.

    Args:
        base: the image-text base model (``LlavaModel``, ``Qwen2VLModel``, ...).
        language_model: its language model (a module inside ``base``).
        tp_size: the context-parallel state's tensor-parallel size.

    Raises:
        NotImplementedError: naming the split modules outside the language model.
    """
    if tp_size == 1:
        return
    outside = _split_once(base, ("outside", id(language_model)), lambda: _split_inside(base, ("",), language_model))
    if outside:
        raise NotImplementedError(
            f"{type(base).__name__} beside tensor parallelism (tp_size={tp_size}): TP splits modules outside its "
            f"language model ({_shown(outside)}), which has not been checked against one process under context "
            "parallelism; train it with tp_size=1"
        )
