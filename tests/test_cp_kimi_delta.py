"""Context-parallel Kimi delta attention (hf_ring.mixers.kimi_delta) computes what one
process computes over the full sequence: outputs, final states and the gradients of every
input (q, k, v, g, beta, initial_state), against a float64 token-by-token recurrence
written here; the one-process op also against transformers' chunk_kimi_delta_attention.

Worlds 2, 3 and 4 are gloo groups of one spawn of four processes (ranks 0-1, 0-2, all):
a spawn costs each process the import of transformers (through hf_ring), seconds on a
busy machine, and one spawn keeps this file near a minute.

Tolerances. float64 runs check the math: the chunked scan, the widened scan, and the
composition of the summaries only reassociate sums of O(1) terms, so they agree with the
step recurrence to ~1e-13; we allow 1e-9 (relative to the reference's largest entry).
float32 runs check the precision: the CP result must be no further from the float64 truth
than the one-process float32 op over the full sequence (x 4, + 1e-6), i.e. context
parallelism adds no error of its own beyond the rounding of a few more products. Against
transformers (float32, both ~1e-7 from the truth) we allow 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from closeness import max_rel
from mixer_checks import backward_result, case_lengths, errors, out_of_bounds, sharders
from distributed import run_world
from hf_ring.distributed.collectives import VirtualCollectives
from hf_ring.mixers.kimi_delta import context_parallel_kimi_delta_attention, kimi_delta_op

NAMES = ("q", "k", "v", "g", "beta")
SHAPE = dict(b=2, h=2, dk=8, dv=6)


def step_reference(q, k, v, g, beta, initial=None, l2=False):
    """Token by token in float64: S <- diag(exp g_t) S; S <- S + k_t (b_t (v_t - S^T k_t))^T;
    o_t = S^T q_t / sqrt(dk). Shapes as the op's; returns out (b, s, h, dv), final state."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    if l2:
        q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q / q.shape[-1] ** 0.5
    b, s, h, dk = q.shape
    state = q.new_zeros(b, h, dk, v.shape[-1]) if initial is None else initial.double()
    outs = []
    for t in range(s):
        state = g[:, t, :, :, None].exp() * state  # (b, h, dk, dv)
        kt = k[:, t, :, :, None]  # (b, h, dk, 1)
        delta = beta[:, t, :, None, None] * (v[:, t, :, None, :] - kt.transpose(-1, -2) @ state)
        state = state + kt * delta
        outs.append((state.transpose(-1, -2) @ q[:, t, :, :, None])[..., 0])
    return torch.stack(outs, 1), state


def make_inputs(seed, s, dtype=torch.float64, l2=False):
    """Random inputs of SHAPE; without l2-normalisation keys get unit norm scale, so the
    transitions stay contractions. Most channels decay mildly (g in (-0.15, 0)), so a state
    carries over hundreds of tokens and a missing or wrong entering state shows; two decay
    fast (g in (-8, 0)), which the naive factorisation exp(gam_i) exp(-gam_j) overflows."""
    b, h, dk, dv = SHAPE.values()
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    g = -0.15 * torch.rand(b, s, h, dk, generator=gen, dtype=torch.float64)
    g[..., :2] *= 8 / 0.15
    x = {"q": r(b, s, h, dk), "k": r(b, s, h, dk) * (1.0 if l2 else dk ** -0.5), "v": r(b, s, h, dv), "g": g,
         "beta": torch.rand(b, s, h, generator=gen, dtype=torch.float64)}
    return {n: t.to(dtype) for n, t in x.items()}, r(b, h, dk, dv).to(dtype)


def run_full(x, init, go, gf, l2, op, dtype, doc_lens=None):
    """``op`` over the full sequence (per document), float64 leaves cast to ``dtype``:
    output, final state(s) and the gradients of sum(out * go) + sum(final * gf)."""
    leaves = {n: t.detach().to(dtype, copy=True).requires_grad_() for n, t in x.items()}
    init_leaf = init.detach().to(dtype, copy=True).requires_grad_() if init is not None else None
    bounds = [0, *torch.tensor(doc_lens).cumsum(0).tolist()] if doc_lens else [0, go.shape[1]]
    runs = [op(*(t[:, a:e] for t in leaves.values()), init_leaf, l2) for a, e in zip(bounds[:-1], bounds[1:])]
    out, final = torch.cat([o for o, _ in runs], 1), torch.stack([f for _, f in runs], 1)  # (b, docs, h, dk, dv)
    return backward_result(out, final if doc_lens else final[:, 0], leaves, init_leaf, go, gf)


def local_op(chunk):
    """The one-process op (no collectives) in run_full's form."""
    return lambda q, k, v, g, beta, init, l2: kimi_delta_op(q, k, v, g, beta, None, chunk_size=chunk, initial_state=init,
                                                            output_final_state=True, use_qk_l2norm_in_kernel=l2)


# ------------------------------------------------------------------ one process


@pytest.mark.parametrize("l2", [False, True])
def test_local_op_matches_step_recurrence_and_transformers(l2):
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    x, init = make_inputs(0, 100, l2=l2)  # 100 tokens: chunks of 32 (four blocks each), the last padded
    gen = torch.Generator().manual_seed(1)
    go = torch.randn(2, 100, 2, 6, generator=gen, dtype=torch.float64)
    gf = torch.randn(2, 2, 8, 6, generator=gen, dtype=torch.float64)
    ref = run_full(x, init, go, gf, l2, step_reference, torch.float64)
    got = run_full(x, init, go, gf, l2, local_op(32), torch.float64)
    assert max(errors(got, ref, NAMES).values()) < 1e-9, errors(got, ref, NAMES)
    # transformers' own function, float32, on the same full sequence: outputs and gradients.
    hf = run_full(x, init, go, gf, l2, lambda *a: chunk_kimi_delta_attention(
        *a[:5], chunk_size=16, initial_state=a[5], output_final_state=True, use_qk_l2norm_in_kernel=a[6]),
        torch.float32)
    ours = run_full(x, init, go, gf, l2, local_op(32), torch.float32)
    assert ours["out"].dtype == ours["final"].dtype == torch.float32
    assert max(errors(ours, hf, NAMES).values()) < 1e-5, errors(ours, hf, NAMES)
    assert max_rel(hf["out"], ref["out"]) < 1e-5  # transformers agrees with the step recurrence too


def test_low_precision_inputs():
    """bfloat16 inputs: outputs in bfloat16, states computed and returned in float32."""
    x, _ = make_inputs(1, 40)
    out, final = kimi_delta_op(*x.values(), None, local_doc_lens=[13, 20, 7], chunk_size=8, output_final_state=True)
    out16, final16 = kimi_delta_op(*(t.bfloat16() for t in x.values()), None, local_doc_lens=[13, 20, 7],
                                   chunk_size=8, output_final_state=True)
    assert final16.shape == (2, 3, 2, 8, 6)
    assert out16.dtype == torch.bfloat16 and final16.dtype == torch.float32
    assert max_rel(out16, out) < 3e-2 and max_rel(final16, final) < 3e-2  # bfloat16 inputs' own rounding


def test_widened_scan_of_a_fast_decaying_run_stays_exact_without_near_subnormals():
    """256 tokens at g = -0.35: the transition falls to ~1e-39. The float32 widened scan
    holds no entry between 0 and tiny / eps (products of those are subnormal: slow on
    CPUs), and O0 + Qhat S_in, M S_in + S_ext still match the float64 scan from S_in."""
    from hf_ring.mixers.delta_rule_chunk import heads_first, scan
    from hf_ring.mixers.kimi_delta_chunk import chunk_terms, widened_scan

    x, s_in = make_inputs(3, 256, l2=True)
    x["g"] = torch.full_like(x["g"], -0.35)
    out, end = scan(chunk_terms(*heads_first(*x.values(), True), 32), s_in)
    o0, qhat, summary = widened_scan(chunk_terms(*heads_first(*(t.float() for t in x.values()), True), 32))
    floor = torch.finfo(torch.float32).tiny / torch.finfo(torch.float32).eps
    for got in (o0, qhat, summary):
        assert not ((got != 0) & (got.abs() < floor)).any()
    assert qhat.abs().amax((0, 1, 3))[-1] == 0 < qhat.abs().amax((0, 1, 3))[0]  # late rows flushed, early ones kept
    s32 = s_in.float()
    assert max_rel(o0 + qhat @ s32, out) < 1e-5 and max_rel(summary[..., 6:] @ s32 + summary[..., :6], end) < 1e-5


def test_refusals():
    x, init = make_inputs(2, 16)
    q, k, v, g, beta = x.values()
    cases = [
        (dict(layout="stripe"), None, "one-token runs"),
        (dict(layout="stripe"), VirtualCollectives(0, world=2), "one-token runs"),
        (dict(layout="contiguous", local_doc_lens=[8, 8]), VirtualCollectives(0, world=2), "packed rows are zigzag"),
        (dict(local_doc_lens=[8, 8], initial_state=init), None, "initial_state with packed rows"),
        (dict(initial_state=init[:, :1]), None, r"initial_state must be \(batch, n_v_heads, k_head_dim, v_head_dim\) "
         r"= \(2, 2, 8, 6\)"),
        (dict(local_doc_lens=[8, 7]), None, "do not make up"),
        (dict(chunk_size=0), None, "chunk_size must be a positive int"),
    ]
    for kwargs, coll, match in cases:
        with pytest.raises(ValueError, match=match):
            kimi_delta_op(q, k, v, g, beta, coll, **kwargs)
    bad = [((q, k, v, g[..., 0], beta), r"g must have q's shape \(batch, local_seq, n_heads, k_head_dim\): one log "
            r"decay per key channel; got g \(2, 16, 2\) and q \(2, 16, 2, 8\)"),
           ((q, k, v[:, :, :1], g, beta), r"v must be \(batch, local_seq, n_heads, v_head_dim\) with q's"),
           ((q, k[..., :4], v, g, beta), "q and k must both be"),
           ((q, k, v, g, beta[:, :8]), r"beta must be \(batch, local_seq, n_v_heads\) = \(2, 16, 2\)"),
           ((q, k, v, g, beta.long()), "floating-point")]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            context_parallel_kimi_delta_attention(*args)


# ------------------------------------------------------------- context parallel

# piece: tokens per piece (dense) or per piece of each document (packed); chunk: the
# scan's chunk size (64 > piece: pieces shorter than a chunk; 20 < 30: two chunks of
# blocks of 8, 8 and 4 tokens, the last chunk padded).
CASES = [
    dict(layout="zigzag", piece=8, chunk=64, dtype=torch.float64, l2=True, init=True, final=True),
    dict(layout="zigzag", piece=30, chunk=20, dtype=torch.float64, l2=False, init=False, final=True),
    dict(layout="contiguous", piece=8, chunk=64, dtype=torch.float64, l2=False, init=True, final=True),
    # No final state: contiguous rank 0 then reads no summary, yet must join the backward's exchange.
    dict(layout="contiguous", piece=20, chunk=8, dtype=torch.float64, l2=True, init=False, final=False),
    # Documents of 2 * world * (3, 1, 5) tokens: at world 2 two of them shorter than a chunk.
    dict(layout="packed", piece=[3, 1, 5], chunk=16, dtype=torch.float64, l2=True, init=False, final=True),
    dict(layout="zigzag", piece=24, chunk=16, dtype=torch.float32, l2=True, init=True, final=True),
    dict(layout="contiguous", piece=24, chunk=16, dtype=torch.float32, l2=False, init=True, final=False),
]
WORLDS = (1, 2, 3, 4)


def case_problem(i: int, world: int):
    """Full-sequence float64 inputs, initial state, output cotangent, the per-rank
    final-state cotangents (world, ...), the documents' global lengths (packed), sharders."""
    case = CASES[i]
    doc_lens, seq = case_lengths(case["layout"], case["piece"], world)
    x, init = make_inputs(100 + i, seq, l2=case["l2"])
    gen = torch.Generator().manual_seed(200 + i)
    b, h, dk, dv = SHAPE.values()
    go = torch.randn(b, seq, h, dv, generator=gen, dtype=torch.float64)
    gfs = torch.randn(world, b, *([len(doc_lens)] if doc_lens else []), h, dk, dv, generator=gen, dtype=torch.float64)
    shard, join = sharders(case["layout"], world, doc_lens)
    return case, x, (init if case["init"] else None), go, gfs, doc_lens, shard, join


def cases_on_rank(rank: int, world: int, group) -> list[dict]:
    """Every case on this rank of a group of ``world``: the op's output, final state and
    the gradients of this rank's loss (its outputs' and its final state's)."""
    results = []
    for i in range(len(CASES)):
        case, x, init, go, gfs, doc_lens, shard, _ = case_problem(i, world)
        dt = case["dtype"]
        leaves = {n: shard(t, rank).to(dt).requires_grad_() for n, t in x.items()}
        init_leaf = init.to(dt).requires_grad_() if init is not None else None
        out, final = context_parallel_kimi_delta_attention(
            *leaves.values(), chunk_size=case["chunk"], initial_state=init_leaf, output_final_state=case["final"],
            use_qk_l2norm_in_kernel=case["l2"], group=group, layout="zigzag" if doc_lens else case["layout"],
            local_doc_lens=[n // world for n in doc_lens] if doc_lens else None)
        results.append(backward_result(out, final, leaves, init_leaf, shard(go, rank),
                                       None if final is None else gfs[rank]))
    return results


def _spawned(rank: int, world: int) -> dict[int, list[dict]]:
    """Worlds 2, 3 and 4 in one spawn: groups of the first 2, 3 and 4 ranks (every rank
    creates every group, new_group's contract)."""
    groups = {w: dist.new_group(list(range(w))) if w < world else None for w in WORLDS[1:]}
    return {w: cases_on_rank(rank, w, grp) for w, grp in groups.items() if rank < w}


@pytest.fixture(scope="module")
def per_world() -> dict[int, list[list[dict]]]:
    """``per_world[world][rank][case]``; world 1 in this process (no torch.distributed)."""
    spawned = run_world(max(WORLDS), _spawned)
    return {1: [cases_on_rank(0, 1, None)], **{w: [spawned[r][w] for r in range(w)] for w in WORLDS[1:]}}


@pytest.mark.parametrize("world", WORLDS)
def test_cp_matches_the_full_sequence(per_world, world):
    for i, case in enumerate(CASES):
        case, x, init, go, gfs, doc_lens, _, join = case_problem(i, world)
        ranks = [r[i] for r in per_world[world]]
        got = {"out": join([r["out"] for r in ranks]), "final": ranks[0]["final"],
               "grads": {n: join([r["grads"][n] for r in ranks]) for n in NAMES},
               "init_grad": sum(r["init_grad"] for r in ranks) if init is not None else None}
        if case["final"]:  # the same final state on every rank
            assert all(torch.equal(r["final"], ranks[0]["final"]) for r in ranks)
        else:
            assert all(r["final"] is None for r in ranks)
        gf = gfs.sum(0) if case["final"] else None  # every rank's final-state loss
        ref = run_full(x, init, go, gf, case["l2"], step_reference, torch.float64, doc_lens)
        one = None  # float64: within 1e-9 of the step recurrence; float32: no further from it
        if case["dtype"] != torch.float64:  # than one process in float32 over the full sequence
            one = errors(run_full(x, init, go, gf, case["l2"], local_op(case["chunk"]), torch.float32, doc_lens),
                         ref, NAMES)
        bad = out_of_bounds(errors(got, ref, NAMES), one)
        assert not bad, f"world {world} case {i} {case}: {bad}"
