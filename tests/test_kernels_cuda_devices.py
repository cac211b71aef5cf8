"""The CUDA glue on fake CUDA tensors: every tensor it hands a kernel is on the inputs'
device and in the dtype the kernel checks.

On the CPU every tensor lives on one device, so a tensor the glue makes without
``device=`` (a dropout state, a padded lse) passes every CPU test and fails on the first
GPU. Here the inputs are CUDA tensors under ``FakeTensorMode`` (no GPU, no values):

- through PyTorch's real ops (``torch_flash``, ``torch_cudnn``): the installed
  dispatcher and meta functions take the glue's calls, and FakeTensor's device
  propagation refuses a CPU tensor next to CUDA ones, as the GPU would;
- through the stand-ins of every CUDA backend (tests/cuda_standins.py), which check
  devices and dtypes as the real kernels do (tests/kernel_checks.py).

The backward is handed what the ring hands it: ``out`` in float32 (the merge's
accumulator), ``dout`` in float32 (a float32 loss upstream), the lse a column slice of a
wider tensor; the kernels take only q's dtype and a dense lse, so the glue must convert.
No values exist, so nothing numeric is checked here (test_kernels_cuda*.py do that).
Views are taken with ``narrow``: Python indexing of a fake CUDA tensor needs a CUDA build.
"""

from __future__ import annotations

import pytest
import torch

import cuda_standins as cs
from hf_ring.kernels import registry
from hf_ring.kernels.cuda import torch_cudnn, torch_flash, window_bands
from kernel_checks import fake_cuda
from test_kernels_cuda_windows import _window_edge_masks

CUDA = torch.device("cuda", 0)


def _qkv(hq: int, hk: int, sq: int, sk: int, d: int = 64, dtype: torch.dtype = torch.bfloat16):
    """Fake CUDA q ``(2, sq, hq, d)``, k/v ``(2, sk, hk, d)``; call under the fake mode."""
    q = torch.empty(2, sq, hq, d, device="cuda", dtype=dtype)
    k, v = (torch.empty(2, sk, hk, d, device="cuda", dtype=dtype) for _ in range(2))
    return q, k, v


def _ring_handoff(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dout and out in float32, and an lse that is a column slice of a wider one, as the ring
    hands them to a backward (q ``(b, sq, h, d)``)."""
    b, sq, h, _ = q.shape
    dout, out = (torch.empty(q.shape, device=q.device, dtype=torch.float32) for _ in range(2))
    lse = torch.empty(b, h, 2 * sq, device=q.device, dtype=torch.float32).narrow(2, 0, sq)
    return dout, out, lse


def _on_cuda(*tensors: torch.Tensor) -> bool:
    return all(t.device == CUDA for t in tensors)


def _masked(backend, mode, softcap=None) -> None:
    """The masked kernel on a two-band window-edge mask; its bands are cut from the host
    copy first, as the ring plan does (a fake mask has no values to cut)."""
    host = next(m for m in _window_edge_masks() if len(window_bands.bands(m)) > 1)
    with mode:
        mask = torch.empty(host.shape, dtype=torch.bool, device="cuda")
    window_bands.bands(mask, host_mask=host)
    extra = {"softcap": softcap} if softcap else {}
    with mode:
        q, k, v = _qkv(4, 2, *host.shape)
        out, lse = backend.masked_forward(q, k, v, mask, 0.125, **extra)
        assert _on_cuda(out, lse) and out.dtype == q.dtype and lse.shape == (2, 4, host.shape[0])
        dout, final, lse_view = _ring_handoff(q)
        grads = backend.masked_backward(dout, q, k, v, final, lse_view, mask, 0.125, **extra)
        assert _on_cuda(*grads) and [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def _varlen(backend) -> None:
    """The varlen kernel on three documents of 3, 6 and 2 tokens, boundaries on the device."""
    q = torch.empty(11, 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.empty(11, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.empty(4, dtype=torch.int32, device="cuda")
    out, lse = backend.varlen_forward(q, k, v, cu, cu, 6, 6, True, 0.125)
    assert _on_cuda(out, lse) and out.shape == q.shape and lse.shape == (4, 11) and lse.dtype == torch.float32
    dout, final = (torch.empty(q.shape, device="cuda", dtype=torch.float32) for _ in range(2))
    lse_view = torch.empty(4, 22, device="cuda", dtype=torch.float32).narrow(1, 0, 11)
    grads = backend.varlen_backward(dout, q, k, v, final, lse_view, cu, cu, 6, 6, True, 0.125)
    assert _on_cuda(*grads) and [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("name", ["torch_flash", "torch_cudnn"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
@pytest.mark.parametrize("sq,sk", [(40, 24), (1, 24)])
def test_real_ops_take_the_glue_calls_on_fake_cuda_tensors(monkeypatch, name, heads, sq, sk):
    """PyTorch's own ops, dispatcher and meta functions, on fake CUDA inputs: every tensor
    the glue adds is on the inputs' device, and the results have the contract's shapes
    (one query row included, where a squeezed lse would lose its sequence dimension)."""
    module = {"torch_flash": torch_flash, "torch_cudnn": torch_cudnn}[name]
    monkeypatch.setattr(module, "check_block", lambda *a: None)  # no GPU to ask for its generation
    backend = registry._REGISTERED[name].backend
    with fake_cuda():
        q, k, v = _qkv(heads[0], heads[1], sq, sk)
        out, lse = backend.forward(q, k, v, False, 0.125)
        assert _on_cuda(out, lse) and out.shape == q.shape and out.dtype == q.dtype
        assert lse.shape == (2, heads[0], sq) and lse.dtype == torch.float32
        dout, final, lse_view = _ring_handoff(q)
        dq, dk, dv = backend.backward(dout, q, k, v, final, lse_view, False, 0.125)
        assert _on_cuda(dq, dk, dv) and (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_real_flash_op_varlen_and_window_on_fake_cuda_tensors(monkeypatch):
    monkeypatch.setattr(torch_flash, "check_block", lambda *a: None)
    backend = registry._REGISTERED["torch_flash"].backend
    mode = fake_cuda()
    with mode:
        _varlen(backend)
    _masked(backend, mode)


@pytest.mark.parametrize("name", cs.CUDA_NAMES)
def test_glue_on_fake_cuda_tensors_through_the_stand_ins(monkeypatch, name):
    """Every CUDA backend's glue, every kernel it has (dense, varlen, masked, softcap), on
    fake CUDA bf16 inputs through stand-ins that check devices and dtypes as the real
    kernels do."""
    backend = cs.install(monkeypatch.setattr, (name,), keep_dtypes=True, device_type="cuda")[name]
    mode = fake_cuda()
    caps = [None, 2.0] if backend.softcap else [None]
    with mode:
        for softcap in caps:
            extra = {"softcap": softcap} if softcap else {}
            for heads, causal, (sq, sk) in (((4, 2), True, (16, 16)), ((4, 4), False, (5, 24))):
                q, k, v = _qkv(*heads, sq, sk)
                out, lse = backend.forward(q, k, v, causal, 0.125, **extra)
                assert _on_cuda(out, lse) and out.shape == q.shape and lse.shape == (2, heads[0], sq)
                dout, final, lse_view = _ring_handoff(q)
                grads = backend.backward(dout, q, k, v, final, lse_view, causal, 0.125, **extra)
                assert _on_cuda(*grads) and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        if backend.varlen_forward is not None:
            _varlen(backend)
    if backend.masked:
        _masked(backend, mode)
