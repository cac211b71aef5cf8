"""What the real CUDA attention kernels check of the tensors they are handed, for the CPU
stand-ins of tests/cuda_standins.py, fa3_standin.py and fa4_standin.py.

A stand-in that computed the right numbers but let through a tensor the real kernel
refuses would let a defect reach the first GPU run. The real kernels check:

- devices: every tensor argument on the query's device (flash-attn's ``CHECK_DEVICE``,
  PyTorch's common-device check, FakeTensor's device propagation). On the CPU every
  tensor is on one device, so the tests also run the glue on fake CUDA tensors
  (:func:`fake_cuda`), where a tensor the glue made without ``device=`` shows up on the
  CPU next to CUDA inputs;
- dtypes: key, value, ``out`` and ``dout`` in the query's dtype ("query and dout must
  have the same dtype"), the lse in float32.

Under ``FakeTensorMode`` tensors have no values: :func:`is_fake` lets a stand-in that
must read values (the varlen boundaries) return results of the contract's shapes only.
On a CPU-only build a few Tensor methods written by hand in PyTorch's Python binding
(indexing, ``contiguous``, ``copy_``, ``~``) take a CUDA device guard before dispatch and
fail on fake CUDA tensors; :func:`fake_cuda` routes them to their aten ops, which the
fake mode takes like any other.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten


def check_devices(what: str, q: torch.Tensor, args: dict[str, Any], cpu_scalars: tuple[str, ...] = ()) -> None:
    """Raise AssertionError unless every tensor in ``args`` is on ``q``'s device.

    Args:
        what: the kernel's name, for the message.
        q: the query tensor, any shape.
        args: argument name -> value (non-tensors are ignored).
        cpu_scalars: names that may also be 0-dim CPU tensors (the memory-efficient op's
            dropout seed and offset, which its own forward returns on the CPU).
    """
    for name, t in args.items():
        if not isinstance(t, torch.Tensor) or t.device == q.device:
            continue
        if name in cpu_scalars and t.device.type == "cpu" and t.dim() == 0:
            continue
        raise AssertionError(f"{what}: {name} is on {t.device} but the query on {q.device} (the real kernel "
                             "refuses tensors on different devices)")


def check_dtypes(what: str, q: torch.Tensor, args: dict[str, Optional[torch.Tensor]]) -> None:
    """Raise AssertionError unless every tensor in ``args`` has ``q``'s dtype (None skipped)."""
    for name, t in args.items():
        if t is not None and t.dtype != q.dtype:
            raise AssertionError(f"{what}: query and {name} must have the same dtype (query {q.dtype}, "
                                 f"{name} {t.dtype})")


def check_lse(what: str, lse: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Raise AssertionError unless the lse handed to a backward is float32, dense, of ``shape``."""
    if lse.dtype != torch.float32 or not lse.is_contiguous() or tuple(lse.shape) != tuple(shape):
        raise AssertionError(f"{what}: lse must be a dense float32 {tuple(shape)}, got {lse.dtype} "
                             f"{tuple(lse.shape)} (contiguous: {lse.is_contiguous()})")


def is_fake(t: Any) -> bool:
    """Whether ``t`` is a FakeTensor (no values to read)."""
    return isinstance(t, FakeTensor)


def _index(t: torch.Tensor, idx: Any) -> torch.Tensor:
    """``t[idx]`` for basic indexes (ints, slices, None, Ellipsis) through aten view ops."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if Ellipsis in idx:
        at = idx.index(Ellipsis)
        fill = t.dim() - sum(i is not None for i in idx if i is not Ellipsis)
        idx = idx[:at] + (slice(None),) * fill + idx[at + 1:]
    dim = 0
    for i in idx:
        if i is None:
            t = aten.unsqueeze.default(t, dim)
            dim += 1
        elif isinstance(i, int):
            t = aten.select.int(t, dim, i)
        elif isinstance(i, slice):
            t = aten.slice.Tensor(t, dim, i.start, i.stop, 1 if i.step is None else i.step)
            dim += 1
        else:
            raise NotImplementedError(f"fake_cuda: index {i!r} is not a basic index")
    return t


class _AtenForGuardedMethods(TorchFunctionMode):
    """Tensor methods whose Python binding takes a CUDA device guard, run as aten ops."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__:
            return _index(*args)
        if func is torch.Tensor.__setitem__:
            view, value = _index(args[0], args[1]), args[2]
            if isinstance(value, torch.Tensor):
                aten.copy_.default(view, value)
            else:
                aten.fill_.Scalar(view, value)
            return None
        if func is torch.Tensor.contiguous:
            t = args[0]
            return t if t.is_contiguous() else aten.clone.default(t, memory_format=torch.contiguous_format)
        if func is torch.Tensor.copy_:
            return aten.copy_.default(args[0], args[1])
        if func is torch.Tensor.__invert__:
            return aten.bitwise_not.default(args[0])
        return func(*args, **kwargs)


class _FakeCuda:
    """FakeTensorMode plus :class:`_AtenForGuardedMethods`, entered and left together."""

    def __init__(self) -> None:
        self.fake, self.methods = FakeTensorMode(), _AtenForGuardedMethods()

    def __enter__(self) -> "_FakeCuda":
        self.fake.__enter__()
        self.methods.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.methods.__exit__(*exc)
        self.fake.__exit__(*exc)


def fake_cuda() -> _FakeCuda:
    """A fake mode in which ``device="cuda"`` tensors exist and compute without a GPU (no
    values: shapes, dtypes and devices only); re-enterable."""
    return _FakeCuda()
