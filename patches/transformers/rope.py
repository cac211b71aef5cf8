"""How transformers' rotary embeddings pick length-dependent frequencies, and a way to make
them pick those of the full sequence when a forward holds a shard of it.

``modeling_rope_utils.dynamic_rope_update`` wraps the ``forward(x, position_ids[,
layer_type])`` of every rotary embedding class of transformers 4.57.6 and 5.24.0: for
``rope_type`` "dynamic" (NTK) it recomputes ``inv_freq`` from ``torch.max(position_ids) + 1``,
for "longrope" (Phi-3) it picks the short or the long factors from it, before computing
cos / sin (or Llama 4's ``freqs_cis``) position by position, ``(..., seq, dim)``. Under
context parallelism a rank's ``position_ids`` hold its shard's positions only, so its
maximum is not the sequence's. Appending one position, the sequence's largest, to the
rotary's ``position_ids`` makes the wrapper see the sequence's maximum; the output of that
extra position is cut off again. Every other position's output is computed elementwise
from its own position and the frequencies, so it is the same as the full sequence's.

Owns: ``length_dependent_rope``, ``reads_max_position``, ``hand_max_position``,
``set_max_position``. Must not
import hf_ring (the integration calls in).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional

import torch
import torch.nn as nn

from .versions import fail, installed_version

# Where the max position for the next forward is kept, in the rotary module's own __dict__
# (copies of the model carry it, like the guard's flags); None: the positions it is given.
_MAX_POSITION = "_hf_ring_max_position"
_HOOKED = "_hf_ring_max_position_hooks"
# The length of the positions a call was given, from its pre-hook to its hook.
_LOCAL_LEN = "_hf_ring_local_len"
# What the wrapper computes the length from, in both releases' source.
_READS = "torch.max(position_ids) + 1"


@functools.lru_cache(maxsize=None)
def _wrapper_code(version: str) -> Any:
    """The code object every closure made by ``dynamic_rope_update`` shares."""
    from transformers import modeling_rope_utils

    update = getattr(modeling_rope_utils, "dynamic_rope_update", None)
    if update is None:
        raise fail("transformers.modeling_rope_utils.dynamic_rope_update is missing", version)
    source = inspect.getsource(update)
    if source.count(_READS) != 2:
        raise fail(f"dynamic_rope_update does not compute the sequence length as {_READS!r}", version)
    return update(lambda self, x, position_ids: None).__code__


def length_dependent_rope(module: nn.Module) -> bool:
    """Whether ``module``'s ``rope_type`` (one, or one per layer type: transformers 5) is one
    that ``dynamic_rope_update`` recomputes from the length: "dynamic" (NTK) or "longrope"."""
    rope_type = getattr(module, "rope_type", None)
    types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return any(isinstance(t, str) and ("dynamic" in t or t == "longrope") for t in types)


def reads_max_position(module: nn.Module) -> bool:
    """Whether ``module`` is a rotary embedding whose forward is wrapped by transformers'
    ``dynamic_rope_update`` and whose ``rope_type`` (one, or one per layer type) makes that
    wrapper pick frequencies from the largest position it is given.

    Raises:
        UnsupportedTransformersVersion: an unsupported transformers version, or a
            ``dynamic_rope_update`` that reads the length another way.
    """
    forward = getattr(type(module), "forward", None)
    if forward is None or not length_dependent_rope(module):
        return False
    code = _wrapper_code(installed_version())
    # torch.no_grad() wraps the wrapper in some classes: follow functools.wraps' chain.
    while forward is not None:
        if getattr(forward, "__code__", None) is code:
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False


def _with_max_position(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: ``position_ids`` ``(..., seq_local)`` (int, positional or by name)
    become ``(..., seq_local + 1)``, the set largest position appended."""
    top = module.__dict__.get(_MAX_POSITION)
    if top is None:
        return None
    if "position_ids" in kwargs:
        positions = kwargs["position_ids"]
    elif len(args) >= 2:
        positions = args[1]
    else:
        raise fail(f"{type(module).__name__} was called without position_ids", installed_version())
    extra = torch.full((*positions.shape[:-1], 1), top, dtype=positions.dtype, device=positions.device)
    extended = torch.cat([positions, extra], dim=-1)  # (..., seq_local + 1)
    module.__dict__[_LOCAL_LEN] = positions.shape[-1]
    if "position_ids" in kwargs:
        return args, {**kwargs, "position_ids": extended}
    return (args[0], extended, *args[2:]), kwargs


def _without_max_position(module: nn.Module, args: tuple, kwargs: dict, output: Any):
    """Forward hook: each output ``(..., seq_local + 1, dim)`` (cos and sin, or Llama 4's
    ``freqs_cis``) loses the appended position: ``(..., seq_local, dim)``."""
    if module.__dict__.get(_MAX_POSITION) is None:
        return None
    local = module.__dict__.pop(_LOCAL_LEN)

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[-2] != local + 1:
            raise fail(f"{type(module).__name__}'s output is not (..., seq, dim) per position", installed_version())
        return t[..., :local, :]

    return tuple(cut(t) for t in output) if isinstance(output, tuple) else cut(output)


def hand_max_position(module: nn.Module) -> None:
    """Let :func:`set_max_position` decide the largest position ``module`` (one for which
    :func:`reads_max_position` holds) picks its frequencies from. Idempotent."""
    if module.__dict__.get(_HOOKED):
        return
    module.register_forward_pre_hook(_with_max_position, with_kwargs=True)
    module.register_forward_hook(_without_max_position, with_kwargs=True)
    module.__dict__[_HOOKED] = True
    module.__dict__[_MAX_POSITION] = None


def set_max_position(module: nn.Module, max_position: Optional[int]) -> None:
    """From now on ``module`` picks its frequencies as if the largest of its positions were
    ``max_position`` (the full sequence's largest position id, at least the largest it is
    given); None: from the positions it is given, as transformers does."""
    if not module.__dict__.get(_HOOKED):
        raise RuntimeError(f"{type(module).__name__} was not prepared with hand_max_position first")
    module.__dict__[_MAX_POSITION] = None if max_position is None else int(max_position)
