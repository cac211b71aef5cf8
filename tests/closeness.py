"""The suite's measures of "the same": relative errors, gradients by name, and a
context-parallel state without a world. One definition each, so that a tolerance means the
same thing in every file.

Two metrics, both in float64:

- :func:`rel_err`, ``norm(x - ref) / norm(ref)``: for whole tensors (logits, a gradient,
  attention outputs), where a few large entries must not hide many small errors;
- :func:`max_rel`, ``max |x - ref| / max |ref|``: the worst entry against the largest,
  where one wrong entry must fail (a recurrent state, a mixer's output at one position).

Imports torch (and hf_ring's state, when asked for one); no test module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import hf_ring

def rel_err(x: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """``norm(x - ref) / max(norm(ref), floor)`` in float64. With the default ``floor`` an
    all-zero reference gives inf or nan, which fails every bound: a reference that vanished
    is a broken test, not a pass."""
    return ((x.double() - ref.double()).norm() / max(ref.double().norm().item(), floor)).item()


def max_rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |x - ref| / max |ref|`` in float64."""
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def grads(model: torch.nn.Module, *, zeros_for_missing: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by name, detached copies; parameters without one are left
    out, or given zeros with ``zeros_for_missing`` (where a rank may not reach a parameter
    whose gradient another rank adds)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[name] = p.grad.detach().clone()
        elif zeros_for_missing:
            out[name] = torch.zeros_like(p.detach())
    return out


def grads_rel_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """:func:`rel_err` of every gradient at once (concatenated), after checking both hold the
    same names."""
    assert sorted(got) == sorted(ref), sorted(set(got) ^ set(ref))
    return rel_err(torch.cat([got[n].flatten() for n in ref]), torch.cat([ref[n].flatten() for n in ref]))


def fake_cp_state(cp_rank: int = 0, cp_size: int = 2, **kwargs: Any) -> "hf_ring.ContextParallelState":
    """A context-parallel state with no process groups (one data-parallel rank), for code
    that reads only the state's sizes and settings; keyword-built, so a new field cannot
    shift the others."""
    from hf_ring import ContextParallelState
    from hf_ring.distributed.groups import BUILT_AXES, AxisGroup, ProcessMesh
    from hf_ring.distributed.mesh import ParallelDims
    from hf_ring.patterns.state import AttentionSettings

    ranks = tuple(range(cp_size))
    axes = {name: AxisGroup(None, 0, 1, (cp_rank,)) for name in BUILT_AXES}
    axes["cp"] = axes["loss"] = AxisGroup(None, cp_rank, cp_size, ranks)
    return ContextParallelState(ProcessMesh(ParallelDims(cp_size, cp=cp_size), axes), AttentionSettings(**kwargs))
