"""One interface over the attention-block kernels, and the choice among them.

A backend computes one block of attention, ``(q, k, v, causal, scale) -> (out, lse)``, and
its backward ``(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``, all tensors in
the flash-attn layout ``(batch, seq, heads, head_dim)``, lse ``(batch, heads, q_len)``.
Causal blocks always have ``q_len == k_len``; non-causal ones may differ. K and V may have
fewer heads than Q (GQA): backends that cannot take that natively repeat them locally, on
the already-received block, never before communication.

Asking for a backend that is not available on this machine, device or dtype is an error:
a different kernel would be a silent change of numerics and speed.

A backend may also offer a variable-length kernel (``varlen_forward`` / ``varlen_backward``):
many independent blocks in one call, rows concatenated, ``q`` ``(total_q, heads, head_dim)``,
``k``/``v`` ``(total_k, kv_heads, head_dim)``, boundaries ``cu_q``/``cu_k`` int32
``(n_blocks + 1,)`` on the tensors' device, lse ``(heads, total_q)`` float32. Packed rows
use it to run every document of a ring step in one launch instead of one per document.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from hf_ring.kernels.reference import reference_backward, reference_forward
from hf_ring.kernels.torch_cpu import cpu_flash_backward, cpu_flash_forward

ForwardFn = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]
BackwardFn = Callable[..., "tuple[torch.Tensor, torch.Tensor, torch.Tensor]"]
# (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale) -> (out, lse)
VarlenForwardFn = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]
# (dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale) -> (dq, dk, dv)
VarlenBackwardFn = Callable[..., "tuple[torch.Tensor, torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True)
class AttentionBackend:
    """A named block kernel with the devices and dtypes it takes."""

    name: str
    forward: ForwardFn
    backward: BackwardFn
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    description: str
    # Raises ValueError (saying why) when the backend cannot run here: package version,
    # GPU generation. Checked when the backend is chosen, before any kernel runs.
    probe: Optional[Callable[[torch.device, torch.dtype], None]] = None
    # Optional variable-length kernel (see the module docstring); both or neither.
    varlen_forward: Optional[VarlenForwardFn] = None
    varlen_backward: Optional[VarlenBackwardFn] = None

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        if device.type not in self.devices:
            raise ValueError(
                f"attention backend {self.name!r} runs on {'/'.join(self.devices)}, but the "
                f"tensors are on {device.type}; pass backend='auto' or one of "
                f"{available_backends(device, dtype)}"
            )
        if dtype not in self.dtypes:
            raise ValueError(
                f"attention backend {self.name!r} takes {[str(d) for d in self.dtypes]}, got "
                f"{dtype}; pass backend='auto' or one of {available_backends(device, dtype)}"
            )
        if self.probe is not None:
            self.probe(device, dtype)


_ALL_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

_BACKENDS: dict[str, AttentionBackend] = {
    "reference": AttentionBackend(
        "reference", reference_forward, reference_backward, ("cpu", "cuda"), _ALL_FLOATS,
        "plain math; materialises the score matrix (tests, float64, short blocks)",
    ),
    "torch_cpu_flash": AttentionBackend(
        "torch_cpu_flash", cpu_flash_forward, cpu_flash_backward, ("cpu",), _ALL_FLOATS,
        "PyTorch's tiled CPU flash-attention op",
    ),
}


def _register_cuda_backends() -> None:
    from hf_ring.kernels import cuda as cuda_kernels

    for backend in cuda_kernels.cuda_backends():
        _BACKENDS[backend.name] = backend


_register_cuda_backends()

# Names we know of but cannot offer, and what to use instead. Listed so that asking for
# one is a precise error rather than "unknown backend".
_REFUSED = {
    "torch_flash": "PyTorch's CUDA flash op cannot be called with an externally merged lse "
    "from Python; use backend='torch_efficient' or install flash-attn (backend='flash_attn')",
    "torch_cudnn": "PyTorch's cuDNN attention op is not wired up yet; use "
    "backend='torch_efficient' or backend='flash_attn'",
    "flash_attn_4": "flash-attn 4 (CuTe DSL) is not wired up yet; use backend='flash_attn' "
    "(2.x) or 'flash_attn_3'",
}


def available_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Backends that run here for tensors on ``device`` of ``dtype``."""
    return [
        b.name
        for b in _BACKENDS.values()
        if device.type in b.devices and dtype in b.dtypes and _installed(b.name)
    ]


def _installed(name: str) -> bool:
    if name == "flash_attn":
        return importlib.util.find_spec("flash_attn") is not None
    if name == "flash_attn_3":
        return importlib.util.find_spec("flash_attn_interface") is not None
    return True


# Preference order for backend="auto", fastest first.
_AUTO_ORDER = {
    "cuda": ("flash_attn_3", "flash_attn", "torch_efficient", "reference"),
    "cpu": ("torch_cpu_flash", "reference"),
}


def _usable(backend: AttentionBackend, device: torch.device, dtype: torch.dtype) -> bool:
    if not _installed(backend.name):
        return False
    try:
        backend.check(device, dtype)
    except (ValueError, NotImplementedError):
        return False
    return True


def get_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """Resolve ``name`` (or ``"auto"``) to a backend that runs on ``device`` for ``dtype``.

    ``"auto"`` takes the first backend of a fixed preference order that is installed and
    usable here (package version, GPU generation); a name asks for exactly that backend
    and is an error when it cannot run.
    """
    if name == "auto":
        for candidate in _AUTO_ORDER.get(device.type, ()):
            backend = _BACKENDS.get(candidate)
            if backend is not None and _usable(backend, device, dtype):
                return backend
        raise ValueError(f"no attention backend runs on {device.type} for {dtype}")
    if name in _REFUSED:
        raise NotImplementedError(f"attention backend {name!r}: {_REFUSED[name]}")
    if name not in _BACKENDS:
        known = sorted(set(_BACKENDS) | set(_REFUSED) | {"auto"})
        raise ValueError(f"unknown attention backend {name!r}; choose one of {known}")
    if not _installed(name):
        raise ValueError(
            f"attention backend {name!r} is not installed (pip install "
            f"{'flash-attn' if name == 'flash_attn' else 'the flash-attn hopper build'}); "
            f"installed here: {available_backends(device, dtype)}"
        )
    backend = _BACKENDS[name]
    backend.check(device, dtype)
    return backend
