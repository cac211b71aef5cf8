"""Mistakes are errors that say what to do, on every rank, and never a hang."""

from __future__ import annotations

import pytest
import torch

import hf_ring
from distributed import run_world
from hf_ring.kernels import get_backend


def _qkv(b=1, s=8, hq=4, hk=2, d=16, dtype=torch.float32):
    return torch.randn(b, s, hq, d, dtype=dtype), torch.randn(b, s, hk, d, dtype=dtype), torch.randn(b, s, hk, d, dtype=dtype)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (*_qkv(hq=6, hk=4),), "not a multiple of n_kv_heads"),
        (lambda: (*_qkv(s=7),), "local_seq=7 is odd"),
        (lambda: (_qkv()[0].transpose(1, 2), *_qkv()[1:]), "must agree on batch, local_seq"),
        (lambda: (_qkv()[0][0], *_qkv()[1:]), "flash-attn layout"),
        (lambda: (_qkv()[0].double(), *_qkv()[1:]), "share a dtype"),
        (lambda: (_qkv()[0], _qkv()[1], _qkv(hk=1)[2]), "must agree on batch, local_seq and n_kv_heads"),
    ],
)
def test_local_errors(make, match):
    q, k, v = make()
    with pytest.raises(ValueError, match=match):
        hf_ring.ring_flash_attn_func(q, k, v)


def test_unknown_layout_and_backend():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown context-parallel layout"):
        hf_ring.ring_flash_attn_func(q, k, v, layout="ring")
    with pytest.raises(ValueError, match="unknown attention backend"):
        hf_ring.ring_flash_attn_func(q, k, v, backend="fast")
    with pytest.raises(ValueError, match="runs on cpu, but the tensors are on meta"):
        get_backend("torch_cpu_flash", torch.device("meta"), torch.float32)


def _mismatched_rank(rank: int, world: int, what: str) -> str:
    """Rank 1 passes something different; every rank must get the same error."""
    s = 8 if (what != "length" or rank == 0) else 12
    hk = 2 if (what != "heads" or rank == 0) else 4
    odd = what == "odd" and rank == 1
    q, k, v = _qkv(s=7 if odd else s, hk=hk)
    try:
        hf_ring.ring_flash_attn_func(q, k, v)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("what", ["length", "heads", "odd"])
def test_mismatch_across_ranks_is_an_error_on_every_rank(what):
    messages = run_world(2, _mismatched_rank, what)
    for m in messages:
        assert "differ across the ranks" in m, m
