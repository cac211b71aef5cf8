"""The copy engines of offloaded checkpointing: how a saved tensor goes to host memory and back.

Why a separate layer: ``offload.py`` decides *when* to copy (pack, release, restore,
prefetch) and checks what the copies race with; an engine only does the copies. The CUDA
engine's copies are asynchronous (a side stream, events); the CPU engine's are immediate.
A test drives ``offload.py`` with a stand-in engine that defers its copies the way a busy
GPU does, which is how the CUDA-only ordering is checked on machines without one.

Must not import transformers, Trainer, TRL, or hf_ring's training layer.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch


class CopyEngine(Protocol):
    """Moves saved tensors between a device and host memory.

    ``deferred``: whether a copy may still be running when the call returns (then a token
    says when it ran, and the source must not be written before it did).
    """

    deferred: bool

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying ``tensor`` (any shape / dtype) to host memory: ``(host, done)``,
        ``host`` shaped like ``tensor``, ``done`` the token of the copy (None: already done)."""
        ...

    def finished(self, token: Any) -> bool:
        """Whether the copy of ``token`` has run, without waiting."""
        ...

    def wait(self, token: Any) -> None:
        """Block the host until the copy of ``token`` has run."""
        ...

    def to_device(self, host: torch.Tensor, device: torch.device, after: Any) -> tuple[torch.Tensor, Any]:
        """Start copying ``host`` back to ``device`` once the copy ``after`` has run:
        ``(tensor, ready)``; the tensor may be used only through :meth:`use`."""
        ...

    def use(self, tensor: torch.Tensor, ready: Any) -> torch.Tensor:
        """``tensor`` from :meth:`to_device`, safe to read in the compute that follows."""
        ...


class ImmediateCopies:
    """CPU tensors: the "offload" is a copy in the same memory, done when the call returns;
    it exercises the hooks and saves nothing."""

    deferred = False

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor.detach().clone(), None

    def finished(self, token: Any) -> bool:
        return True

    def wait(self, token: Any) -> None:
        pass

    def to_device(self, host: torch.Tensor, device: torch.device, after: Any) -> tuple[torch.Tensor, Any]:
        return host, None

    def use(self, tensor: torch.Tensor, ready: Any) -> torch.Tensor:
        return tensor


class CudaCopies:
    """CUDA tensors: copies on one side stream per device into pinned host memory.

    To the host: the side stream waits for the compute stream (so the copy reads the
    tensor as the forward left it), copies without blocking the host, and records an
    event; ``record_stream`` keeps the device memory from being reused before the copy ran.
    Back: issued on the side stream (so a prefetch overlaps the compute stream's work);
    the compute stream waits on the copy's event before the first kernel that reads it.
    """

    deferred = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device)

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        compute = torch.cuda.current_stream(self.device)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
        self.side.wait_stream(compute)
        with torch.cuda.stream(self.side):
            host.copy_(tensor.detach(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.side)
        tensor.record_stream(self.side)
        return host, done

    def finished(self, token: Any) -> bool:
        return token.query()

    def wait(self, token: Any) -> None:
        token.synchronize()

    def to_device(self, host: torch.Tensor, device: torch.device, after: Any) -> tuple[torch.Tensor, Any]:
        with torch.cuda.stream(self.side):
            self.side.wait_event(after)
            back = host.to(device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.side)
        return back, ready

    def use(self, tensor: torch.Tensor, ready: Any) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(ready)
        tensor.record_stream(compute)  # allocated on the side stream, read and freed on this one
        return tensor


_IMMEDIATE = ImmediateCopies()


class DefaultEngines:
    """The engine for each device: immediate on the CPU, one :class:`CudaCopies` per CUDA device."""

    def __init__(self) -> None:
        self._cuda: dict[torch.device, CudaCopies] = {}

    def __call__(self, device: torch.device) -> CopyEngine:
        if device.type == "cpu":
            return _IMMEDIATE
        if device.type != "cuda":
            raise NotImplementedError(
                f"offloaded checkpointing copies CPU and CUDA tensors; a checkpointed input is on {device}: "
                "drop the checkpoint-offload option on this device"
            )
        engine: Optional[CudaCopies] = self._cuda.get(device)
        if engine is None:
            engine = self._cuda[device] = CudaCopies(device)
        return engine
