"""Which attention backends exist, which one ``backend="auto"`` picks, and the lookup by name.

The registry imports the backend modules to register the built-ins; they import only
:mod:`hf_ring.kernels.base` (and the CUDA glue), so there is no import cycle. Users add
their own kernel with :func:`register_backend`.

``backend="auto"`` tries the registered backends that run on the tensors' device type,
highest ``auto_priority`` first (ties: first registered first), and takes the first one
that is installed and passes its checks here (device, dtype, GPU generation, package
version). The built-ins' order, fastest first by published comparisons (README, "Block
kernels"; not yet measured by this project: ``benchmarks/gpu_check.py`` prints the
measured order): on CUDA flash_attn_3 (sm90), flash_attn_4 (sm90+), torch_cudnn (auto
only on sm90+, where PyTorch 2.5 made it the SDPA default), flash_attn, torch_flash,
torch_efficient, reference; on CPU torch_cpu_flash, reference.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

import torch

from hf_ring.kernels.base import AttentionBackend, KernelNeeds, gpu_capability
from hf_ring.kernels.cuda.flash_attn2 import FLASH_ATTN
from hf_ring.kernels.cuda.flash_attn3 import FLASH_ATTN_3
from hf_ring.kernels.cuda.flash_attn4 import FLASH_ATTN_4
from hf_ring.kernels.reference import REFERENCE
from hf_ring.kernels.torch_cpu import TORCH_CPU_FLASH
from hf_ring.kernels.cuda.torch_cudnn import TORCH_CUDNN
from hf_ring.kernels.cuda.torch_efficient import TORCH_EFFICIENT
from hf_ring.kernels.cuda.torch_flash import TORCH_FLASH


class _Registered(NamedTuple):
    backend: AttentionBackend
    auto_priority: Optional[float]


_REGISTERED: dict[str, _Registered] = {}
NO_NEEDS = KernelNeeds()
logger = logging.getLogger("hf_ring")

# GPU generations below which ``"auto"`` passes a backend over although it runs there (by
# name it still does): PyTorch 2.5 made cuDNN attention its SDPA default on sm90+ only.
_AUTO_MIN_CAPABILITY = {"torch_cudnn": (9, 0)}


def register_backend(backend: AttentionBackend, *, auto_priority: Optional[float] = None,
                     replace: bool = False) -> None:
    """Make ``backend`` available by its name to ``get_backend`` and every ``backend=`` argument.

    Args:
        backend: the record; its kernels must follow the contract in :mod:`hf_ring.kernels.base`.
        auto_priority: where ``backend="auto"`` tries it among the backends of the same
            device type, higher first (built-ins: flash_attn_3 60, flash_attn_4 50,
            torch_cudnn 40, flash_attn 30, torch_flash 20, torch_efficient 10,
            torch_cpu_flash 10, reference 0). None: never chosen by ``"auto"``, only by name.
        replace: allow replacing a registered backend of the same name.

    Raises:
        ValueError: the name is registered already (and ``replace`` is False), or is ``"auto"``.
    """
    name = backend.name
    if name == "auto":
        raise ValueError(f"attention backend name {name!r} is reserved; choose another name")
    if name in _REGISTERED and not replace:
        raise ValueError(f"attention backend {name!r} is registered already; pass replace=True "
                         "to replace it, or choose another name")
    _REGISTERED[name] = _Registered(backend, auto_priority)


def available_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Names of the backends that run on ``device`` for ``dtype`` here, in the order
    ``backend="auto"`` tries them (then those only chosen by name).

    Runs each backend's full check (package installed and its version, GPU generation,
    the installed kernel's signature); what is read is cached, so later calls are cheap.
    """
    ranked = _auto_order(device)
    by_name = [b for b, p in _REGISTERED.values() if p is None and device.type in b.devices]
    return [b.name for b in ranked + by_name if _runs(b, device, dtype)]


def registered_backends() -> list[str]:
    """Every registered backend's name (whether or not it runs here)."""
    return list(_REGISTERED)


def backends_that(capability: str) -> str:
    """``backend=`` and the registered backends with ``capability`` (``"masked"``: a masked
    kernel, for sliding windows; ``"softcap"``: logit softcapping), quoted and with their
    devices, for error messages that say which backend to pass instead."""
    names = [f"{b.name!r} ({'/'.join(b.devices)})" for b, _ in _REGISTERED.values() if getattr(b, capability)]
    if not names:
        return "a backend that has it (none is registered)"
    return "backend=" + (names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1])


def _runs(backend: AttentionBackend, device: torch.device, dtype: torch.dtype) -> bool:
    if device.type not in backend.devices or dtype not in backend.dtypes or not backend.installed():
        return False
    try:
        backend.check(device, dtype)
    except (ValueError, NotImplementedError):
        return False
    return True


def _usable(backend: AttentionBackend, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``"auto"`` may take it: it runs here, on a GPU generation auto takes it on."""
    floor = _AUTO_MIN_CAPABILITY.get(backend.name)
    if floor is not None and device.type == "cuda" and gpu_capability(device) < floor:
        return False
    return _runs(backend, device, dtype)


def _auto_order(device: torch.device) -> list[AttentionBackend]:
    ranked = [(priority, b) for b, priority in _REGISTERED.values()
              if priority is not None and device.type in b.devices]
    # sorted() is stable, so equal priorities keep registration order.
    return [b for _, b in sorted(ranked, key=lambda pb: -pb[0])]


def get_backend(name: str, device: torch.device, dtype: torch.dtype,
                needs: KernelNeeds = NO_NEEDS) -> AttentionBackend:
    """The kernel policy: resolve ``name`` (or ``"auto"``) to a backend that runs on
    ``device`` for ``dtype`` and computes everything in ``needs``.

    ``"auto"`` takes the first backend of the preference order (module docstring) that is
    installed, usable here (package version, GPU generation) and computes ``needs``, so a
    layer with a sliding window or softcapping gets a kernel that has them rather than a
    refusal; when the one it takes is a slow fallback on this device (the reference kernel
    on CUDA) it says so once (logger ``hf_ring``, WARNING). A name asks for exactly that
    backend and is an error when it cannot run or lacks a need.

    Raises:
        ValueError: unknown name, not installed, or it cannot run on this device / dtype /
            GPU; NotImplementedError: no backend (``"auto"``) or not the named one computes
            ``needs``, naming those that do, or an installed kernel whose interface this
            code was not written for.
    """
    if name == "auto":
        return _auto(device, dtype, needs)
    if name not in _REGISTERED:
        known = sorted(set(_REGISTERED) | {"auto"})
        raise ValueError(f"unknown attention backend {name!r}; choose one of {known}")
    backend = _REGISTERED[name].backend
    if not backend.installed():
        hint = f" ({backend.install_hint})" if backend.install_hint else ""
        raise ValueError(f"attention backend {name!r} is not installed{hint}; "
                         f"available here: {available_backends(device, dtype)}")
    try:
        backend.check(device, dtype)
    except ValueError as e:
        raise ValueError(f"{e}; available here: {available_backends(device, dtype)}") from e
    missing = backend.lacks(needs)
    if missing:
        raise NotImplementedError(_lacking(backend.name, missing))
    return backend


def _auto(device: torch.device, dtype: torch.dtype, needs: KernelNeeds) -> AttentionBackend:
    usable = [b for b in _auto_order(device) if _usable(b, device, dtype)]
    if not usable:
        raise ValueError(f"no attention backend runs on {device.type} for {dtype}")
    for backend in usable:
        if not backend.lacks(needs):
            if device.type in backend.slow_on:
                _warn_slow_once(backend, device, usable[0], needs)
            return backend
    gaps = "; ".join(f"{b.name} lacks {' and '.join(b.lacks(needs))}" for b in usable)
    raise NotImplementedError(
        f"no attention backend that runs here ({device.type}, {dtype}) computes this call ({gaps}); install one "
        f"that does (for a masked kernel: {backends_that('masked')}; for softcapping: {backends_that('softcap')})"
    )


_LACKING = {"a masked kernel": ("has no masked kernel, which a sliding window inside the ring (the blocks on "
                                 "its edge) or a ring over token sets no layout describes needs", "masked"),
            "logit softcapping": ("cannot compute logit softcapping", "softcap")}


def _lacking(name: str, missing: list[str]) -> str:
    said = "; ".join(f"{_LACKING[m][0]}; use {backends_that(_LACKING[m][1])}" if m in _LACKING
                     else f"does not take {m}" for m in missing)
    return f"attention backend {name!r} {said} (or backend='auto', which picks one that has it)"


_WARNED: set[tuple] = set()


def _warn_slow_once(backend: AttentionBackend, device: torch.device, fastest: AttentionBackend,
                    needs: KernelNeeds) -> None:
    key = (backend.name, device.type, needs)
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(
            f"[hf_ring] attention backend 'auto' took {backend.name!r} on {device.type} for a call that needs "
            f"{needs.describe()}: the only installed kernel that computes it here, and a slow one "
            f"({backend.description}); {fastest.name!r} would run without that need. Install a kernel that has "
            "it (see hf_ring.kernels.available_backends) to make this fast"
        )


for _backend, _priority in ((REFERENCE, 0), (TORCH_CPU_FLASH, 10), (FLASH_ATTN_3, 60), (FLASH_ATTN_4, 50),
                            (TORCH_CUDNN, 40), (FLASH_ATTN, 30), (TORCH_FLASH, 20), (TORCH_EFFICIENT, 10)):
    register_backend(_backend, auto_priority=_priority)
