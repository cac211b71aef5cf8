"""The context-parallel Mamba-2 SSD chunk scan (hf_ring.mixers.ssd) computes what one process
computes over the full sequence: outputs, final states and the gradients of every input
(x, dt, A, B, C, D, dt_bias, initial_states), against a float64 token-by-token recurrence
written here (and the one-process op also against transformers' own mamba2_chunk_scan).

Tolerances. float64 runs check the math: the chunked scan, the pieces' summaries and their
composition only reassociate sums of O(1) terms (decays <= 1), so they agree with the step
recurrence to ~1e-14; we allow 1e-9 (relative to the reference's largest entry). float32
runs check the precision: the CP result must be no further from the float64 truth than the
one-process float32 scan over the full sequence (x 4, + 1e-6), i.e. context parallelism adds
no error of its own beyond float32 rounding of a few more products. transformers computes
in float32 whatever the inputs: against it, 1e-5 (outputs, states) and 1e-4 (gradients).
"""

from __future__ import annotations

import pytest
import torch

from closeness import max_rel
from distributed import run_world
from mixer_checks import backward_result, case_lengths, errors, out_of_bounds, sharders
from hf_ring.distributed.collectives import VirtualCollectives
from hf_ring.mixers.ssd import context_parallel_ssd, ssd_op

NAMES = ("x", "dt", "A", "B", "C", "D", "dt_bias")
SHARDED = ("x", "dt", "B", "C")  # along the sequence; A, D, dt_bias are per head (each rank: its part)


def step_reference(x, dt, A, B, C, D=None, dt_bias=None, softplus=False, limit=(0.0, float("inf")), init=None):
    """Token by token in float64: dt' = clamp(softplus?(dt + dt_bias), limit),
    S_t = exp(dt'_t A) S_{t-1} + dt'_t x_t B_t^T, y_t = S_t C_t + D x_t (per head; head i reads
    group i // (h / g)). Shapes as the op's; returns y (b, s, h, p), the final state (b, h, p, n)."""
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    dt = dt + dt_bias.double() if dt_bias is not None else dt
    dt = torch.clamp(torch.nn.functional.softplus(dt) if softplus else dt, *limit)
    rep = x.shape[2] // B.shape[2]
    B, C = B.repeat_interleave(rep, 2), C.repeat_interleave(rep, 2)
    b, s, h, p = x.shape
    state = x.new_zeros(b, h, p, B.shape[-1]) if init is None else init.double()
    ys = []
    for t in range(s):
        decay = torch.exp(dt[:, t] * A)[..., None, None]  # (b, h, 1, 1)
        state = decay * state + dt[:, t, :, None, None] * x[:, t, :, :, None] * B[:, t, :, None, :]
        y = (state @ C[:, t, :, :, None])[..., 0]
        ys.append(y if D is None else y + D.double()[:, None] * x[:, t])
    return torch.stack(ys, 1), state


def make_inputs(seed, b, s, h, p, g, n, softplus, dtype=torch.float64):
    """Random inputs of one row: mild decays (dt A ~ -0.03 a token), so a state carries over
    tens of tokens and a missing or wrong entering state shows. Raw dt straddles the default
    dt_limit's 0 without softplus (a few steps clamped), sits around softplus(-2.5) with it."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    u = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    dt = 0.5 * r(b, s, h) - 2.5 if softplus else 0.25 * u(b, s, h) - 0.03
    x = {"x": r(b, s, h, p), "dt": dt, "A": -(0.05 + 0.45 * u(h)), "B": r(b, s, g, n), "C": r(b, s, g, n),
         "D": r(h), "dt_bias": 0.05 * r(h)}
    return {k: t.to(dtype) for k, t in x.items()}, r(b, h, p, n).to(dtype)


def _kwargs(case, x):
    return dict(D=x["D"] if case["D"] else None, dt_bias=x["dt_bias"] if case["bias"] else None,
                dt_softplus=case["softplus"], dt_limit=case["limit"])


# ------------------------------------------------------------------ one process (a)

LOCAL = dict(D=True, bias=True, softplus=True, limit=(0.02, 0.2))


@pytest.mark.parametrize("with_init", [False, True])
def test_local_op_matches_step_recurrence_and_transformers(with_init):
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    x, init = make_inputs(0, 2, 70, 4, 3, 2, 5, softplus=True)  # 70: not a multiple of the chunk (16)
    init = init if with_init else None

    def run(op, dtype, **kw):
        leaves = {k: t.to(dtype, copy=True).requires_grad_() for k, t in x.items()}
        i = init.to(dtype, copy=True).requires_grad_() if with_init else None
        y, final = op(*(leaves[k] for k in "x dt A B C".split()), **_kwargs(LOCAL, leaves), initial_states=i,
                      return_final_states=True, **kw)
        gen = torch.Generator().manual_seed(9)
        ((y * torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.dtype)).sum()
         + (final * torch.randn(final.shape, generator=gen, dtype=torch.float64).to(y.dtype)).sum()).backward()
        return y, final, {**{k: t.grad for k, t in leaves.items()}, **({"init": i.grad} if with_init else {})}

    def ref(*a, D, dt_bias, dt_softplus, dt_limit, initial_states, return_final_states):
        return step_reference(*a, D, dt_bias, dt_softplus, dt_limit, initial_states)

    y_ref, f_ref, g_ref = run(ref, torch.float64)
    y, f, g = run(context_parallel_ssd, torch.float64, chunk_size=16)
    assert y.dtype == f.dtype == torch.float64 and f.shape == (2, 4, 3, 5)
    assert max_rel(y, y_ref) < 1e-9 and max_rel(f, f_ref) < 1e-9
    assert all(max_rel(g[k], g_ref[k]) < 1e-9 for k in g_ref), {k: max_rel(g[k], g_ref[k]) for k in g_ref}
    # transformers' own function, float32 (it computes in float32 whatever the inputs).
    y_hf, f_hf, g_hf = run(mamba2_chunk_scan, torch.float32, chunk_size=16)
    y32, f32, g32 = run(context_parallel_ssd, torch.float32, chunk_size=16)
    assert y32.dtype == f32.dtype == torch.float32
    assert max_rel(y32, y_hf) < 1e-5 and max_rel(f32, f_hf) < 1e-5
    assert all(max_rel(g32[k], g_hf[k]) < 1e-4 for k in g_hf), {k: max_rel(g32[k], g_hf[k]) for k in g_hf}
    assert max_rel(y_hf, y_ref) < 1e-4  # transformers agrees with the step recurrence too


def test_world_one_packed_rows_reset_the_state_per_document_and_any_chunk_size_agrees():
    x, _ = make_inputs(1, 1, 40, 4, 3, 1, 4, softplus=False)
    lens = [13, 20, 7]
    args = [x[k] for k in "x dt A B C".split()]
    y, final = context_parallel_ssd(*args, D=x["D"], local_doc_lens=lens, chunk_size=8, return_final_states=True)
    assert final.shape == (1, 3, 4, 3, 4)
    start = 0
    for d, n in enumerate(lens):
        y_ref, f_ref = step_reference(*(t if t.dim() == 1 else t[:, start:start + n] for t in args), x["D"])
        assert max_rel(y[:, start:start + n], y_ref) < 1e-9 and max_rel(final[:, d], f_ref) < 1e-9
        start += n
    for chunk in (1, 5, 256):
        assert max_rel(context_parallel_ssd(*args, D=x["D"], local_doc_lens=lens, chunk_size=chunk)[0], y) < 1e-12
    # bfloat16 inputs: outputs and states accumulated and returned in float32.
    y16, f16 = context_parallel_ssd(*(t.bfloat16() for t in args), D=x["D"], local_doc_lens=lens, chunk_size=8,
                                    return_final_states=True)
    assert y16.dtype == f16.dtype == torch.float32
    assert max_rel(y16, y) < 3e-2 and max_rel(f16, final) < 3e-2  # bfloat16 inputs' own rounding


def test_refusals_and_bad_shapes():
    x, init = make_inputs(2, 1, 16, 4, 3, 2, 5, softplus=False)
    a = [x[k] for k in "x dt A B C".split()]
    with pytest.raises(ValueError, match="one-token runs"):
        context_parallel_ssd(*a, layout="stripe")
    with pytest.raises(ValueError, match="one-token runs"):  # world 2: the same refusal
        ssd_op(*a, VirtualCollectives(0, world=2), layout="stripe")
    with pytest.raises(ValueError, match="packed rows are zigzag"):
        ssd_op(*a, VirtualCollectives(0, world=2), layout="contiguous", local_doc_lens=[8, 8])
    with pytest.raises(ValueError, match="initial_states with packed rows"):
        context_parallel_ssd(*a, local_doc_lens=[8, 8], initial_states=init)
    with pytest.raises(ValueError, match=r"initial_states must be \(batch, n_heads, head_dim, state_size\)"):
        context_parallel_ssd(*a, initial_states=init[:, :1])
    with pytest.raises(ValueError, match=r"x must be \(batch, local_seq, n_heads, head_dim\)"):
        context_parallel_ssd(a[0][0], *a[1:])
    with pytest.raises(ValueError, match=r"dt must be \(batch, local_seq, n_heads\)"):
        context_parallel_ssd(a[0], a[1][:, :8], *a[2:])
    with pytest.raises(ValueError, match=r"A must be \(n_heads,\)"):
        context_parallel_ssd(*a[:2], a[2][:2], *a[3:])
    with pytest.raises(ValueError, match=r"D must be \(n_heads,\)"):
        context_parallel_ssd(*a, D=x["D"][None])
    with pytest.raises(ValueError, match=r"dt_bias must be \(n_heads,\)"):
        context_parallel_ssd(*a, dt_bias=x["dt_bias"][:3])
    with pytest.raises(ValueError, match="a divisor of 4"):  # 3 groups for 4 heads
        context_parallel_ssd(*a[:3], a[3][:, :, :1].expand(-1, -1, 3, -1), a[4])
    with pytest.raises(ValueError, match="C must be shaped like B"):
        context_parallel_ssd(*a[:4], a[4][..., :2])
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        context_parallel_ssd(*a, chunk_size=0)
    with pytest.raises(ValueError, match="dt_limit must be"):
        context_parallel_ssd(*a, dt_limit=(0.5, 0.1))
    with pytest.raises(ValueError, match="do not make up"):
        context_parallel_ssd(*a, local_doc_lens=[8, 7])


# ------------------------------------------------------------- context parallel (b)

# piece: tokens per piece (dense) or per piece of each document (packed); chunk: the scan's
# chunk size (16 > 8: pieces shorter than a chunk; 8 < 20: several chunks, the last padded).
_ALL = dict(D=True, bias=True, softplus=True, limit=(0.0, float("inf")))
_NONE = dict(D=False, bias=False, softplus=False, limit=(0.0, float("inf")))
CASES = [
    dict(layout="zigzag", piece=8, chunk=16, dtype=torch.float64, g=2, init=True, final=True, **_ALL),
    dict(layout="zigzag", piece=20, chunk=8, dtype=torch.float64, g=1, init=False, final=True,
         **{**_NONE, "limit": (0.03, 0.15)}),
    dict(layout="contiguous", piece=8, chunk=16, dtype=torch.float64, g=4, init=True, final=True,
         **{**_NONE, "D": True}),
    # No final state: contiguous rank 0 then needs no entering state, yet must join the backward's exchange.
    dict(layout="contiguous", piece=20, chunk=8, dtype=torch.float64, g=2, init=False, final=False,
         **{**_ALL, "D": False}),
    dict(layout="packed", piece=[3, 1, 5], chunk=4, dtype=torch.float64, g=2, init=False, final=True, **_ALL),
    dict(layout="zigzag", piece=24, chunk=16, dtype=torch.float32, g=2, init=True, final=True,
         **{**_ALL, "limit": (0.01, 0.3)}),
    dict(layout="contiguous", piece=24, chunk=16, dtype=torch.float32, g=1, init=False, final=False,
         **{**_NONE, "D": True}),
]
SHAPE = dict(b=2, h=4, p=3, n=5)


def case_problem(i: int, world: int):
    """Full-sequence float64 inputs, initial state, output cotangent, the per-rank
    final-state cotangents, the documents' global lengths (packed) and the sharders."""
    case = CASES[i]
    doc_lens, seq = case_lengths(case["layout"], case["piece"], world)
    b, h, p, n = SHAPE.values()
    x, init = make_inputs(100 + i, b, seq, h, p, case["g"], n, case["softplus"])
    gen = torch.Generator().manual_seed(200 + i)
    go = torch.randn(b, seq, h, p, generator=gen, dtype=torch.float64)
    gfs = torch.randn(world, b, len(doc_lens) if doc_lens else 1, h, p, n, generator=gen, dtype=torch.float64)
    shard, join = sharders(case["layout"], world, doc_lens)
    return case, x, (init if case["init"] else None), go, gfs, doc_lens, shard, join


def _world_cases(rank: int, world: int) -> list[dict]:
    """Every case on this rank: the CP op's output, final state and gradients."""
    results = []
    for i in range(len(CASES)):
        case, x, init, go, gfs, doc_lens, shard, _ = case_problem(i, world)
        dt = case["dtype"]
        leaves = {k: (shard(t, rank) if k in SHARDED else t).to(dt, copy=True).requires_grad_() for k, t in x.items()}
        init_leaf = init.to(dt).requires_grad_() if init is not None else None

        def call():
            return context_parallel_ssd(
                *(leaves[k] for k in "x dt A B C".split()), chunk_size=case["chunk"], **_kwargs(case, leaves),
                initial_states=init_leaf, return_final_states=case["final"],
                layout="zigzag" if doc_lens else case["layout"],
                local_doc_lens=[n // world for n in doc_lens] if doc_lens else None)

        with torch.no_grad():  # inference: the same exchange, no backward to join
            y_inference = call()[0]
        y, final = call()
        d_final = (gfs[rank] if doc_lens else gfs[rank][:, 0]) if case["final"] else None
        results.append(backward_result(y, final, leaves, init_leaf, shard(go, rank), d_final))
        results[-1]["same_without_grad"] = torch.equal(y_inference, results[-1]["out"])
    return results


def full_reference(case, x, init, go, gfs, doc_lens, dtype=torch.float64, op=step_reference):
    """Output, final state(s) and gradients over the full sequence on one process, per
    document: the step recurrence in float64, or ``op`` (the one-process scan) in ``dtype``."""
    leaves = {k: t.detach().to(dtype, copy=True).requires_grad_() for k, t in x.items()}
    init_leaf = init.detach().to(dtype, copy=True).requires_grad_() if init is not None else None
    kw = _kwargs(case, leaves)
    bounds = [0, *torch.tensor(doc_lens).cumsum(0).tolist()] if doc_lens else [0, go.shape[1]]
    outs, finals = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        y, f = op(*(leaves[k][:, a:b] for k in "x dt".split()), leaves["A"],
                  *(leaves[k][:, a:b] for k in "B C".split()), kw["D"], kw["dt_bias"], kw["dt_softplus"],
                  kw["dt_limit"], init_leaf)
        outs.append(y)
        finals.append(f)
    out, final = torch.cat(outs, 1), torch.stack(finals, 1)  # final: (b, n_docs, h, p, n)
    final, d_final = (final, gfs.sum(0)) if doc_lens else (final[:, 0], gfs.sum(0)[:, 0])
    return backward_result(out, final, leaves, init_leaf, go, d_final if case["final"] else None)


def _one_process(case):
    """The one-process op in float32, called as :func:`step_reference` is."""
    def op(x, dt, A, B, C, D, dt_bias, softplus, limit, init):
        return context_parallel_ssd(x, dt, A, B, C, chunk_size=case["chunk"], D=D, dt_bias=dt_bias,
                                    dt_softplus=softplus, dt_limit=limit, initial_states=init,
                                    return_final_states=True)
    return op


def _used(case) -> list[str]:
    return [k for k in NAMES if (k != "D" or case["D"]) and (k != "dt_bias" or case["bias"])]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_cp_matches_the_full_sequence(world):
    per_rank = run_world(world, _world_cases)  # one spawn: every case
    for i in range(len(CASES)):
        case, x, init, go, gfs, doc_lens, _, join = case_problem(i, world)
        ranks = [r[i] for r in per_rank]
        grads = {k: join([r["grads"][k] for r in ranks]) if k in SHARDED else sum(r["grads"][k] for r in ranks)
                 for k in NAMES if ranks[0]["grads"][k] is not None}
        got = {"out": join([r["out"] for r in ranks]), "grads": grads, "final": ranks[0]["final"],
               "init_grad": sum(r["init_grad"] for r in ranks) if init is not None else None}
        assert all(r["same_without_grad"] for r in ranks)
        if case["final"]:  # the same final state on every rank
            assert all(torch.equal(r["final"], ranks[0]["final"]) for r in ranks)
        if init is not None:  # applied by rank 0 (the row's first piece) only: zeros elsewhere
            assert all(not r["init_grad"].any() for r in ranks[1:])
        ref = full_reference(case, x, init, go, gfs, doc_lens)
        errs = errors(got, ref, _used(case))
        one = None  # float32: no further from the float64 truth than one process over the full sequence
        if case["dtype"] == torch.float32:
            one = errors(full_reference(case, x, init, go, gfs, doc_lens, torch.float32, _one_process(case)), ref,
                         _used(case))
        bad = out_of_bounds(errs, one)
        assert not bad, f"case {i} {case}: {bad}"
