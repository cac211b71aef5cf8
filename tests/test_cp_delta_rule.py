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

from closeness import max_rel
from mixer_checks import backward_result, case_lengths, errors, out_of_bounds, sharders
from distributed import run_world
from hf_ring.distributed.collectives import VirtualCollectives
from hf_ring.mixers.delta_rule import context_parallel_gated_delta_rule, gated_delta_rule_op
from hf_ring.mixers.delta_rule_chunk import chunk_terms, heads_first, local_gated_delta_rule, scan, summary_scan

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
    assert max_rel(out, ref_out) < 1e-9 and max_rel(final, ref_final) < 1e-9
    go, gf = torch.randn_like(ref_out), torch.randn_like(ref_final)
    ((out * go).sum() + (final * gf).sum()).backward()
    ((ref_out * go).sum() + (ref_final * gf).sum()).backward()
    for n in NAMES:
        assert max_rel(leaves[n].grad, ref_leaves[n].grad) < 1e-9, n
    if with_init:
        assert max_rel(init_leaf.grad, ref_init.grad) < 1e-9
    # transformers' own function, float32, on the same full sequence.
    x32 = {n: t.float() for n, t in x.items()}
    i32 = None if init is None else init.float()
    hf_out, hf_final = torch_chunk_gated_delta_rule(*x32.values(), chunk_size=32, initial_state=i32,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=l2)
    out32, final32 = local_gated_delta_rule(*x32.values(), 32, i32, l2)
    assert out32.dtype == torch.float32 and final32.dtype == torch.float32
    assert max_rel(out32, hf_out) < 1e-5 and max_rel(final32, hf_final) < 1e-5
    assert max_rel(hf_out, ref_out) < 1e-4  # transformers agrees with the step recurrence too


def test_world_one_packed_rows_reset_the_state_per_document():
    x, _ = make_inputs(1, 1, 40, 1, 2, 8, 8)
    lens = [13, 20, 7]
    out, final = context_parallel_gated_delta_rule(*x.values(), local_doc_lens=lens, chunk_size=8,
                                                   output_final_state=True)
    assert final.shape == (1, 3, 2, 8, 8)
    start = 0
    for d, n in enumerate(lens):
        ref_out, ref_final = step_reference(*(t[:, start:start + n] for t in x.values()))
        assert max_rel(out[:, start:start + n], ref_out) < 1e-9 and max_rel(final[:, d], ref_final) < 1e-9
        start += n
    # bfloat16 inputs: outputs in bfloat16, states accumulated and returned in float32.
    out16, final16 = context_parallel_gated_delta_rule(*(t.bfloat16() for t in x.values()), local_doc_lens=lens,
                                                       chunk_size=8, output_final_state=True)
    assert out16.dtype == torch.bfloat16 and final16.dtype == torch.float32
    assert max_rel(out16, out) < 3e-2 and max_rel(final16, final) < 3e-2  # bfloat16 inputs' own rounding


def test_summary_of_a_fast_decaying_run_keeps_its_precision_without_subnormals():
    """256 tokens at g = -0.35: the transition falls to ~1e-41 and the late rows of Qhat
    below float32's smallest normal number. The float32 summary matches the float64 one
    row by row (rows above 1e4 x that number: relative error < 1e-4), holds no subnormal
    entries (every later CPU operation on them would be slow), and the float64 summary is
    the affine response of the scan to its entering state."""
    x, _ = make_inputs(3, 1, 256, 1, 2, 16, 16, l2=True)
    x["g"] = torch.full_like(x["g"], -0.35)
    terms = {dt: chunk_terms(*heads_first(*(t.to(dt) for t in x.values()), True), 32)
             for dt in (torch.float32, torch.float64)}
    (qhat32, summ32), (qhat64, summ64) = (summary_scan(terms[dt]) for dt in (torch.float32, torch.float64))
    s_in = torch.randn(1, 2, 16, 16, dtype=torch.float64)
    (out1, end1), (out0, end0) = scan(terms[torch.float64], s_in), scan(terms[torch.float64])
    assert max_rel(out0 + qhat64 @ s_in, out1) < 1e-12 and max_rel(end0 + summ64[..., 16:] @ s_in, end1) < 1e-12
    assert max_rel(summ64[..., :16], end0) < 1e-12
    tiny = torch.finfo(torch.float32).tiny
    for got in (qhat32, summ32):
        assert not ((got != 0) & (got.abs() < tiny)).any()
    scale = qhat64.abs().amax(-1)  # (1, 2, 256): each row's size
    assert scale.min() < tiny < 1e4 * tiny < scale.max()
    err = (qhat32.double() - qhat64).abs().amax(-1) / scale
    assert err[scale > 1e4 * tiny].max() < 1e-4
    assert (summ32[..., 16:].double() - summ64[..., 16:]).abs().max() <= 1e-4 * summ64[..., 16:].abs().max() + tiny


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


# ------------------------------------------------------------- context parallel (b)

# piece: tokens per piece (dense) or per piece of each document (packed); chunk: the
# scan's chunk size (64 > piece: pieces shorter than a chunk; 8 < 20: several, padded).
CASES = [
    dict(layout="zigzag", piece=8, chunk=64, dtype=torch.float64, l2=True, init=True, final=True),
    dict(layout="zigzag", piece=20, chunk=8, dtype=torch.float64, l2=False, init=False, final=True),
    dict(layout="contiguous", piece=8, chunk=64, dtype=torch.float64, l2=False, init=True, final=True),
    # No final state: contiguous rank 0 then needs no summary, yet must join the backward's exchange.
    dict(layout="contiguous", piece=20, chunk=8, dtype=torch.float64, l2=True, init=False, final=False),
    dict(layout="packed", piece=[3, 1, 5], chunk=4, dtype=torch.float64, l2=True, init=False, final=True),
    dict(layout="zigzag", piece=24, chunk=16, dtype=torch.float32, l2=True, init=True, final=True),
    dict(layout="contiguous", piece=24, chunk=16, dtype=torch.float32, l2=False, init=False, final=False),
]
SHAPE = dict(b=2, hk=2, hv=4, dk=8, dv=6)


def case_problem(i: int, world: int):
    """Full-sequence float64 inputs, initial state, output cotangent, the per-rank
    final-state cotangents, the documents' global lengths (packed) and the sharders."""
    case = CASES[i]
    doc_lens, seq = case_lengths(case["layout"], case["piece"], world)
    x, init = make_inputs(100 + i, SHAPE["b"], seq, SHAPE["hk"], SHAPE["hv"], SHAPE["dk"], SHAPE["dv"], l2=case["l2"])
    gen = torch.Generator().manual_seed(200 + i)
    go = torch.randn(SHAPE["b"], seq, SHAPE["hv"], SHAPE["dv"], generator=gen, dtype=torch.float64)
    n_docs = len(doc_lens) if doc_lens else 1
    gfs = torch.randn(world, SHAPE["b"], n_docs, SHAPE["hv"], SHAPE["dk"], SHAPE["dv"], generator=gen,
                      dtype=torch.float64)
    shard, join = sharders(case["layout"], world, doc_lens)
    return case, x, (init if case["init"] else None), go, gfs, doc_lens, shard, join


def _world_cases(rank: int, world: int) -> list[dict]:
    """Every case on this rank: the CP op's output, final state and gradients."""
    results = []
    for i in range(len(CASES)):
        case, x, init, go, gfs, doc_lens, shard, _ = case_problem(i, world)
        dt = case["dtype"]
        leaves = {n: shard(t, rank).to(dt).requires_grad_() for n, t in x.items()}
        init_leaf = init.to(dt).requires_grad_() if init is not None else None
        out, final = context_parallel_gated_delta_rule(
            *leaves.values(), layout="zigzag" if doc_lens else case["layout"],
            local_doc_lens=[n // world for n in doc_lens] if doc_lens else None, chunk_size=case["chunk"],
            initial_state=init_leaf, use_qk_l2norm_in_kernel=case["l2"], output_final_state=case["final"])
        d_final = (gfs[rank] if doc_lens else gfs[rank][:, 0]) if case["final"] else None
        results.append(backward_result(out, final, leaves, init_leaf, shard(go, rank), d_final))
    return results


def full_reference(case, x, init, go, gfs, doc_lens, dtype=torch.float64, op=None):
    """Output, final state(s) and gradients over the full sequence on one process: the
    step recurrence per document in float64, or ``op`` (the one-process scan) in ``dtype``."""
    leaves = {n: t.detach().to(dtype, copy=True).requires_grad_() for n, t in x.items()}
    init_leaf = init.detach().to(dtype, copy=True).requires_grad_() if init is not None else None
    bounds = [0, *torch.tensor(doc_lens).cumsum(0).tolist()] if doc_lens else [0, go.shape[1]]
    outs, finals = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        args = [t[:, a:b] for t in leaves.values()]
        o, f = (op or step_reference)(*args, init_leaf, case["l2"])
        outs.append(o)
        finals.append(f)
    out, final = torch.cat(outs, 1), torch.stack(finals, 1)  # final: (b, n_docs, hv, dk, dv)
    d_final = gfs.sum(0)  # every rank's final-state loss
    if not doc_lens:
        final, d_final = final[:, 0], d_final[:, 0]
    return backward_result(out, final, leaves, init_leaf, go, d_final if case["final"] else None)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_cp_matches_the_full_sequence(world):
    per_rank = run_world(world, _world_cases)  # one spawn: every case
    for i in range(len(CASES)):
        case, x, init, go, gfs, doc_lens, _, join = case_problem(i, world)
        ranks = [r[i] for r in per_rank]
        got = {"out": join([r["out"] for r in ranks]),
               "grads": {n: join([r["grads"][n] for r in ranks]) for n in NAMES},
               "final": ranks[0]["final"],
               "init_grad": sum(r["init_grad"] for r in ranks) if init is not None else None}
        if case["final"]:  # the same final state on every rank
            assert all(torch.equal(r["final"], ranks[0]["final"]) for r in ranks)
        ref = full_reference(case, x, init, go, gfs, doc_lens)
        one = None  # float64: within 1e-9 of the step recurrence; float32: no further from it
        if case["dtype"] != torch.float64:  # than one process in float32 over the full sequence
            one = errors(full_reference(case, x, init, go, gfs, doc_lens, torch.float32,
                                        lambda *a: local_gated_delta_rule(*a[:5], case["chunk"], a[5], a[6])),
                         ref, NAMES)
        bad = out_of_bounds(errors(got, ref, NAMES), one)
        assert not bad, f"case {i} {case}: {bad}"


def test_the_delta_rule_ops_take_their_options_by_name_in_one_order():
    """The gated delta rule and KDA ops once took output_final_state and use_qk_l2norm_in_kernel
    in swapped positions: a positional call meant for one silently set the other. Every
    option after the collectives is keyword-only, in the same order, for both ops and both
    public wrappers."""
    import inspect

    from hf_ring.mixers.kimi_delta import context_parallel_kimi_delta_attention, kimi_delta_op

    def options(fn, after: str) -> list[str]:
        params = list(inspect.signature(fn).parameters.values())
        rest = params[[p.name for p in params].index(after) + 1:]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in rest), (fn.__name__, rest)
        return [p.name for p in rest]

    ops = [options(fn, "coll") for fn in (gated_delta_rule_op, kimi_delta_op)]
    wrappers = [options(fn, "beta") for fn in (context_parallel_gated_delta_rule, context_parallel_kimi_delta_attention)]
    assert ops[0] == ops[1], ops
    assert sorted(wrappers[0]) == sorted(wrappers[1]), wrappers
    with pytest.raises(TypeError, match="positional"):
        gated_delta_rule_op(*(torch.zeros(1, 2, 1, 4),) * 3, torch.zeros(1, 2, 1), torch.zeros(1, 2, 1), None, "zigzag")
