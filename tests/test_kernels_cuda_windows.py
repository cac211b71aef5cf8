"""CPU checks of sliding windows on the CUDA backends whose kernels take one
(``flash_attn_3``, ``flash_attn_4``, ``torch_flash``): each window-edge mask the ring
hands a masked kernel is cut into bands (``hf_ring/kernels/cuda/window_bands.py``) and run as
the kernel's ``(left, right)`` window. The masks come from the ring's own schedule; the
kernels are the stand-ins of tests/cuda_standins.py, which implement FlashAttention's
window convention (``fa4_standin.window_mask``); results are compared with float64
attention under the same mask, written out below and differentiated by autograd.

Tolerance as in test_kernels_cuda.py: float64 inputs, out within 1e-10, lse and
gradients within 1e-6 (the kernels' lse is float32 by contract).
"""

from __future__ import annotations

import pytest
import torch

import cuda_standins as cs
import fa3_standin
import fa4_standin
import hf_ring
from hf_ring.kernels import registry
from hf_ring.kernels.cuda import flash_attn3, torch_flash, window_bands
from hf_ring.patterns.plan import AttentionPlan
from hf_ring.patterns.ring.schedule import step_blocks
from hf_ring.patterns.ring.window import window_blocks
from hf_ring.sharding.layouts import shard_indices
from closeness import rel_err


def _window_edge_masks() -> list[torch.Tensor]:
    """The masks the ring hands a masked kernel: every window-edge block of every step of
    small rings (zigzag blocks span two chunks, so some masks are two bands)."""
    masks = []
    for layout, world, window in (("zigzag", 2, 5), ("zigzag", 3, 7), ("zigzag", 2, 11), ("stripe", 3, 8),
                                  ("contiguous", 2, 3)):
        local = 12
        seq = local * world
        for rank in range(world):
            for step in range(world):
                src = (rank - step) % world
                blocks = window_blocks(step_blocks(layout, True, local, rank, src),
                                       shard_indices(seq, world, rank, layout),
                                       shard_indices(seq, world, src, layout), window)
                masks += [b.mask for b in blocks if b.mask is not None]
    return masks


def test_window_masks_cut_into_bands():
    """Each mask is exactly the union of its bands' windows, rows disjoint and in order;
    some masks need more than one band."""
    masks = _window_edge_masks()
    counts = []
    for mask in masks:
        pieces = window_bands.bands(mask)
        counts.append(len(pieces))
        rebuilt = torch.zeros_like(mask)
        rows_seen = []
        for p in pieces:
            nq, nk = p.rows.stop - p.rows.start, p.cols.stop - p.cols.start
            assert p.left >= 0 and p.right >= 0
            rebuilt[p.rows, p.cols] = fa4_standin.window_mask(nq, nk, False, p.left, p.right)
            rows_seen += list(range(p.rows.start, p.rows.stop))
        assert torch.equal(rebuilt, mask) and rows_seen == sorted(set(rows_seen))
        assert window_bands.bands(mask) is pieces  # cut once per mask
    assert len(masks) > 20 and max(counts) > 1 and min(counts) == 1


def _masked_attention(q, k, v, mask, scale, softcap=0.0):
    """Float64 attention under a bool mask (optionally capped scores), written out;
    differentiable. Rows that see nothing: out 0, lse -inf."""
    g = q.shape[2] // k.shape[2]
    kt, vt = (t.double().repeat_interleave(g, dim=2).transpose(1, 2) for t in (k, v))
    s = q.double().transpose(1, 2) @ kt.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, -1).nan_to_num(0.0) @ vt).transpose(1, 2), torch.logsumexp(s, -1)


@pytest.mark.parametrize("name,softcap,era", [("torch_flash", None, None), ("flash_attn_4", None, None),
                                              ("flash_attn_4", 3.0, None), ("flash_attn_3", None, "release"),
                                              ("flash_attn_3", None, "main")])
def test_masked_kernel_on_window_edges(monkeypatch, name, softcap, era):
    """``era``: the hopper interface's (tests/fa3_standin.py): ``window_size=(l, r)`` in the
    release, two ints later."""
    backend = cs.install(monkeypatch.setattr, (name,))[name]
    if era is not None:
        monkeypatch.setattr(flash_attn3, "_fa3", lambda: fa3_standin.module(era))
    assert backend.masked
    extra = {"softcap": softcap} if softcap else {}
    g = torch.Generator().manual_seed(3)
    gap = _window_edge_masks()[0].clone()
    gap[1] = False  # a row that sees no key: out 0, lse -inf, no gradient
    for mask in [gap, *_window_edge_masks()[::3]]:
        sq, sk = mask.shape
        q, dout = (torch.randn(1, sq, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(1, sk, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want_out, want_lse = _masked_attention(*leaves, mask, 0.3, softcap or 0.0)
        want = torch.autograd.grad(want_out, leaves, dout)
        out, lse = backend.masked_forward(q, k, v, mask, 0.3, **extra)
        assert rel_err(out, want_out.detach()) < 1e-10
        assert torch.equal(lse.isinf(), want_lse.isinf()) and rel_err(lse.nan_to_num(0, 0, 0),
                                                                      want_lse.detach().nan_to_num(0, 0, 0)) < 1e-6
        grads = backend.masked_backward(dout, q, k, v, want_out.detach(), want_lse.detach(), mask, 0.3, **extra)
        for got, w in zip(grads, want):
            assert got.shape == w.shape and rel_err(got, w) < 1e-6


def test_flash_attn_3_window_on_the_early_interface(monkeypatch):
    """Early hopper builds take ``window_size=(left, right)``: the masked kernel there too."""
    from test_kernels_cuda import _fa3_old_backward, _fa3_old_forward

    backend = cs.install(monkeypatch.setattr, ("flash_attn_3",))["flash_attn_3"]
    monkeypatch.setattr(flash_attn3, "_fa3", lambda: type("M", (), {"_flash_attn_forward": _fa3_old_forward,
                                                                    "_flash_attn_backward": _fa3_old_backward}))
    mask = next(m for m in _window_edge_masks() if len(window_bands.bands(m)) > 1)
    g = torch.Generator().manual_seed(6)
    q, dout = (torch.randn(1, mask.shape[0], 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, mask.shape[1], 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = _masked_attention(*leaves, mask, 0.3)
    want = torch.autograd.grad(want_out, leaves, dout)
    out, lse = backend.masked_forward(q, k, v, mask, 0.3)
    assert rel_err(out, want_out.detach()) < 1e-10 and rel_err(lse, want_lse.detach()) < 1e-6
    grads = backend.masked_backward(dout, q, k, v, want_out.detach(), want_lse.detach(), mask, 0.3)
    for got, w in zip(grads, want):
        assert rel_err(got, w) < 1e-6


@pytest.mark.parametrize("name", ["torch_flash", "flash_attn_4", "flash_attn_3"])
def test_window_through_the_ring(monkeypatch, name):
    """The whole op with a sliding window on a windowed backend (one process: the diagonal
    blocks are the window's edge), against float64 attention over the full sequence."""
    cs.install(monkeypatch.setattr, (name,))
    g = torch.Generator().manual_seed(4)
    q, dout = (torch.randn(2, 16, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 16, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    visible = torch.ones(16, 16, dtype=torch.bool).tril() & ~torch.ones(16, 16, dtype=torch.bool).tril(-5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = _masked_attention(*leaves, visible, 8 ** -0.5)
    want = torch.autograd.grad(want_out, leaves, dout)
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = hf_ring.ring_flash_attn_func(ql, kl, vl, backend=name, window=5, return_lse=True)
    out.backward(dout)
    assert rel_err(out, want_out.detach()) < 1e-10 and rel_err(lse, want_lse.detach()) < 1e-6
    for got, w in zip((ql.grad, kl.grad, vl.grad), want):
        assert rel_err(got, w) < 1e-6


def test_plan_hands_the_bands_over_without_a_host_sync(monkeypatch):
    """A window plan on a non-CPU device cuts each mask from the CPU copy it made it from:
    the masked kernel then runs the real op on ``meta`` tensors, whose values cannot be
    read back (a device-to-host copy would raise)."""
    monkeypatch.setattr(torch_flash, "check_block", lambda *a: None)
    meta = torch.device("meta")
    plan = AttentionPlan(group=None, rank=0, world=1, layout="zigzag", causal=True, scale=0.125,
                    backend=registry._REGISTERED["torch_flash"].backend, window=5)
    edge = [b for b in plan.blocks(0, 16) if b.mask is not None]
    assert edge
    for blk in edge:
        mask = plan.mask(blk, meta)
        nq, nk = blk.q_end - blk.q_start, blk.k_end - blk.k_start
        q = torch.empty(2, nq, 4, 64, device=meta, dtype=torch.bfloat16)
        k = torch.empty(2, nk, 2, 64, device=meta, dtype=torch.bfloat16)
        out, lse = torch_flash.flash_masked_forward(q, k, k, mask, 0.125)
        grads = torch_flash.flash_masked_backward(torch.empty_like(q), q, k, k, out, lse, mask, 0.125)
        assert out.shape == q.shape and lse.shape == (2, 4, nq)
        assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor|meta"):
        window_bands.bands(torch.ones(3, 3, dtype=torch.bool, device=meta))


def test_a_mask_that_is_no_window_is_refused():
    mask = torch.tensor([[True, False, True], [True, True, True]])
    with pytest.raises(ValueError, match="more than one run of keys"):
        window_bands.bands(mask)
