"""CPU checks of the CUDA backends that need no compilation: ``torch_flash`` and
``torch_cudnn`` (PyTorch's own ops) and ``flash_attn_4`` (the CuTe DSL wheel), and of the
order ``backend="auto"`` takes the CUDA backends in (sliding windows on them:
test_kernels_cuda_windows.py).

No GPU runs here, so three things stand in for one:
- the installed PyTorch's schemas: the positional order each call was written for is
  compared with them, and the stand-ins bind every call by them (tests/cuda_standins.py);
- the real ops on fake CUDA tensors (test_kernels_cuda_devices.py): PyTorch's own
  dispatcher and meta functions take the glue's calls, so a wrong argument type, count,
  shape or device fails as it would on a GPU;
- the stand-ins' numbers against float64 attention written independently of hf_ring
  (``reference_attention``; with softcap, autograd through the formula written below).

Tolerance as in test_kernels_cuda.py: float64 inputs, out within 1e-10, lse and gradients
within 1e-6 (the kernels' lse is float32 by contract).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from packaging.version import Version

import cuda_standins as cs
import fa4_standin
from hf_ring.kernels import available_backends, base, get_backend, registry
from hf_ring.kernels.cuda import flash_attn2, flash_attn3, flash_attn4, torch_cudnn, torch_flash
from hf_ring.kernels.cuda import glue as cuda_glue
from closeness import rel_err
from reference_attention import block_attention, block_attention_grads, segment_attention
from test_kernels_cuda import _check_against_reference, _inputs


def test_schemas_match_installed_torch():
    torch_flash.check_flash_schema()
    torch_cudnn.check_cudnn_schema()


def test_a_reordered_schema_is_refused():
    """What a PyTorch release that moved a parameter would meet: the check names both orders."""
    torch.library.define("hf_ring_test::flash_like", "(Tensor query, Tensor value, Tensor key) -> Tensor")
    op = torch.ops.hf_ring_test.flash_like.default
    with pytest.raises(NotImplementedError, match=r"takes \(query, value, key.*pass backend='x'"):
        cuda_glue.check_op_schema(op, ("query", "key", "value"), (), "backend='x'")
    with pytest.raises(TypeError, match="takes 14 positional arguments, got 15"):
        cs.bind_schema(cs.OPS.flash_bwd, tuple(range(15)), {})
    with pytest.raises(TypeError, match="unexpected or repeated argument 'softcap'"):
        cs.bind_schema(cs.OPS.flash_fwd, (), {"softcap": 1.0})


@pytest.mark.parametrize("era", cs.CUDNN_ERAS)
@pytest.mark.parametrize("causal,sq,sk", [(True, 5, 5), (False, 1, 7)])
def test_torch_cudnn_lse_of_either_rank(monkeypatch, era, causal, sq, sk):
    """cuDNN attention's lse is (b, h, sq, 1) in this PyTorch and was (b, h, sq) before 2.9:
    the glue reads the rank from the installed op (its meta function) and hands the
    backward the forward's own shape; one query row keeps its sequence dimension."""
    cs.install(monkeypatch.setattr, ("torch_cudnn",))
    fwd, bwd = cs.cudnn_ops(era)
    monkeypatch.setattr(torch_cudnn, "_FWD", fwd)
    monkeypatch.setattr(torch_cudnn, "_BWD", bwd)
    q, k, v, dout = _inputs(hq=4, hk=2, sq=sq, sk=sk)
    out, lse = torch_cudnn.cudnn_forward(q, k, v, causal, 0.3)
    ref_out, ref_lse = block_attention(q, k, v, causal, 0.3)
    assert lse.shape == (2, 4, sq) and rel_err(out, ref_out) < 1e-10 and rel_err(lse, ref_lse) < 1e-6
    grads = torch_cudnn.cudnn_backward(dout, q, k, v, ref_out, ref_lse, causal, 0.3)
    for got, want in zip(grads, block_attention_grads(dout, q, k, v, causal, 0.3)):
        assert got.shape == want.shape and rel_err(got, want) < 1e-6


@pytest.mark.parametrize("name", ["torch_flash", "torch_cudnn", "flash_attn_4"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_glue_against_reference(monkeypatch, name, heads, causal):
    backend = cs.install(monkeypatch.setattr, (name,))[name]
    _check_against_reference(backend.forward, backend.backward, causal, *heads)


@pytest.mark.parametrize("causal", [True, False])
def test_torch_flash_varlen_glue(monkeypatch, causal):
    cs.install(monkeypatch.setattr, ("torch_flash",))
    q_lens, k_lens = (3, 6, 2), ((3, 6, 2) if causal else (5, 1, 4))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (q_lens, k_lens))
    q, k, v, dout = (t[0] for t in _inputs(sq=sum(q_lens), sk=sum(k_lens)))  # (total, heads, d)
    args = (cu_q, cu_k, max(q_lens), max(k_lens), causal, 0.3)
    out, lse = torch_flash.flash_varlen_forward(q, k, v, *args)
    ref = segment_attention(q, k, v, dout, cu_q, cu_k, causal, 0.3)
    assert rel_err(out, ref["out"]) < 1e-10 and lse.dtype == torch.float32 and rel_err(lse, ref["lse"]) < 1e-6
    lse_view = torch.cat([ref["lse"], ref["lse"]], dim=-1)[:, : q.shape[0]]  # a column slice, as the ring passes
    grads = torch_flash.flash_varlen_backward(dout, q, k, v, ref["out"], lse_view, *args)
    for got, name in zip(grads, ("dq", "dk", "dv")):
        assert rel_err(got, ref[name]) < 1e-6


def _softcap_attention(q, k, v, causal, scale, softcap):
    """Float64 attention with capped scores, written out; differentiable by autograd."""
    g = q.shape[2] // k.shape[2]
    kt, vt = (t.double().repeat_interleave(g, dim=2).transpose(1, 2) for t in (k, v))
    s = softcap * torch.tanh(q.double().transpose(1, 2) @ kt.transpose(-1, -2) * scale / softcap)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return (torch.softmax(s, -1) @ vt).transpose(1, 2), torch.logsumexp(s, -1)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_4_softcap(monkeypatch, causal):
    """Softcap computed in the kernel, forward and backward, given the final out and lse."""
    cs.install(monkeypatch.setattr, ("flash_attn_4",))
    assert registry._REGISTERED["flash_attn_4"].backend.softcap
    q, k, v, dout = _inputs(sk=6 if causal else 10)
    out, lse = flash_attn4.fa4_forward(q, k, v, causal, 0.4, softcap=2.0)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = _softcap_attention(qr, kr, vr, causal, 0.4, 2.0)
    ref_out.backward(dout)
    assert rel_err(out, ref_out.detach()) < 1e-10 and rel_err(lse, ref_lse.detach()) < 1e-6
    grads = flash_attn4.fa4_backward(dout, q, k, v, ref_out.detach(), ref_lse.detach(), causal, 0.4, softcap=2.0)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
        assert rel_err(got, want) < 1e-6


def test_flash_attn_4_refusals(monkeypatch):
    cs.install(monkeypatch.setattr, ("flash_attn_4",))
    q = torch.randn(1, 8, 2, 192, dtype=torch.float64)
    monkeypatch.setattr(flash_attn4, "gpu_capability", lambda device: (10, 0))
    with pytest.raises(ValueError, match="head_dim <= 128 or 256 on this GPU generation, got 192"):
        flash_attn4.fa4_forward(q, q, q, True, 0.1)
    q256 = torch.randn(1, 8, 2, 256, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="no softcap at head_dim 256"):
        flash_attn4.fa4_backward(q256, q256, q256, q256, q256, torch.zeros(1, 2, 8), True, 0.1, softcap=5.0)
    for bad in (-1.0, 0.0):
        with pytest.raises(ValueError, match="softcap must be a positive float"):
            flash_attn4.fa4_forward(q256, q256, q256, True, 0.1, softcap=bad)


def test_flash_attn_4_version_and_signature_are_checked(monkeypatch):
    monkeypatch.setattr(flash_attn4.importlib.metadata, "version", lambda dist: "4.0.0b20")
    flash_attn4._fa4.cache_clear()
    with pytest.raises(ValueError, match=r"supports flash-attn-4 4.0.0b36 <= version < 5, found 4.0.0b20"):
        flash_attn4._fa4()
    flash_attn4._fa4.cache_clear()

    def renamed(q, k, v, softmax_scale=None, causal=False, logit_cap=None, return_lse=False):
        raise AssertionError("must not be called")

    cs.install(monkeypatch.setattr, ("flash_attn_4",))
    monkeypatch.setattr(flash_attn4, "_fa4", lambda: (type("M", (), {"_flash_attn_fwd": renamed}), Version("4.1")))
    q, k, v, _ = _inputs()
    with pytest.raises(NotImplementedError, match=r"unexpected signature.*\['softcap'\]"):
        flash_attn4.fa4_forward(q, k, v, True, 0.3)


def _cuda_machine(monkeypatch, capability):
    """Pretend to be a CUDA machine of ``capability`` with every CUDA kernel installed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for module in (base, registry, flash_attn3, flash_attn4):
        monkeypatch.setattr(module, "gpu_capability", lambda device: capability)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    monkeypatch.setattr(flash_attn2, "_fa2", lambda: (None, Version("2.8.3")))
    monkeypatch.setattr(flash_attn3, "_fa3", lambda: None)
    monkeypatch.setattr(flash_attn4, "_fa4", lambda: (fa4_standin, flash_attn4.FA4_MIN))
    table = {n: e._replace(backend=dataclasses.replace(e.backend, installed=lambda: True))
             for n, e in registry._REGISTERED.items()}
    monkeypatch.setattr(registry, "_REGISTERED", table)


@pytest.mark.parametrize("capability,dtype,expected", [
    ((9, 0), torch.bfloat16, ["flash_attn_3", "flash_attn_4", "torch_cudnn", "flash_attn", "torch_flash",
                              "torch_efficient", "reference"]),
    ((10, 0), torch.bfloat16, ["flash_attn_4", "torch_cudnn", "flash_attn", "torch_flash", "torch_efficient",
                               "reference"]),
    ((8, 0), torch.float16, ["torch_cudnn", "flash_attn", "torch_flash", "torch_efficient", "reference"]),
    ((9, 0), torch.float32, ["torch_efficient", "reference"]),
    ((7, 5), torch.float16, ["torch_efficient", "reference"]),
])
def test_cuda_auto_order(monkeypatch, capability, dtype, expected):
    _cuda_machine(monkeypatch, capability)
    cuda = torch.device("cuda")
    assert available_backends(cuda, dtype) == expected
    # "auto" passes cuDNN over below sm90, where PyTorch itself prefers its flash op.
    auto = [n for n in expected if not (n == "torch_cudnn" and capability < (9, 0))][0]
    assert get_backend("auto", cuda, dtype).name == auto
    if capability == (10, 0):
        with pytest.raises(ValueError, match="runs on sm90 GPUs only, this one is 10.0"):
            get_backend("flash_attn_3", cuda, dtype)
    if capability == (8, 0):
        with pytest.raises(ValueError, match=r"compute capability >= 9\.0"):
            get_backend("flash_attn_4", cuda, dtype)
        assert get_backend("torch_cudnn", cuda, dtype).name == "torch_cudnn"  # by name it runs on sm80


def test_flash_attn_4_probe_reads_the_installed_signature(monkeypatch):
    """get_backend refuses an installed flash-attn 4 whose entry points lost a parameter
    hf_ring passes, before any tensor exists."""
    monkeypatch.setattr(flash_attn4, "_fa4", lambda: (fa4_standin, flash_attn4.FA4_MIN))
    flash_attn4._probe(torch.device("cuda"), torch.bfloat16)

    def no_softcap_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, deterministic=False):
        raise AssertionError("must not be called")

    module = type("M", (), {"_flash_attn_fwd": fa4_standin._flash_attn_fwd, "_flash_attn_bwd": no_softcap_bwd})
    monkeypatch.setattr(flash_attn4, "_fa4", lambda: (module, Version("4.0.1")))
    with pytest.raises(NotImplementedError, match=r"_flash_attn_bwd has an unexpected signature.*\['softcap'"):
        flash_attn4._probe(torch.device("cuda"), torch.bfloat16)
