"""Activation checkpointing whose checkpointed hidden states live in host (CPU) memory.

Why: with every decoder layer checkpointed, what stays on the device through the forward is
each layer's input, ``layers x tokens x hidden``: for Llama-3-8B at 512K tokens per device
that is 32 x 512K x 4096 x 2 bytes = 137 GB, more than the device has. Here each layer's
checkpointed input is copied to pinned host memory as soon as it is saved and brought back
when the backward recomputes that layer; the device holds one layer's activations at a time.

How: a non-reentrant ``torch.utils.checkpoint`` saves its tensor inputs through the
saved-tensor hooks that are active around it (its own hooks take over only inside), so
:class:`HostOffload` hooks, open around the checkpoint call only, see exactly the
checkpointed inputs (the layer's positional arguments: the hidden states) and nothing else.

On CUDA the copy to the host runs on a side stream, after an event recorded on the compute
stream, so the next layer's forward overlaps it; the device tensor is kept for that stream
(``record_stream``) until the copy is done. The copy back is issued on the side stream when
the backward asks for the tensor and the compute stream waits on it. (This path cannot run
on the CPU-only machines hf_ring's tests use; on CPU the "offload" is a copy in the same
memory, which exercises the hooks and checks exactness but saves nothing.)

Exact: the copies are bitwise, so the loss and gradients are those of plain checkpointing,
which are those of no checkpointing.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from hf_ring.patches import transformers as transformers_patches


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep saved tensors in host memory (pinned on CUDA).

    ``stats`` (optional dict) gets ``bytes`` (held on the host now) and ``peak_bytes``.
    """

    def __init__(self, stats: Optional[dict[str, int]] = None):
        self.stats = stats
        super().__init__(self._pack, self._unpack)

    def _count(self, nbytes: int) -> None:
        if self.stats is not None:
            self.stats["bytes"] = self.stats.get("bytes", 0) + nbytes
            self.stats["peak_bytes"] = max(self.stats.get("peak_bytes", 0), self.stats["bytes"])

    def _pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type == "cpu":
            host = tensor.detach().clone()
            self._count(host.nbytes)
            return _Packed(self, host, tensor.device, None)
        compute = torch.cuda.current_stream(tensor.device)
        side = _side_stream(tensor.device)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            host.copy_(tensor.detach(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        tensor.record_stream(side)  # the allocator keeps the device copy until the copy ran
        self._count(host.nbytes)
        return _Packed(self, host, tensor.device, done)

    @staticmethod
    def _unpack(packed: "_Packed") -> torch.Tensor:
        return packed.restore()


class _Packed:
    """One saved tensor in host memory; given back to the hooks' counter when freed."""

    def __init__(self, owner: HostOffload, host: torch.Tensor, device: torch.device, done: Any):
        self.owner, self.host, self.device, self.done = owner, host, device, done

    def restore(self) -> torch.Tensor:
        if self.device.type == "cpu":
            return self.host
        compute = torch.cuda.current_stream(self.device)
        side = _side_stream(self.device)
        with torch.cuda.stream(side):
            side.wait_event(self.done)
            back = self.host.to(self.device, non_blocking=True)
        compute.wait_stream(side)
        back.record_stream(compute)
        return back

    def __del__(self) -> None:
        self.owner._count(-self.host.nbytes)


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device)


def offloaded_checkpoint(function: Callable, *args: Any, stats: Optional[dict[str, int]] = None, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)``
    with the checkpoint's saved inputs (the tensors among ``args``) kept in host memory."""
    kwargs.setdefault("use_reentrant", False)
    if kwargs["use_reentrant"]:
        raise ValueError("offloaded checkpointing needs the non-reentrant checkpoint (use_reentrant=False)")
    with HostOffload(stats):
        return checkpoint(function, *args, **kwargs)


def enable_offloaded_checkpointing(model: nn.Module, stats: Optional[dict[str, int]] = None) -> None:
    """Checkpoint every decoder layer of ``model`` (a transformers ``PreTrainedModel``) with
    its checkpointed input offloaded to host memory.

    Args:
        model: supports activation checkpointing (``supports_gradient_checkpointing``).
        stats: optional dict that receives the host bytes held (``bytes``, ``peak_bytes``).

    Raises:
        NotImplementedError: a model without activation checkpointing.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise NotImplementedError(
            f"{type(model).__name__} does not support activation checkpointing, so its layers' inputs "
            "cannot be offloaded; drop the checkpoint-offload option"
        )
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 (the old name is deprecated)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    function = functools.partial(offloaded_checkpoint, stats=stats)
    transformers_patches.set_checkpoint_function(model, function)
    _keep_offloading(model, function)


# Set on the enable methods _keep_offloading wrapped, so a second call does not wrap them twice.
_KEEPS_OFFLOAD = "_hf_ring_keeps_offload"


def _keep_offloading(model: nn.Module, function: Callable) -> None:
    """Make later calls of ``model``'s checkpointing enable methods keep ``function``.

    Why: ``Trainer.train`` (transformers 5.24, and TRL's trainers, whose configs turn
    ``gradient_checkpointing`` on by default) calls ``model.activation_checkpointing_enable``
    when ``gradient_checkpointing`` is on, which installs the plain checkpoint function over
    this one: the run would then checkpoint without offloading, without a word. The enable
    methods of this model object are wrapped to put ``function`` back after they run.
    """
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        enable = getattr(model, name, None)
        if enable is None or getattr(enable, _KEEPS_OFFLOAD, False):
            continue

        @functools.wraps(enable)
        def keep(*args: Any, _enable: Callable = enable, **kwargs: Any) -> Any:
            result = _enable(*args, **kwargs)
            transformers_patches.set_checkpoint_function(model, function)
            return result

        setattr(keep, _KEEPS_OFFLOAD, True)
        setattr(model, name, keep)
