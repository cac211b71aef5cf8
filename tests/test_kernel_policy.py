"""The kernel policy: ``backend="auto"`` picks, per call, only among the kernels that compute
what the call needs (a masked kernel for a window, softcapping, the head size) on its device
and dtype, says once when that leaves only a slow fallback, and a named kernel that lacks a
need is refused naming those that have it. The choice reaches the plans of the public ops
and of ``ring_flash`` (the context-parallel state's ``backend``).
"""

from __future__ import annotations

import logging

import pytest
import torch

import hf_ring
from hf_ring.hf.forward_context import ForwardContext
from hf_ring.kernels import AttentionBackend, get_backend, register_backend
from hf_ring.kernels.base import KernelNeeds
from hf_ring.kernels.reference import reference_backward, reference_forward
from hf_ring.patterns.build import build_plan
from closeness import fake_cp_state

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

CPU = torch.device("cpu")


def _fake(name: str, **fields) -> AttentionBackend:
    return AttentionBackend(name=name, forward=reference_forward, backward=reference_backward, devices=("cpu",),
                            dtypes=(torch.float32,), description=f"{name} stand-in", **fields)


def test_auto_takes_the_first_kernel_that_computes_the_call():
    assert get_backend("auto", CPU, torch.float32).name == "torch_cpu_flash"
    # torch_cpu_flash has a masked kernel but no softcapping: a softcapped call skips it.
    assert get_backend("auto", CPU, torch.float32, KernelNeeds(masked=True)).name == "torch_cpu_flash"
    assert get_backend("auto", CPU, torch.float32, KernelNeeds(softcap=True)).name == "reference"
    assert get_backend("auto", CPU, torch.float32, KernelNeeds(masked=True, softcap=True)).name == "reference"


def test_a_named_kernel_without_a_need_is_refused_naming_those_that_have_it():
    with pytest.raises(NotImplementedError, match=r"'torch_cpu_flash' cannot compute logit softcapping; "
                                                  r"use backend='reference' \(cpu/cuda\)"):
        get_backend("torch_cpu_flash", CPU, torch.float32, KernelNeeds(softcap=True))


def test_auto_skips_a_kernel_whose_head_size_limit_the_call_exceeds(own_registry):
    register_backend(_fake("small_heads", max_head_dim=64), auto_priority=100)
    assert get_backend("auto", CPU, torch.float32, KernelNeeds(head_dim=64)).name == "small_heads"
    assert get_backend("auto", CPU, torch.float32, KernelNeeds(head_dim=128)).name == "torch_cpu_flash"
    with pytest.raises(NotImplementedError, match="'small_heads' does not take head_dim 128"):
        get_backend("small_heads", CPU, torch.float32, KernelNeeds(head_dim=128))


def test_auto_says_once_when_only_a_slow_kernel_computes_the_call(own_registry, caplog):
    register_backend(_fake("fast"), auto_priority=100)
    register_backend(_fake("slow", softcap=True, slow_on=("cpu",)), auto_priority=50)
    with caplog.at_level(logging.WARNING, logger="hf_ring"):
        assert get_backend("auto", CPU, torch.float32).name == "fast"
        assert not caplog.records
        for _ in range(3):
            assert get_backend("auto", CPU, torch.float32, KernelNeeds(softcap=True)).name == "slow"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "'slow'" in warnings[0] and "logit softcapping" in warnings[0] and "'fast'" in warnings[0]


def test_auto_with_no_kernel_for_the_call_names_what_each_lacks(own_registry, monkeypatch):
    from hf_ring.kernels import registry

    monkeypatch.setattr(registry, "_REGISTERED", {"fast": registry._Registered(_fake("fast"), 1)})
    with pytest.raises(NotImplementedError, match="fast lacks logit softcapping"):
        get_backend("auto", CPU, torch.float32, KernelNeeds(softcap=True))


def _plan(backend: str, **features):
    return build_plan(pattern="ring", group=None, rank=0, world=1, layout="zigzag", causal=True, scale=0.25,
                      backend=backend, device=CPU, dtype=torch.float32, n_heads=4, n_kv_heads=2, head_dim=16,
                      seq=64, **features)


def test_plans_get_the_kernel_their_features_need():
    assert _plan("auto").backend.name == "torch_cpu_flash"
    assert _plan("auto", softcap=30.0).backend.name == "reference"
    assert _plan("auto", window=8).backend.name == "torch_cpu_flash"
    # A window of the whole sequence masks nothing: dropped, so no need of a masked kernel.
    assert _plan("auto", window=64).window is None
    with pytest.raises(NotImplementedError, match="cannot compute logit softcapping"):
        _plan("torch_cpu_flash", softcap=30.0)


def test_the_state_names_a_kernel_and_points_a_process_group_backend_to_dist_backend():
    with pytest.raises(ValueError, match="pass the process-group backend as dist_backend='gloo'"):
        hf_ring.setup_context_parallel(1, backend="gloo", activate=False)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        hf_ring.RingAttentionPlugin(cp_size=1, backend="flash")
    state = hf_ring.setup_context_parallel(1, backend="reference", activate=False)
    assert state.kernel == "reference"


def test_ring_flash_plans_use_the_states_kernel_choice():
    state = fake_cp_state(0, 2, kernel="reference")
    q = torch.zeros(1, 8, 4, 16)
    assert ForwardContext(state).plan(q, 2, 0.25).backend.name == "reference"
    auto = fake_cp_state(0, 2)
    assert ForwardContext(auto).plan(q, 2, 0.25).backend.name == "torch_cpu_flash"
    assert ForwardContext(auto).plan(q, 2, 0.25, softcap=50.0).backend.name == "reference"
    named = fake_cp_state(0, 2, kernel="torch_cpu_flash")
    with pytest.raises(NotImplementedError, match="cannot compute logit softcapping"):
        ForwardContext(named).plan(q, 2, 0.25, softcap=50.0)
