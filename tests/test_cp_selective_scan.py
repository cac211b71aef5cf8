"""The context-parallel Mamba-1 selective scan (hf_ring.mixers.selective_scan) computes
what one process computes over the full sequence: outputs, last states and the gradients
of every input (u, delta, A, B, C, D, z, delta_bias), against a float64 token-by-token
recurrence written here (and the local op also against transformers' own
mamba_selective_scan).

Tolerances. float64 runs check the math: the chunked scan, the piece summaries and their
composition only reassociate sums and products of O(1) terms, so they agree with the step
recurrence to ~1e-14; we allow 1e-9 (relative to the reference's largest entry). float32
runs check the precision: the CP result must be no further from the float64 truth than
the one-process float32 op over the full sequence (x 4, + 1e-6), i.e. context parallelism
adds no error of its own beyond float32 rounding of a few more products. Against
transformers (float32 on both sides, a different order of the same float32 operations):
1e-5 for outputs and states, 1e-4 for gradients (sums over the sequence of products).
transformers is not compared in float64: its scan rounds u and B to float32 even then.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from closeness import max_rel
from mixer_checks import backward_result, case_lengths, errors, out_of_bounds, sharders
from distributed import run_world
from hf_ring.distributed.collectives import VirtualCollectives
from hf_ring.mixers.selective_scan import context_parallel_selective_scan, selective_scan_op

SHARDED = ("u", "delta", "B", "C", "z")  # along the sequence; A, D, delta_bias are replicated
OPTIONS = ("D", "z", "delta_bias")


def step_reference(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """Token by token in float64: h_t = exp(dt_t A) h_{t-1} + dt_t B_t u_t, y_t = C_t . h_t
    + D u_t, times silu(z_t). Shapes as the op's; returns y (b, d, s), last state (b, d, n)."""
    u, delta, A, B, C = (t.double() for t in (u, delta, A, B, C))
    dt = delta if delta_bias is None else delta + delta_bias.double()[:, None]
    dt = F.softplus(dt) if delta_softplus else dt
    h, ys = u.new_zeros(u.shape[0], *A.shape), []
    for t in range(u.shape[-1]):
        h = torch.exp(dt[:, :, t, None] * A) * h + (dt[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, -1) + (0 if D is None else D.double()[:, None] * u)
    return (y if z is None else y * F.silu(z.double())), h


def make_inputs(seed, b, d, n, s, softplus=True, dtype=torch.float64):
    """One row's inputs, Mamba-like: A = -exp(N(0, 1)) (decays from fast to slow, so a
    state carries across pieces), delta small and positive after its bias and softplus."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    delta = r(b, d, s) * 0.5 - 2.0 if softplus else 0.02 + 0.2 * torch.rand(b, d, s, generator=gen,
                                                                          dtype=torch.float64)
    x = {"u": r(b, d, s), "delta": delta, "A": -torch.exp(r(d, n)), "B": r(b, n, s), "C": r(b, n, s),
         "D": r(d), "z": r(b, d, s), "delta_bias": 0.1 * torch.rand(d, generator=gen, dtype=torch.float64)}
    return {k: t.to(dtype) for k, t in x.items()}


def _split(x, options):
    """(positional u, delta, A, B, C; keyword D, z, delta_bias as the case uses them)."""
    return [x[k] for k in ("u", "delta", "A", "B", "C")], {k: x[k] for k in OPTIONS if k in options}


# ------------------------------------------------------------------ one process


@pytest.mark.parametrize("options,softplus,chunk", [(OPTIONS, True, 16), ((), False, 64), (("z",), True, 7)])
def test_local_op_matches_step_recurrence_and_transformers(options, softplus, chunk):
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    x = make_inputs(0, 2, 6, 4, 90, softplus)  # 90: not a multiple of the chunk
    names = ["u", "delta", "A", "B", "C", *options]
    got_leaves, ref_leaves = ({k: x[k].clone().requires_grad_() for k in names} for _ in range(2))
    pos, kw = _split(got_leaves, options)
    y, last = selective_scan_op(*pos, None, **kw, delta_softplus=softplus, return_last_state=True, chunk_size=chunk)
    pos_r, kw_r = _split(ref_leaves, options)
    ref_y, ref_last = step_reference(*pos_r, **kw_r, delta_softplus=softplus)
    assert y.dtype == last.dtype == torch.float64
    assert max_rel(y, ref_y) < 1e-9 and max_rel(last, ref_last) < 1e-9
    go, gl = torch.randn_like(ref_y), torch.randn_like(ref_last)
    ((y * go).sum() + (last * gl).sum()).backward()
    ((ref_y * go).sum() + (ref_last * gl).sum()).backward()
    for k in names:
        assert max_rel(got_leaves[k].grad, ref_leaves[k].grad) < 1e-9, k
    # transformers' own function, float32, outputs and gradients.
    mine, theirs = ({k: x[k].float().requires_grad_() for k in names} for _ in range(2))
    pos, kw = _split(mine, options)
    y32, last32 = selective_scan_op(*pos, None, **kw, delta_softplus=softplus, return_last_state=True,
                                    chunk_size=chunk)
    pos_t, kw_t = _split(theirs, options)
    hf_y, hf_last = mamba_selective_scan(*pos_t, **kw_t, delta_softplus=softplus, return_last_state=True)
    assert y32.dtype == last32.dtype == torch.float32
    assert max_rel(y32, hf_y) < 1e-5 and max_rel(last32, hf_last) < 1e-5 and max_rel(hf_y, ref_y) < 1e-5
    ((y32 * go.float()).sum() + (last32 * gl.float()).sum()).backward()
    ((hf_y * go.float()).sum() + (hf_last * gl.float()).sum()).backward()
    for k in names:
        assert max_rel(mine[k].grad, theirs[k].grad) < 1e-4, k


def test_world_one_packed_rows_reset_the_state_per_document_and_dtypes():
    x = make_inputs(1, 1, 4, 3, 40)
    lens = [13, 20, 7]
    pos, kw = _split(x, OPTIONS)
    y, last = context_parallel_selective_scan(*pos, **kw, delta_softplus=True, return_last_state=True,
                                              local_doc_lens=lens, chunk_size=8)
    assert last.shape == (1, 3, 4, 3)
    start = 0
    for doc, n in enumerate(lens):
        part = {k: (t[..., start:start + n] if k in SHARDED else t) for k, t in x.items()}
        ref_y, ref_last = step_reference(*_split(part, OPTIONS)[0], **_split(part, OPTIONS)[1], delta_softplus=True)
        assert max_rel(y[..., start:start + n], ref_y) < 1e-9 and max_rel(last[:, doc], ref_last) < 1e-9
        start += n
    # bfloat16 inputs: y in bfloat16, the state accumulated and returned in float32 ...
    x16 = {k: t.bfloat16() for k, t in x.items()}
    y16, last16 = context_parallel_selective_scan(*_split(x16, OPTIONS)[0], **_split(x16, OPTIONS)[1],
                                                  delta_softplus=True, return_last_state=True, local_doc_lens=lens)
    assert y16.dtype == torch.bfloat16 and last16.dtype == torch.float32
    assert max_rel(y16, y) < 3e-2 and max_rel(last16, last) < 3e-2  # bfloat16 inputs' own rounding
    # ... and D in float32, as transformers' Mamba layers pass it: y promoted to float32, like theirs.
    y_d, _ = context_parallel_selective_scan(*_split(x16, ())[0], D=x["D"].float(), local_doc_lens=lens)
    assert y_d.dtype == torch.float32


def test_fast_decays_stay_finite_and_precise():
    """delta up to ~5 and A down to ~-50: exp(delta A) underflows float32 within a token
    or two; no inf or nan (no exp(-x) rescaling), and float32 stays close to float64."""
    x = make_inputs(2, 1, 8, 4, 96)
    x["delta"], x["A"] = x["delta"] + 6.0, x["A"] * 4
    ref = step_reference(*_split(x, OPTIONS)[0], **_split(x, OPTIONS)[1], delta_softplus=True)
    x32 = {k: t.float() for k, t in x.items()}
    got = selective_scan_op(*_split(x32, OPTIONS)[0], None, **_split(x32, OPTIONS)[1], delta_softplus=True,
                            return_last_state=True, chunk_size=32)
    assert all(torch.isfinite(t).all() for t in got)
    assert max_rel(got[0], ref[0]) < 1e-5 and max_rel(got[1], ref[1]) < 1e-5


def test_refusals():
    x = make_inputs(3, 1, 4, 3, 16)
    pos = _split(x, ())[0]
    with pytest.raises(ValueError, match="one-token runs"):
        context_parallel_selective_scan(*pos, layout="stripe")
    with pytest.raises(ValueError, match="one-token runs"):  # world 2: the same refusal
        selective_scan_op(*pos, VirtualCollectives(0, world=2), layout="stripe")
    with pytest.raises(ValueError, match="packed rows are zigzag"):
        selective_scan_op(*pos, VirtualCollectives(0, world=2), layout="contiguous", local_doc_lens=[8, 8])
    with pytest.raises(ValueError, match="do not make up"):
        context_parallel_selective_scan(*pos, local_doc_lens=[8, 7])
    u, delta, A, B, C = pos
    bad = [((u[0], delta, A, B, C), {}, r"u must be channels-first \(batch, d_inner, local_seq\)"),
           ((u, delta[..., :8], A, B, C), {}, r"delta must be \(1, 4, 16\)"),
           ((u, delta, A[:2], B, C), {}, r"A must be \(d_inner, d_state\) = \(4, d_state\)"),
           ((u, delta, A, B[:, None], C), {}, "grouped .* not supported"),
           ((u, delta, A, B, C[..., :8]), {}, r"C must be \(1, 3, 16\)"),
           ((u, delta, A, B, C), {"D": x["D"][:2]}, r"D must be \(4,\)"),
           ((u, delta, A, B, C), {"z": x["z"][..., :8]}, r"z must be \(1, 4, 16\)"),
           ((u, delta, A, B, C), {"delta_bias": x["delta_bias"][None]}, r"delta_bias must be \(4,\)"),
           ((u.long(), delta, A, B, C), {}, "must be floating-point"),
           ((u, delta, A, B, C), {"chunk_size": 0}, "chunk_size must be a positive int")]
    for args, kw, message in bad:
        with pytest.raises(ValueError, match=message):
            context_parallel_selective_scan(*args, **kw)


# ------------------------------------------------------------- context parallel

# piece: tokens per piece (dense) or per piece of each document (packed); chunk: the
# scan's chunk size (64 > piece: pieces shorter than a chunk; 8 < 20: several, padded).
CASES = [
    dict(layout="zigzag", piece=8, chunk=64, dtype=torch.float64, options=OPTIONS, softplus=True, last=True),
    dict(layout="zigzag", piece=20, chunk=8, dtype=torch.float64, options=(), softplus=False, last=True),
    dict(layout="contiguous", piece=8, chunk=64, dtype=torch.float64, options=("D",), softplus=True, last=True),
    # No last state: contiguous rank 0 then needs no other piece, yet must join the backward's exchange.
    dict(layout="contiguous", piece=20, chunk=8, dtype=torch.float64, options=("z", "delta_bias"), softplus=False,
         last=False),
    dict(layout="packed", piece=[3, 1, 5], chunk=4, dtype=torch.float64, options=OPTIONS, softplus=True, last=True),
    dict(layout="zigzag", piece=24, chunk=16, dtype=torch.float32, options=OPTIONS, softplus=True, last=True),
    dict(layout="contiguous", piece=24, chunk=16, dtype=torch.float32, options=("D", "z"), softplus=True,
         last=False),
]
SHAPE = dict(b=2, d=6, n=4)


def case_problem(i: int, world: int):
    """Full-sequence float64 inputs, output cotangent, per-rank last-state cotangents,
    the documents' global lengths (packed) and the sharders."""
    case = CASES[i]
    doc_lens, seq = case_lengths(case["layout"], case["piece"], world)
    x = make_inputs(100 + i, SHAPE["b"], SHAPE["d"], SHAPE["n"], seq, case["softplus"])
    x = {k: t for k, t in x.items() if k not in OPTIONS or k in case["options"]}
    gen = torch.Generator().manual_seed(200 + i)
    go = torch.randn(SHAPE["b"], SHAPE["d"], seq, generator=gen, dtype=torch.float64)
    gls = torch.randn(world, SHAPE["b"], len(doc_lens or [0]), SHAPE["d"], SHAPE["n"], generator=gen,
                      dtype=torch.float64)
    shard, join = sharders(case["layout"], world, doc_lens, dim=2)
    return case, x, go, gls, doc_lens, shard, join


def _world_cases(rank: int, world: int, group) -> list[dict]:
    """Every case on this rank of ``group``: the CP op's output, last state and gradients."""
    results = []
    for i in range(len(CASES)):
        case, x, go, gls, doc_lens, shard, _ = case_problem(i, world)
        leaves = {k: (shard(t, rank) if k in SHARDED else t).to(case["dtype"]).requires_grad_() for k, t in x.items()}
        pos, kw = _split(leaves, case["options"])
        y, last = context_parallel_selective_scan(
            *pos, **kw, delta_softplus=case["softplus"], return_last_state=case["last"], group=group,
            layout="zigzag" if doc_lens else case["layout"],
            local_doc_lens=[n // world for n in doc_lens] if doc_lens else None, chunk_size=case["chunk"])
        d_last = (gls[rank] if doc_lens else gls[rank][:, 0]) if case["last"] else None
        results.append(backward_result(y, last, leaves, None, shard(go, rank), d_last))
    return results


def full_reference(case, x, go, gls, doc_lens, op=None):
    """Output, last state(s) and gradients over the full sequence on one process: the step
    recurrence per document in float64, or ``op`` (the one-process op) in float32."""
    dtype = torch.float64 if op is None else torch.float32
    leaves = {k: t.detach().to(dtype, copy=True).requires_grad_() for k, t in x.items()}
    bounds = [0, *torch.tensor(doc_lens).cumsum(0).tolist()] if doc_lens else [0, go.shape[-1]]
    ys, lasts = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        pos, kw = _split({k: (t[..., a:b] if k in SHARDED else t) for k, t in leaves.items()}, case["options"])
        y, last = (op or step_reference)(*pos, **kw, delta_softplus=case["softplus"])
        ys.append(y)
        lasts.append(last)
    y, last = torch.cat(ys, -1), torch.stack(lasts, 1)  # last: (b, n_docs, d, n)
    d_last = gls.sum(0)  # every rank's last-state loss
    if not doc_lens:
        last, d_last = last[:, 0], d_last[:, 0]
    return backward_result(y, last, leaves, None, go, d_last if case["last"] else None)


def _one_process(chunk):
    return lambda *a, **kw: context_parallel_selective_scan(*a, **kw, return_last_state=True, chunk_size=chunk)


# Each CP world size's group within one spawned world of 4 (one spawn: every world, every
# case; group ranks differ from global ones). None: the default group.
GROUPS = {1: [3], 2: [2, 3], 3: [1, 2, 3], 4: None}


def _every_world(rank: int, world: int) -> dict[int, list[dict]]:
    out = {}
    for size, members in GROUPS.items():
        group = dist.new_group(members) if members is not None else None  # every rank creates every group
        if members is None or rank in members:
            out[size] = _world_cases(dist.get_rank(group), size, group)
    return out


@pytest.fixture(scope="module")
def per_world() -> dict[int, list[list[dict]]]:
    """world size -> its ranks' results (in group rank order)."""
    results = run_world(4, _every_world)
    return {size: [results[g][size] for g in (members or range(4))] for size, members in GROUPS.items()}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_cp_matches_the_full_sequence(world, per_world):
    for i in range(len(CASES)):
        case, x, go, gls, doc_lens, _, join = case_problem(i, world)
        ranks = [r[i] for r in per_world[world]]
        got = {"out": join([r["out"] for r in ranks]), "final": ranks[0]["final"], "init_grad": None,
               "grads": {k: join([r["grads"][k] for r in ranks]) if k in SHARDED else sum(r["grads"][k] for r in ranks)
                         for k in x}}
        if case["last"]:  # the same last state on every rank
            assert all(torch.equal(r["final"], ranks[0]["final"]) for r in ranks)
        ref = full_reference(case, x, go, gls, doc_lens)
        one = None  # float64: within 1e-9 of the step recurrence; float32: no further from it
        if case["dtype"] != torch.float64:  # than one process in float32 over the full sequence
            one = errors(full_reference(case, x, go, gls, doc_lens, _one_process(case["chunk"])), ref, x)
        bad = out_of_bounds(errors(got, ref, x), one)
        assert not bad, f"case {i} {case}: {bad}"
