"""The context-parallel gated delta rule (hf_ring.mixers.delta_rule) computes what one
process computes over the full sequence: outputs, final states and the gradients of
every input, against a float64 token-by-token recurrence written here (and the local
chunked op also against transformers' own torch_chunk_gated_delta_rule).

Tolerances. float64 runs check the math: the chunked scan, the summaries and their
composition only reassociate sums of O(1) terms, so they agree with the step recurrence
to ~1e-13; we allow 1e-9 (relative to the reference's largest entry). float32 runs check
the precision: the CP result must be no further from the float64 truth than the one-process
float32 scan over the full sequence (x 4, + 1e-6), i.e. context parallelism adds no error
of its own beyond float32 rounding of a few more products.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_world
from hf_ring.distributed.collectives import VirtualCollectives
from hf_ring.mixers.delta_rule import context_parallel_gated_delta_rule, gated_delta_rule_op
from hf_ring.mixers.delta_rule_chunk import local_gated_delta_rule
from hf_ring.sharding import shard_packed, shard_sequence, unshard_packed, unshard_sequence

NAMES = ("q", "k", "v", "g", "beta")


def step_reference(q, k, v, g, beta, initial=None, l2=False):
    """Token by token in float64: S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,
    o_t = S_t^T q_t / sqrt(dk). Shapes as the op's; returns out (b, s, hv, dv), final state."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    rep = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    if l2:
        q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q / q.shape[-1] ** 0.5
    b, s, hv, dk = q.shape
    state = q.new_zeros(b, hv, dk, v.shape[-1]) if initial is None else initial.double()
    outs = []
    for t in range(s):
        kt, bt = k[:, t, :, :, None], beta[:, t, :, None, None]  # (b, hv, dk, 1), (b, hv, 1, 1)
        state = g[:, t, :, None, None].exp() * (state - bt * kt * (kt.transpose(-1, -2) @ state))
        state = state + bt * kt * v[:, t, :, None, :]
        outs.append((state.transpose(-1, -2) @ q[:, t, :, :, None])[..., 0])
    return torch.stack(outs, 1), state


def make_inputs(seed, b, s, hk, hv, dk, dv, dtype=torch.float64, l2=False):
    """Random inputs of one row; without l2-normalisation keys get unit norm scale, so the
    transitions (I - beta k k^T) stay contractions. Decays are mild (g in (-0.15, 0)), so a
    state carries over hundreds of tokens: a missing or wrong entering state shows."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    k = r(b, s, hk, dk) * (1.0 if l2 else dk ** -0.5)
    x = {"q": r(b, s, hk, dk), "k": k, "v": r(b, s, hv, dv),
         "g": -0.15 * torch.rand(b, s, hv, generator=gen, dtype=torch.float64),
         "beta": torch.rand(b, s, hv, generator=gen, dtype=torch.float64)}
    return {n: t.to(dtype) for n, t in x.items()}, r(b, hv, dk, dv).to(dtype)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# ------------------------------------------------------------------ one process (a)


@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("with_init", [False, True])
def test_local_op_matches_step_recurrence_and_transformers(l2, with_init):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    x, init = make_inputs(0, 2, 150, 2, 4, 16, 12, l2=l2)  # 150: not a multiple of the chunk (32)
    init = init if with_init else None
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    init_leaf = init.clone().requires_grad_() if with_init else None
    out, final = local_gated_delta_rule(*leaves.values(), 32, init_leaf, l2)
    ref_leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    ref_init = init.clone().requires_grad_() if with_init else None
    ref_out, ref_final = step_reference(*ref_leaves.values(), ref_init, l2)
    assert rel(out, ref_out) < 1e-9 and rel(final, ref_final) < 1e-9
    go, gf = torch.randn_like(ref_out), torch.randn_like(ref_final)
    ((out * go).sum() + (final * gf).sum()).backward()
    ((ref_out * go).sum() + (ref_final * gf).sum()).backward()
    for n in NAMES:
        assert rel(leaves[n].grad, ref_leaves[n].grad) < 1e-9, n
    if with_init:
        assert rel(init_leaf.grad, ref_init.grad) < 1e-9
    # transformers' own function, float32, on the same full sequence.
    x32 = {n: t.float() for n, t in x.items()}
    i32 = None if init is None else init.float()
    hf_out, hf_final = torch_chunk_gated_delta_rule(*x32.values(), chunk_size=32, initial_state=i32,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=l2)
    out32, final32 = local_gated_delta_rule(*x32.values(), 32, i32, l2)
    assert out32.dtype == torch.float32 and final32.dtype == torch.float32
    assert rel(out32, hf_out) < 1e-5 and rel(final32, hf_final) < 1e-5
    assert rel(hf_out, ref_out) < 1e-4  # transformers agrees with the step recurrence too


def test_world_one_packed_rows_reset_the_state_per_document():
    x, _ = make_inputs(1, 1, 40, 1, 2, 8, 8)
    lens = [13, 20, 7]
    out, final = context_parallel_gated_delta_rule(*x.values(), local_doc_lens=lens, chunk_size=8,
                                                   output_final_state=True)
    assert final.shape == (1, 3, 2, 8, 8)
    start = 0
    for d, n in enumerate(lens):
        ref_out, ref_final = step_reference(*(t[:, start:start + n] for t in x.values()))
        assert rel(out[:, start:start + n], ref_out) < 1e-9 and rel(final[:, d], ref_final) < 1e-9
        start += n


def test_refusals():
    x, init = make_inputs(2, 1, 16, 1, 2, 4, 4)
    with pytest.raises(ValueError, match="one-token runs"):
        context_parallel_gated_delta_rule(*x.values(), layout="stripe")
    with pytest.raises(ValueError, match="one-token runs"):  # world 2: the same refusal
        gated_delta_rule_op(*x.values(), VirtualCollectives(0, world=2), layout="stripe")
    with pytest.raises(ValueError, match="packed rows are zigzag"):
        gated_delta_rule_op(*x.values(), VirtualCollectives(0, world=2), layout="contiguous",
                            local_doc_lens=[8, 8])
    with pytest.raises(ValueError, match="initial_state with packed rows"):
        context_parallel_gated_delta_rule(*x.values(), local_doc_lens=[8, 8], initial_state=init)
    with pytest.raises(ValueError, match=r"initial_state must be \(batch, n_v_heads"):
        context_parallel_gated_delta_rule(*x.values(), initial_state=init[:, :1])
    with pytest.raises(ValueError, match="v must be"):
        context_parallel_gated_delta_rule(x["q"], x["k"], x["v"][:, :8], x["g"], x["beta"])
    with pytest.raises(ValueError, match="beta must be"):
        context_parallel_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"][:, :8])
    with pytest.raises(ValueError, match="do not make up"):
        context_parallel_gated_delta_rule(*x.values(), local_doc_lens=[8, 7])
