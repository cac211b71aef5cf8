"""CPU-side checks of the CUDA backends flash_attn (2.x), flash_attn_3 and torch_efficient
(hf_ring/kernels/cuda/flash_attn2.py, flash_attn3.py, torch_efficient.py and their shared
cuda_glue.py), and of the registry around all backends; test_kernels_cuda_glue.py checks
torch_flash, torch_cudnn, flash_attn_4 and the CUDA auto order.

Without a GPU the kernels cannot run, so this file checks what can be checked here:
- they are never offered or chosen for CPU tensors, and asking for them is a clear error;
- the installed PyTorch's schema of the memory-efficient op is the one the code calls;
- the glue around each kernel (argument binding per flash-attn version, lse padding,
  GQA head repetition and gradient summation) against the reference backend, with the
  kernel replaced by a CPU stand-in that follows the kernel's documented contract
  (signature, return tuple, lse layout): tests/cuda_standins.py for the current
  interfaces, the older ones (flash-attn 2.6, early hopper builds) below. These stand-ins
  are written from the upstream signatures, so a wrong argument name or return index in
  the glue fails here. What the glue returns is compared with attention written
  independently of hf_ring (``reference_attention.block_attention``), not with the
  reference backend the stand-ins call, so a wrong reference fails here too.

Tolerance: float64 inputs; out within 1e-10 relative error (the glue adds no arithmetic),
lse and gradients within 1e-6, because the kernels' lse is float32 by contract (~1e-8
relative rounding, which the stand-ins reproduce).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from packaging.version import Version

from hf_ring.kernels import AttentionBackend, available_backends, get_backend, register_backend, registry
from hf_ring.kernels.cuda import flash_attn2, flash_attn3, flash_attn4, torch_cudnn, torch_efficient, torch_flash
from hf_ring.kernels.cuda import glue as cuda_glue
from hf_ring.kernels.reference import reference_backward, reference_forward

import cuda_standins as cs
import fa3_standin
import fa4_standin
from closeness import rel_err
from reference_attention import block_attention, block_attention_grads, segment_attention
from varlen_standin import looped_varlen_backward, looped_varlen_forward

CUDA_NAMES = cs.CUDA_NAMES


def test_not_offered_on_cpu():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        names = available_backends(torch.device("cpu"), dtype)
        assert not set(CUDA_NAMES) & set(names)
        assert get_backend("auto", torch.device("cpu"), dtype).name == "torch_cpu_flash"


@pytest.mark.parametrize("name", CUDA_NAMES)
def test_asking_on_cpu_is_a_clear_error(name):
    with pytest.raises(ValueError, match="cuda|not installed"):
        get_backend(name, torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("fn", [flash_attn2.fa2_forward, flash_attn3.fa3_forward, torch_efficient.efficient_forward,
                                torch_flash.flash_forward, torch_cudnn.cudnn_forward, flash_attn4.fa4_forward])
def test_kernels_refuse_cpu_tensors(fn):
    q = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="runs on cuda, but the tensors are on cpu"):
        fn(q, q, q, True, 0.5)


def test_efficient_schema_matches_installed_torch():
    torch_efficient.check_efficient_schema()


def _inputs(hq=4, hk=2, sq=6, sk=6, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, sq, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(2, sk, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, sk, hk, d, generator=g, dtype=torch.float64)
    dout = torch.randn(2, sq, hq, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _check_against_reference(backend_fwd, backend_bwd, causal, hq=4, hk=2):
    sk = 6 if causal else 10
    q, k, v, dout = _inputs(hq=hq, hk=hk, sk=sk)
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = backend_fwd(q, k, v, causal, scale)
    ref_out, ref_lse = block_attention(q, k, v, causal, scale)
    assert rel_err(out, ref_out) < 1e-10 and lse.dtype == torch.float32 and rel_err(lse, ref_lse) < 1e-6
    # A non-contiguous column slice of a wider lse, as the ring passes it.
    lse_view = torch.cat([ref_lse, ref_lse], dim=-1)[:, :, : q.shape[1]]
    grads = backend_bwd(dout, q, k, v, ref_out, lse_view, causal, scale)
    for got, want in zip(grads, block_attention_grads(dout, q, k, v, causal, scale)):
        assert got.shape == want.shape and rel_err(got, want) < 1e-6


# ---------------------------------------------------- stand-ins for the CUDA kernels


def _allow_cpu_tensors(monkeypatch, module) -> None:
    """Let a CUDA backend module's glue run on the stand-ins' CPU float64 tensors, which
    its per-launch check rightly refuses."""
    monkeypatch.setattr(module, "check_block", lambda *a: None)


def _ref_lse(q, k, v, causal, scale):
    return reference_forward(q, k, v, causal, scale)


def _fa2_26_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    assert dropout_p == 0.0 and window_size == (-1, -1) and softcap == 0.0 and alibi_slopes is None
    out, lse = _ref_lse(q, k, v, causal, softmax_scale)
    return out, q, k, v, out, lse.float(), None, None


def _fa2_26_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                     window_size, softcap, alibi_slopes, deterministic, rng_state=None):
    assert softmax_lse.is_contiguous() and softmax_lse.dtype == torch.float32 and window_size == (-1, -1)
    for buf, g in zip((dq, dk, dv), reference_backward(dout, q, k, v, out, softmax_lse.double(), causal, softmax_scale)):
        buf.copy_(g)
    return dq, dk, dv, None


@pytest.mark.parametrize("version", ["2.6.3", "2.8.3"])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_2_glue(monkeypatch, version, causal):
    if Version(version) >= flash_attn2.FA2_SPLIT_WINDOW:
        module = SimpleNamespace(_flash_attn_forward=cs.fa2_forward, _flash_attn_backward=cs.fa2_backward)
    else:
        module = SimpleNamespace(_flash_attn_forward=_fa2_26_forward, _flash_attn_backward=_fa2_26_backward)
    _allow_cpu_tensors(monkeypatch, flash_attn2)
    monkeypatch.setattr(flash_attn2, "_fa2", lambda: (module, Version(version)))
    _check_against_reference(flash_attn2.fa2_forward, flash_attn2.fa2_backward, causal)


def test_flash_attn_2_wrong_signature_is_an_error(monkeypatch):
    module = SimpleNamespace(_flash_attn_forward=_fa2_26_forward, _flash_attn_backward=_fa2_26_backward)
    _allow_cpu_tensors(monkeypatch, flash_attn2)
    monkeypatch.setattr(flash_attn2, "_fa2", lambda: (module, Version("2.7.4")))  # 2.7 names on a 2.6 signature
    q, k, v, _ = _inputs()
    with pytest.raises(NotImplementedError, match="unexpected signature"):
        flash_attn2.fa2_forward(q, k, v, True, 0.3)


def _fa3_old_forward(q, k, v, softmax_scale, causal, window_size, descale_q=None):
    mask = fa4_standin.window_mask(q.shape[1], k.shape[1], causal, *window_size)  # (-1, -1): None
    out, lse = reference_forward(q, k, v, causal, softmax_scale, mask)
    return out, q, k, v, out, lse.float(), None


def _fa3_old_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window_size, deterministic):
    mask = fa4_standin.window_mask(q.shape[1], k.shape[1], causal, *window_size)
    for buf, g in zip((dq, dk, dv), reference_backward(dout, q, k, v, out, softmax_lse.double(), causal, softmax_scale,
                                                      mask)):
        buf.copy_(g)
    return dq, dk, dv, None


@pytest.mark.parametrize("era", ["release", "main", "early"])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_3_glue(monkeypatch, era, causal):
    """The hopper interface of three eras (tests/fa3_standin.py: v2.8.3's required arguments
    and ``window_size=(l, r)``; the later custom ops' defaults and split window; the first
    builds' short signature, below)."""
    early = SimpleNamespace(_flash_attn_forward=_fa3_old_forward, _flash_attn_backward=_fa3_old_backward)
    module = early if era == "early" else fa3_standin.module(era)
    _allow_cpu_tensors(monkeypatch, flash_attn3)
    monkeypatch.setattr(flash_attn3, "_fa3", lambda: module)
    _check_against_reference(flash_attn3.fa3_forward, flash_attn3.fa3_backward, causal)


def test_params_of_a_torch_custom_op():
    @torch.library.custom_op("hf_ring_test::fa_like", mutates_args=(), device_types="cpu")
    def fa_like(q: torch.Tensor, softmax_scale: float, is_causal: bool = False) -> torch.Tensor:
        return q.clone()

    assert cuda_glue.params_of(fa_like) == {"q": False, "softmax_scale": False, "is_causal": True}
    kwargs = cuda_glue.bind_kwargs(fa_like, "fa_like", {"q": torch.ones(1), "softmax_scale": 0.5})
    assert set(kwargs) == {"q", "softmax_scale"}
    with pytest.raises(NotImplementedError, match="unexpected signature"):
        cuda_glue.bind_kwargs(fa_like, "fa_like", {"q": torch.ones(1), "softmax_scale": 0.5, "causal": True})


def test_pick_out_lse_refuses_a_wrong_tuple():
    q = torch.zeros(1, 5, 2, 8)
    with pytest.raises(NotImplementedError, match="not supported"):
        cuda_glue.pick_out_lse((q, torch.zeros(1, 2, 6)), q, "kernel")


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_torch_efficient_glue(monkeypatch, heads, causal):
    _allow_cpu_tensors(monkeypatch, torch_efficient)
    monkeypatch.setattr(torch_efficient, "_EFF_FWD", cs.efficient_forward)
    monkeypatch.setattr(torch_efficient, "_EFF_BWD", cs.efficient_backward)
    _check_against_reference(torch_efficient.efficient_forward, torch_efficient.efficient_backward, causal, *heads)


def _fake(name="fake", **fields) -> AttentionBackend:
    return AttentionBackend(name=name, forward=reference_forward, backward=reference_backward, devices=("cpu",),
                            dtypes=(torch.float32,), description="stand-in", **fields)


def test_auto_skips_a_backend_that_cannot_run_here_and_naming_it_is_an_error(own_registry):
    def probe(device, dtype):
        raise ValueError("fake kernel needs a newer GPU")

    register_backend(_fake(probe=probe), auto_priority=100)
    assert get_backend("auto", torch.device("cpu"), torch.float32).name == "torch_cpu_flash"
    with pytest.raises(ValueError, match="fake kernel needs a newer GPU"):
        get_backend("fake", torch.device("cpu"), torch.float32)


def test_auto_takes_the_highest_priority_and_none_means_by_name_only(own_registry):
    cpu = torch.device("cpu")
    register_backend(_fake("by_name_only"))
    assert get_backend("auto", cpu, torch.float32).name == "torch_cpu_flash"
    assert get_backend("by_name_only", cpu, torch.float32).name == "by_name_only"
    register_backend(_fake("preferred"), auto_priority=11)
    assert get_backend("auto", cpu, torch.float32).name == "preferred"
    # Only for the dtypes it takes: bf16 still goes to the CPU flash op.
    assert get_backend("auto", cpu, torch.bfloat16).name == "torch_cpu_flash"
    assert {"by_name_only", "preferred"} <= set(available_backends(cpu, torch.float32))


def test_register_refuses_a_duplicate_or_reserved_name(own_registry):
    with pytest.raises(ValueError, match="registered already; pass replace=True"):
        register_backend(_fake("reference"))
    with pytest.raises(ValueError, match="reserved"):
        register_backend(_fake("auto"))
    with pytest.raises(ValueError, match="registered already"):
        register_backend(_fake("torch_flash"))
    replacement = _fake("reference")
    register_backend(replacement, replace=True)
    assert get_backend("reference", torch.device("cpu"), torch.float32) is replacement


def test_a_backend_not_installed_says_how_to_install_it(own_registry):
    register_backend(_fake(installed=lambda: False, install_hint="pip install fake-attn"), auto_priority=100)
    assert "fake" not in available_backends(torch.device("cpu"), torch.float32)
    assert get_backend("auto", torch.device("cpu"), torch.float32).name == "torch_cpu_flash"
    with pytest.raises(ValueError, match=r"not installed \(pip install fake-attn\)"):
        get_backend("fake", torch.device("cpu"), torch.float32)


def test_the_record_takes_keywords_and_both_varlen_kernels_or_neither():
    with pytest.raises(TypeError):
        AttentionBackend("positional", reference_forward, reference_backward, ("cpu",), (torch.float32,), "x")
    with pytest.raises(ValueError, match="both"):
        _fake(varlen_forward=looped_varlen_forward)


# ------------------------------------------- flash-attn 2 varlen kernel (packed rows)
# Stand-ins written from the upstream signatures of _flash_attn_varlen_forward/_backward:
# 2.6 (window_size tuple, 8-tuple return) and 2.7+ (split window, (out, lse, S, rng);
# 2.8 adds zero_tensors=False to the backward). lse is (heads, total_q) since 2.6.


def _fa2_26_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                           softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None):
    assert dropout_p == 0.0 and window_size == (-1, -1) and block_table is None and not return_softmax
    out, lse = looped_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     causal, softmax_scale)
    return out, q, k, v, out, lse, None, None


def _fa2_26_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                            max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                            alibi_slopes, deterministic, rng_state=None):
    assert softmax_lse.is_contiguous() and softmax_lse.dtype == torch.float32 and window_size == (-1, -1)
    grads = looped_varlen_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, causal, softmax_scale)
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(g)
    return dq, dk, dv, None


@pytest.mark.parametrize("version", ["2.6.3", "2.8.3"])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_2_varlen_glue(monkeypatch, version, causal):
    fns = (cs.fa2_varlen_forward, cs.fa2_varlen_backward) if Version(version) >= flash_attn2.FA2_SPLIT_WINDOW \
        else (_fa2_26_varlen_forward, _fa2_26_varlen_backward)
    module = SimpleNamespace(_flash_attn_varlen_forward=fns[0], _flash_attn_varlen_backward=fns[1])
    _allow_cpu_tensors(monkeypatch, flash_attn2)
    monkeypatch.setattr(flash_attn2, "_fa2", lambda: (module, Version(version)))
    backend = flash_attn2.FLASH_ATTN
    assert backend.name == "flash_attn" and backend.varlen_forward is flash_attn2.fa2_varlen_forward
    # Three segments of unequal lengths (square when causal, as the ring asks).
    q_lens, k_lens = (3, 6, 2), ((3, 6, 2) if causal else (5, 1, 4))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (q_lens, k_lens))
    q, k, v, dout = _inputs(sq=sum(q_lens), sk=sum(k_lens))
    q, k, v, dout = q[0], k[0], v[0], dout[0]  # (total, heads, d)
    args = (cu_q, cu_k, max(q_lens), max(k_lens), causal, 0.3)
    out, lse = flash_attn2.fa2_varlen_forward(q, k, v, *args)
    ref = segment_attention(q, k, v, dout, cu_q, cu_k, causal, 0.3)
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    assert rel_err(out, ref["out"]) < 1e-10 and rel_err(lse, ref["lse"]) < 1e-6
    # A non-contiguous column slice of a wider lse, as the ring passes it.
    lse_view = torch.cat([ref["lse"], ref["lse"]], dim=-1)[:, : q.shape[0]]
    grads = flash_attn2.fa2_varlen_backward(dout, q, k, v, ref["out"], lse_view, *args)
    for got, name, like in zip(grads, ("dq", "dk", "dv"), (q, k, v)):
        assert got.shape == like.shape and rel_err(got, ref[name]) < 1e-6


def test_flash_attn_2_varlen_refuses_a_padded_lse(monkeypatch):
    """flash-attn before 2.6 returned the varlen lse padded, (n_seqs, heads, max_q)."""

    def padded_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                       softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                       alibi_slopes=None, return_softmax=False):
        n = cu_seqlens_q.numel() - 1
        return q, torch.zeros(n, q.shape[1], max_seqlen_q), None, None

    _allow_cpu_tensors(monkeypatch, flash_attn2)
    monkeypatch.setattr(flash_attn2, "_fa2", lambda: (SimpleNamespace(_flash_attn_varlen_forward=padded_forward),
                                               Version("2.7.4")))
    q = torch.randn(6, 4, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="not supported"):
        flash_attn2.fa2_varlen_forward(q, q[:, :2], q[:, :2], cu, cu, 4, 4, True, 0.3)
