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

On CUDA the copy to the host runs on a side stream, after the compute stream's work so
far, so the next layer's forward overlaps it (``offload_copies.CudaCopies``). Nothing orders
the compute stream after that copy: an in-place write to the saved tensor (``x += y`` on a
layer's input after the layer ran) could land before the copy read it, and the backward
would recompute the layer from the written values: wrong gradients, without a word. Two
ways out: make the compute stream wait for every copy (no race, but the copy no longer
overlaps the next layer: the offload's cost goes onto the critical path), or detect the
write. Detection is chosen: each saved tensor is held, with its version counter
(``_version``, bumped by every in-place op on it or a view of it) as packed, until its copy
is known to have run (an event query at the next pack, a wait when more than one copy is
still running, a wait at restore); a version that moved by then raises. A write enqueued
after that point runs after the copy on the GPU, so it cannot reach the saved values.
Plain checkpointing refuses the same write (autograd's "modified by an inplace
operation"), so nothing plain checkpointing runs is refused here. Cost: one layer's input
stays alive on the device until its copy ran (at most two copies in flight).

Restores are prefetched: when the backward restores one saved tensor (a layer's input,
before that layer is recomputed), the copy back of the one saved before it (the next layer
the backward reaches) is issued on the side stream, so it overlaps this layer's recompute
and backward; at most one tensor is prefetched ahead. (This path cannot run on the
CPU-only machines hf_ring's tests use; there the "offload" is a copy in the same memory,
which exercises the hooks and checks exactness but saves nothing, and the CUDA path's
ordering and race check are tested through a stand-in engine that defers its copies.)

Exact: the copies are bitwise, so the loss and gradients are those of plain checkpointing,
which are those of no checkpointing.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from hf_ring.memory.offload_copies import CopyEngine, DefaultEngines
from hf_ring.patches import transformers as transformers_patches


class OffloadPipeline:
    """The state the offload hooks share across the checkpointed layers of one model: the
    saved tensors whose copy to the host may still be running, and the pack order (for the
    prefetch). ``engines``: device -> :class:`~hf_ring.memory.offload_copies.CopyEngine`.

    ``stats`` (optional dict) gets ``bytes`` (held on the host now) and ``peak_bytes``.
    """

    # Copies to the host that may run at once before the host waits for the oldest.
    MAX_IN_FLIGHT = 2

    def __init__(self, stats: Optional[dict[str, int]] = None,
                 engines: Optional[Callable[[torch.device], CopyEngine]] = None) -> None:
        self.stats = stats
        self.engines = DefaultEngines() if engines is None else engines
        self._in_flight: list[tuple[_Packed, torch.Tensor, int]] = []  # (packed, source, version at pack)
        self._order: list[weakref.ref] = []  # every packed tensor still alive, in pack order
        self._prefetched = _dead  # weak: a prefetch dies with the graph that saved its tensor

    def count(self, nbytes: int) -> None:
        if self.stats is not None:
            self.stats["bytes"] = self.stats.get("bytes", 0) + nbytes
            self.stats["peak_bytes"] = max(self.stats.get("peak_bytes", 0), self.stats["bytes"])

    def pack(self, tensor: torch.Tensor) -> "_Packed":
        engine = self.engines(tensor.device)
        self._settle(wait_for=None)
        if self._order and all(ref() is None for ref in self._order):
            self._order = []  # the last backward freed every saved tensor: a new forward
        host, done = engine.to_host(tensor)
        packed = _Packed(self, engine, host, tensor.device, done, len(self._order))
        self._order.append(weakref.ref(packed))
        if engine.deferred:
            self._in_flight.append((packed, tensor, tensor._version))
        self.count(host.nbytes)
        return packed

    def _settle(self, wait_for: Optional["_Packed"]) -> None:
        """Release the copies known to have run, checking that nothing wrote their source
        meanwhile; wait for ``wait_for``'s and for the oldest beyond ``MAX_IN_FLIGHT - 1``."""
        keep, released = [], []
        for i, (packed, source, version) in enumerate(self._in_flight):
            over = len(self._in_flight) - i >= self.MAX_IN_FLIGHT
            if packed is wait_for or over:
                packed.engine.wait(packed.done)
            elif not packed.engine.finished(packed.done):
                keep.append((packed, source, version))
                continue
            released.append((source, version))
        self._in_flight = keep
        for source, version in released:
            _check_unwritten(source, version)

    def restore(self, packed: "_Packed") -> torch.Tensor:
        engine = packed.engine
        if not engine.deferred:
            return packed.host
        if any(p is packed for p, _, _ in self._in_flight):
            self._settle(wait_for=packed)
        if self._prefetched() is packed and packed.prefetch is not None:
            back, ready = packed.prefetch
        else:
            back, ready = engine.to_device(packed.host, packed.device, packed.done)
        packed.prefetch, packed.restored = None, True
        guess = self._prefetched()
        if guess is not None and guess is not packed:
            guess.prefetch = None  # restored out of order: drop the guess, keep the bound
        self._prefetched = _dead
        self._prefetch_before(packed)
        return engine.use(back, ready)

    def _prefetch_before(self, packed: "_Packed") -> None:
        """Issue the copy back of the latest tensor packed before ``packed`` that is still
        saved and not yet restored: the next one the backward asks for."""
        for ref in reversed(self._order[:packed.index]):
            earlier = ref()
            if earlier is not None and not earlier.restored and earlier.engine.deferred:
                earlier.prefetch = earlier.engine.to_device(earlier.host, earlier.device, earlier.done)
                self._prefetched = weakref.ref(earlier)
                return


def _dead() -> None:
    return None


def _check_unwritten(source: torch.Tensor, version: int) -> None:
    if source._version != version:
        raise RuntimeError(
            f"offloaded checkpointing: a checkpointed layer input ({tuple(source.shape)}, {source.dtype}) was "
            f"modified in place after the layer saved it (version {version} -> {source._version}) while its copy "
            "to host memory may not have run yet: the saved copy could hold the new values and the backward "
            "would recompute the layer from them (wrong gradients). Plain checkpointing refuses this too "
            "(autograd: 'modified by an inplace operation'). Write out of place (x = x + y, not x += y), "
            "clone the tensor before writing to it, or drop the checkpoint-offload option."
        )


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep saved tensors in host memory (pinned on CUDA).

    Args:
        stats: optional dict that gets ``bytes`` (held on the host now) and ``peak_bytes``;
            used only when ``pipeline`` is None.
        pipeline: the state shared with the other checkpointed layers of the model (the
            race check and the prefetch span layers); None: one for these hooks alone.
    """

    def __init__(self, stats: Optional[dict[str, int]] = None, pipeline: Optional[OffloadPipeline] = None):
        self.pipeline = OffloadPipeline(stats) if pipeline is None else pipeline
        super().__init__(self.pipeline.pack, self._unpack)

    @staticmethod
    def _unpack(packed: "_Packed") -> torch.Tensor:
        return packed.owner.restore(packed)


class _Packed:
    """One saved tensor in host memory; given back to the pipeline's counter when freed."""

    def __init__(self, owner: OffloadPipeline, engine: CopyEngine, host: torch.Tensor, device: torch.device,
                 done: Any, index: int) -> None:
        self.owner, self.engine, self.host, self.device, self.done = owner, engine, host, device, done
        self.index, self.restored = index, False
        self.prefetch: Optional[tuple[torch.Tensor, Any]] = None

    def __del__(self) -> None:
        self.owner.count(-self.host.nbytes)


def offloaded_checkpoint(function: Callable, *args: Any, stats: Optional[dict[str, int]] = None,
                         pipeline: Optional[OffloadPipeline] = None, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)``
    with the checkpoint's saved inputs (the tensors among ``args``) kept in host memory
    (``pipeline``: shared with the model's other layers, see :class:`HostOffload`)."""
    kwargs.setdefault("use_reentrant", False)
    if kwargs["use_reentrant"]:
        raise ValueError("offloaded checkpointing needs the non-reentrant checkpoint (use_reentrant=False)")
    with HostOffload(stats, pipeline):
        return checkpoint(function, *args, **kwargs)


def enable_offloaded_checkpointing(model: nn.Module, stats: Optional[dict[str, int]] = None,
                                   pipeline: Optional[OffloadPipeline] = None) -> None:
    """Checkpoint every decoder layer of ``model`` (a transformers ``PreTrainedModel``) with
    its checkpointed input offloaded to host memory.

    Args:
        model: supports activation checkpointing (``supports_gradient_checkpointing``).
        stats: optional dict that receives the host bytes held (``bytes``, ``peak_bytes``).
        pipeline: the offload state of this model (None: a new one with ``stats`` and the
            default copy engines); tests pass one with a stand-in engine.

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
    function = functools.partial(offloaded_checkpoint, pipeline=OffloadPipeline(stats) if pipeline is None
                                 else pipeline)
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
