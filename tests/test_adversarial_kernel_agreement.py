"""Ranks that pass different kernels raise on every rank instead of hanging.

Found by an adversarial review: with ``softcap`` set, a rank on ``torch_cpu_flash`` (no
softcapping) refused alone while the rank on ``reference`` started the ring and waited
for a transfer that never came. The kernel name is now one of the fields every rank
checks before any transfer (public ops) and in the forward's header (ring_flash).
"""

from __future__ import annotations

import torch

import hf_ring
from distributed import run_world

KERNELS = ("reference", "torch_cpu_flash")


def _disagree(rank: int, world: int) -> list:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 4, 8, generator=g)
    k, v = torch.randn(1, 8, 2, 8, generator=g), torch.randn(1, 8, 2, 8, generator=g)
    errors = []
    calls = (
        lambda: hf_ring.context_parallel_attn_func(q, k, v, softcap=2.0, backend=KERNELS[rank]),
        lambda: hf_ring.ring_flash_attn_func(q, k, v, backend=KERNELS[rank]),
        lambda: hf_ring.ring_flash_attn_varlen_func(q[0], k[0], v[0], [0, 8, 16], backend=KERNELS[rank]),
    )
    for call in calls:
        try:
            call()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_ranks_on_different_kernels_all_raise():
    for errors in run_world(2, _disagree):
        assert all(e is not None and "kernel" in e and "differ across the ranks" in e for e in errors), errors
