"""The compile boundary's mechanics: run an eager, autograd-composed context-parallel
computation inside a ``torch.library.custom_op`` and give its backward to a second op.

Why: ``torch.compile`` must see each pattern's attention (and each CP token mixer) as one
opaque call; tracing it would put the ring's Python loop, its transfers and its plan
building into the graph. A custom op's body runs below autograd (its inputs do not require
grad, autograd's dispatch keys are excluded), so a pattern composed of autograd pieces
(Ulysses' all-to-alls around the ring, the mixers' state exchanges) cannot record its
backward there by itself. :func:`run_taped` therefore re-enables autograd for the body,
runs the eager code on detached leaves exactly as an uncompiled forward runs it, and keeps
that autograd graph (a *tape*) under an int id, returned as a 0-d int64 tensor; the op's
registered backward calls :data:`tape_backward`, an op of its own, which replays the tape
with ``torch.autograd.grad``. The numbers are the eager code's, operation for operation.

Lifetime: a tape lives while its id tensor does (the compiled graph, or eager autograd,
saves that tensor for the backward) and is dropped when the backward has run or when the
tensor is freed without one (a forward whose loss was discarded). A tape is replayed once;
a second backward over the same graph is refused (``retain_graph=True`` is not supported
through the boundary).

Must not import transformers, accelerate, or hf_ring's integration or training layers.
"""

from __future__ import annotations

import itertools
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch._C import DispatchKey

# Live tapes by id; ids are never reused within a process.
_TAPES: dict[int, "_Tape"] = {}
_IDS = itertools.count(1)


@dataclass
class _Tape:
    leaves: tuple[Optional[torch.Tensor], ...]  # the body's detached inputs (None: absent or not float)
    outputs: tuple[torch.Tensor, ...]  # the eager outputs, with their autograd graph


@contextmanager
def _autograd_on() -> Iterator[None]:
    """Grad mode on and autograd's dispatch keys included again (a custom op's body runs
    with them excluded). Removing the CPU autograd key removes the autograd functionality
    for every backend (a key set removes functionality bits, not backend bits)."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (DispatchKey.AutogradCPU, DispatchKey.AutogradOther, DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    with torch.enable_grad(), torch._C._ForceDispatchKeyGuard(include, exclude):
        yield


def run_taped(
    fn: Callable[..., tuple[torch.Tensor, ...]], inputs: Sequence[Optional[torch.Tensor]], record: bool,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``fn(*inputs)`` run eagerly with autograd, from inside a custom op's body.

    Args:
        fn: the eager computation; returns a tuple of tensors, the first ones differentiable.
        inputs: its tensor inputs (None where absent); the floating ones become leaves
            that require grad when ``record``.
        record: keep the autograd graph for :data:`tape_backward` (the caller needs a
            gradient); else run without grad.

    Returns:
        ``fn``'s outputs detached (the op returns them), and the tape's id as a 0-d int64
        CPU tensor (0 when nothing was recorded).
    """
    if not record:
        with torch.no_grad():
            outputs = fn(*inputs)
        return tuple(o.detach() for o in outputs), torch.zeros((), dtype=torch.int64)
    leaves = tuple(None if t is None or not t.is_floating_point() else t.detach().requires_grad_()
                   for t in inputs)
    args = tuple(leaf if leaf is not None else t for leaf, t in zip(leaves, inputs))
    with _autograd_on():
        outputs = fn(*args)
    if not any(o.requires_grad for o in outputs):
        raise RuntimeError("the computation behind hf_ring's compile boundary recorded no autograd graph "
                           "although its inputs require grad; its backward would be lost")
    tape_id = next(_IDS)
    _TAPES[tape_id] = _Tape(leaves, tuple(outputs))
    handle = torch.tensor(tape_id, dtype=torch.int64)
    # The tape goes when its id tensor goes, backward or not (the graph that saved it was freed).
    weakref.finalize(handle, _TAPES.pop, tape_id, None)
    return tuple(o.detach() for o in outputs), handle


def live_tapes() -> int:
    """How many tapes wait for their backward (tests check that none is left behind)."""
    return len(_TAPES)


@torch.library.custom_op("hf_ring::tape_backward", mutates_args=())
def tape_backward(
    tape: torch.Tensor, grads: list[Optional[torch.Tensor]], like: list[Optional[torch.Tensor]]
) -> list[torch.Tensor]:
    """The backward of a taped op: gradients of the taped inputs.

    Args:
        tape: the forward op's 0-d int64 tape id.
        grads: one gradient per differentiable output of the forward (None: no gradient
            reached it), each shaped like that output.
        like: the forward's inputs (None where absent), whose shapes and dtypes the
            gradients take.

    Returns:
        one gradient per present input of ``like``, in order, each in that input's dtype
        and strides (zeros where the graph does not reach an input).
    """
    tape_id = int(tape)
    entry = _TAPES.pop(tape_id, None)
    if entry is None:
        raise RuntimeError(
            f"hf_ring's compile boundary has no recorded forward for tape {tape_id}: it ran its backward "
            "already (a second backward through a compiled context-parallel op, retain_graph=True, is not "
            "supported) or its forward ran without grad"
        )
    pairs = [(o, g) for o, g in zip(entry.outputs, grads) if g is not None and o.requires_grad]
    wanted = [leaf for leaf in entry.leaves if leaf is not None]
    with _autograd_on():
        found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
    found = iter(found)
    # An op's outputs may not alias its inputs or each other; autograd may hand a gradient
    # through unchanged (a view of ``grads``), and such a gradient is copied.
    taken = {t.untyped_storage().data_ptr() for t in (*grads, *like) if t is not None}
    result = []
    for leaf, t in zip(entry.leaves, like):
        if t is None:
            continue
        g = next(found) if leaf is not None else None
        if g is None:
            g = torch.zeros_like(t)
        elif g.dtype != t.dtype or g.stride() != t.stride() or g.untyped_storage().data_ptr() in taken:
            # In the input's layout, as the fake implementation promises (the compiled backward
            # views the gradient so), and never an alias of an input.
            g = torch.empty_like(t).copy_(g)
        taken.add(g.untyped_storage().data_ptr())
        result.append(g)
    return result


@tape_backward.register_fake
def _(tape, grads, like):
    return [torch.empty_like(t) for t in like if t is not None]


__all__ = ["live_tapes", "run_taped", "tape_backward"]
