"""Which attention backends exist, which one ``backend="auto"`` picks, and the lookup by name.

The registry imports the backend modules to register the built-ins; they import only
:mod:`hf_ring.kernels.base` (and the CUDA glue), so there is no import cycle. Users add
their own kernel with :func:`register_backend`.

``backend="auto"`` tries the registered backends that run on the tensors' device type,
highest ``auto_priority`` first (ties: first registered first), and takes the first one
that is installed and passes its checks here. The built-ins' priorities give, fastest
first: on CUDA flash_attn_3, flash_attn, torch_efficient, reference; on CPU
torch_cpu_flash, reference.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from hf_ring.kernels.base import AttentionBackend
from hf_ring.kernels.flash_attn2 import FLASH_ATTN
from hf_ring.kernels.flash_attn3 import FLASH_ATTN_3
from hf_ring.kernels.reference import REFERENCE
from hf_ring.kernels.torch_cpu import TORCH_CPU_FLASH
from hf_ring.kernels.torch_efficient import TORCH_EFFICIENT


class _Registered(NamedTuple):
    backend: AttentionBackend
    auto_priority: Optional[float]


_REGISTERED: dict[str, _Registered] = {}

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


def register_backend(backend: AttentionBackend, *, auto_priority: Optional[float] = None,
                     replace: bool = False) -> None:
    """Make ``backend`` available by its name to ``get_backend`` and every ``backend=`` argument.

    Args:
        backend: the record; its kernels must follow the contract in :mod:`hf_ring.kernels.base`.
        auto_priority: where ``backend="auto"`` tries it among the backends of the same
            device type, higher first (built-ins: flash_attn_3 30, flash_attn 20,
            torch_efficient 10, torch_cpu_flash 10, reference 0). None: never chosen by
            ``"auto"``, only by name.
        replace: allow replacing a registered backend of the same name.

    Raises:
        ValueError: the name is registered already (and ``replace`` is False), is one of
            the names hf_ring refuses, or is ``"auto"``.
    """
    name = backend.name
    if name == "auto" or name in _REFUSED:
        raise ValueError(f"attention backend name {name!r} is reserved; choose another name")
    if name in _REGISTERED and not replace:
        raise ValueError(f"attention backend {name!r} is registered already; pass replace=True "
                         "to replace it, or choose another name")
    _REGISTERED[name] = _Registered(backend, auto_priority)


def available_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Names of the backends that are installed and take tensors on ``device`` of ``dtype``.

    Cheap: reads device types, dtypes and whether packages are installed, not the GPU
    generation or package versions (``get_backend`` checks those).
    """
    return [name for name, (b, _) in _REGISTERED.items()
            if device.type in b.devices and dtype in b.dtypes and b.installed()]


def _usable(backend: AttentionBackend, device: torch.device, dtype: torch.dtype) -> bool:
    if not backend.installed():
        return False
    try:
        backend.check(device, dtype)
    except (ValueError, NotImplementedError):
        return False
    return True


def _auto_order(device: torch.device) -> list[AttentionBackend]:
    ranked = [(priority, b) for b, priority in _REGISTERED.values()
              if priority is not None and device.type in b.devices]
    # sorted() is stable, so equal priorities keep registration order.
    return [b for _, b in sorted(ranked, key=lambda pb: -pb[0])]


def get_backend(name: str, device: torch.device, dtype: torch.dtype, *, softcap: bool = False) -> AttentionBackend:
    """Resolve ``name`` (or ``"auto"``) to a backend that runs on ``device`` for ``dtype``.

    ``"auto"`` takes the first backend of the preference order (see the module docstring)
    that is installed and usable here (package version, GPU generation) and, with
    ``softcap=True``, whose kernels take logit softcapping; a name asks for exactly that
    backend and is an error when it cannot run (the caller refuses a missing softcap).

    Raises:
        ValueError: unknown name, not installed, or it cannot run on this device / dtype /
            GPU; NotImplementedError: a name hf_ring knows but refuses, or an installed
            kernel whose interface this code was not written for.
    """
    if name == "auto":
        for backend in _auto_order(device):
            if (backend.softcap or not softcap) and _usable(backend, device, dtype):
                return backend
        raise ValueError(f"no attention backend runs on {device.type} for {dtype}"
                         + (" with logit softcapping" if softcap else ""))
    if name in _REFUSED:
        raise NotImplementedError(f"attention backend {name!r}: {_REFUSED[name]}")
    if name not in _REGISTERED:
        known = sorted(set(_REGISTERED) | set(_REFUSED) | {"auto"})
        raise ValueError(f"unknown attention backend {name!r}; choose one of {known}")
    backend = _REGISTERED[name].backend
    if not backend.installed():
        hint = f" ({backend.install_hint})" if backend.install_hint else ""
        raise ValueError(f"attention backend {name!r} is not installed{hint}; "
                         f"installed here: {available_backends(device, dtype)}")
    try:
        backend.check(device, dtype)
    except ValueError as e:
        raise ValueError(f"{e}; available here: {available_backends(device, dtype)}") from e
    return backend


for _backend, _priority in ((REFERENCE, 0), (TORCH_CPU_FLASH, 10), (FLASH_ATTN, 20), (FLASH_ATTN_3, 30),
                            (TORCH_EFFICIENT, 10)):
    register_backend(_backend, auto_priority=_priority)
