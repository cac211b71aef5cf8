"""``hf_ring.context_parallel_attn_func``: every pattern x feature against float64 attention
over the full sequence (tests/reference_attention.py's ``feature_attention``), forward
and gradients of q, k, v and the sinks, on spawned gloo worlds.

One spawned world runs many cases (one function looping over them) to keep the CI time
small. Inputs are float32; the outputs and gradients must be within 1e-5 (relative, in
norm) of the float64 reference: float32 accumulation over 16-32 keys of unit-variance
scores is off by ~1e-7, so 1e-5 leaves room for the merges and still fails on any
masking, scaling or gradient mistake (those are off by > 1e-2).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hf_ring
from hf_ring.patterns import PATTERNS
from distributed import run_world
from closeness import rel_err
from reference_attention import feature_attention

B, S, HQ, HK, D = 2, 16, 4, 2, 8
TOL = 1e-5


def _inputs(hk: int = HK, seq: int = S, hq: int = HQ, dv: int = D):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, seq, hq, D, generator=g)
    dout = torch.randn(B, seq, hq, dv, generator=g)
    k, v = torch.randn(B, seq, hk, D, generator=g), torch.randn(B, seq, hk, dv, generator=g)
    sinks = torch.randn(hq, generator=g)
    return q, k, v, dout, sinks


def _case_inputs(case: dict):
    return _inputs(case.get("hk", HK), case.get("seq", S), case.get("hq", HQ), case.get("dv", D))


def _mla(pattern: str, **extra) -> list[dict]:
    """Value heads narrower and wider than q/k's (multi-head latent attention: 192 / 128 in
    DeepSeek-V3), with the features and kernels that pad them."""
    return [{"pattern": pattern, "layout": "zigzag", "dv": 5, **extra},
            {"pattern": pattern, "layout": "zigzag", "dv": 12, "window": 5, "sinks": True, **extra},
            {"pattern": pattern, "layout": "stripe", "dv": 6, "softcap": 1.5, **extra},
            {"pattern": pattern, "layout": "contiguous", "dv": 4, "window": 5, "backend": "torch_cpu_flash", **extra}]


def _attend(rank: int, world: int, case: dict) -> dict:
    """This rank's shard through the op; out, lse and the local gradients (or, for a case
    with ``"refused"``, the error's type and message)."""
    if "refused" in case:
        try:
            _attend(rank, world, {k: v for k, v in case.items() if k != "refused"})
        except (ValueError, NotImplementedError) as e:
            return {"error": (type(e).__name__, str(e))}
        return {"error": None}
    q, k, v, dout, sinks = _case_inputs(case)
    layout = case["layout"]
    shard = lambda t: hf_ring.shard_sequence(t, world, rank, layout=layout)  # noqa: E731
    q, k, v = (shard(t).requires_grad_() for t in (q, k, v))
    sinks = sinks.clone().requires_grad_() if case.get("sinks") else None
    want_lse = case.get("lse", True)
    result = hf_ring.context_parallel_attn_func(
        q, k, v, pattern=case["pattern"], layout=layout, window=case.get("window"),
        softcap=case.get("softcap"), sinks=sinks, ulysses_size=case.get("ulysses_size"),
        backend=case.get("backend", "reference"), return_lse=want_lse, group=case.get("group"),
    )
    out, lse = result if want_lse else (result, None)
    out.backward(shard(dout))
    res = {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if sinks is not None:
        res["dsinks"] = sinks.grad
    return res


def _run_cases(rank: int, world: int, cases: list) -> list:
    results, states = [], {}
    for case in cases:
        if "cp" in case:  # a dp x cp grid: the pattern runs on this rank's CP subgroup
            if case["cp"] not in states:
                states[case["cp"]] = hf_ring.setup_context_parallel(case["cp"], activate=False)
            state = states[case["cp"]]
            case = {**case, "group": state.cp_group}
            results.append(_attend(state.cp_rank, state.cp_size, case))
        else:
            results.append(_attend(rank, world, case))
    return results


def _check(case: dict, per_rank: list) -> None:
    if "refused" in case:
        for r in per_rank:  # every rank raises the same error: none is left waiting in a collective
            assert r["error"] is not None and r["error"][0] == "NotImplementedError", (case, r)
            assert case["refused"] in r["error"][1], (case, r)
        return
    q, k, v, dout, sinks = _case_inputs(case)
    want = feature_attention(q, k, v, dout, window=case.get("window"), softcap=case.get("softcap"),
                             sinks=sinks if case.get("sinks") else None)
    join = lambda name, dim: hf_ring.unshard_sequence([r[name] for r in per_rank], dim=dim,  # noqa: E731
                                                      layout=case["layout"])
    for name in ("out", "dq", "dk", "dv"):
        assert rel_err(join(name, 1), want[name]) < TOL, (case, name)
    if case.get("lse", True):
        assert rel_err(join("lse", 2), want["lse"]) < TOL, (case, "lse")
    if case.get("sinks"):
        # Each rank's sinks gradient is its part (its rows / heads); the sum is the whole.
        assert rel_err(sum(r["dsinks"] for r in per_rank), want["dsinks"]) < TOL, (case, "dsinks")


def _cases(pattern: str, layouts=("zigzag", "stripe", "contiguous"), **extra) -> list[dict]:
    features = [{}, {"window": 5}, {"sinks": True}, {"softcap": 1.5}, {"window": 3, "sinks": True},
                {"window": 5, "softcap": 2.0}, {"window": 7, "softcap": 1.5, "sinks": True}]
    cases = [{"pattern": pattern, "layout": layout, **f, **extra} for layout in layouts for f in features]
    cases.append({"pattern": pattern, "layout": "zigzag", "window": 5, "backend": "torch_cpu_flash", **extra})
    return cases


WORLD2_CASES = _cases("ring") + _cases("allgather") + _cases("ulysses") + _mla("ring") + _mla("allgather") + _mla(
    "ulysses") + [
    {"pattern": "allgather", "layout": "stripe", "hk": 1, "window": 5, "softcap": 2.0, "sinks": True},
    # One K/V head over two ranks: Ulysses repeats it once, so each rank gets a copy.
    {"pattern": "ulysses", "layout": "zigzag", "hk": 1, "window": 5, "softcap": 2.0, "sinks": True},
    {"pattern": "ulysses", "layout": "stripe", "hk": 1, "lse": False},
    {"pattern": "ulysses", "layout": "zigzag", "hq": 3, "hk": 1,
     "refused": "n_heads to be a multiple of 2; use pattern='allgather' or 'ring'"},
    {"pattern": "ulysses", "layout": "zigzag", "hq": 6, "hk": 3,
     "refused": "cannot split 3 K/V heads over 2 ranks (neither divides the other); use pattern='allgather'"},
]


def test_patterns_world_2():
    results = run_world(2, _run_cases, WORLD2_CASES)
    for i, case in enumerate(WORLD2_CASES):
        _check(case, [results[r][i] for r in range(2)])


# 2 Ulysses groups of 2 ranks, the ring across them.
WORLD4_CASES = _cases("hybrid", ulysses_size=2, seq=32) + _mla("hybrid", ulysses_size=2, seq=32) + _mla(
    "ring", seq=32) + [
    {"pattern": "hybrid", "layout": "zigzag", "ulysses_size": 2, "hk": 1, "window": 9, "softcap": 2.0,
     "sinks": True, "seq": 32},
    {"pattern": "hybrid", "layout": "stripe", "ulysses_size": 4, "window": 9, "sinks": True, "seq": 32},
    {"pattern": "hybrid", "layout": "stripe", "ulysses_size": 1, "softcap": 2.0, "seq": 32},
    {"pattern": "hybrid", "layout": "zigzag", "ulysses_size": 2, "hq": 6, "hk": 3, "seq": 32,
     "refused": "cannot split 3 K/V heads over 2 ranks"},
    # dp 2 x cp 2: each pattern on the CP subgroups (ranks 0-1 and 2-3), global ranks mapped.
    *({"pattern": p, "layout": "zigzag", "cp": 2, "window": 5, "sinks": True} for p in PATTERNS[:3]),
    # Hybrid on each CP subgroup: every rank builds both subgroups' Ulysses groups and rings.
    {"pattern": "hybrid", "layout": "zigzag", "cp": 2, "ulysses_size": 2, "window": 5, "sinks": True},
    {"pattern": "hybrid", "layout": "stripe", "cp": 2, "ulysses_size": 1, "softcap": 2.0},
]


def _check_world_4(cases: list, results: list) -> None:
    for i, case in enumerate(cases):
        for ranks in ([0, 1], [2, 3]) if "cp" in case else ([0, 1, 2, 3],):
            _check(case, [results[r][i] for r in ranks])


def test_hybrid_world_4():
    _check_world_4(WORLD4_CASES, run_world(4, _run_cases, WORLD4_CASES))


UNEVEN_CASES = [WORLD4_CASES[0], WORLD4_CASES[-2]]


def _after_a_group_rank_3_is_not_in(rank: int, world: int, cases: list) -> list:
    # Ranks 0-2 have now joined one process group more than rank 3 has (as after any
    # new_group some ranks are not in): the hybrid subgroups must still be found by all.
    dist.new_group([0, 1, 2])
    return _run_cases(rank, world, cases)


def test_hybrid_after_a_group_some_ranks_are_not_in():
    _check_world_4(UNEVEN_CASES, run_world(4, _after_a_group_rank_3_is_not_in, UNEVEN_CASES))


def test_one_process_is_exact_for_every_implemented_pattern():
    auto = {"pattern": "ring", "layout": "zigzag", "softcap": 2.0, "backend": "auto"}  # auto: a softcap kernel
    for case in _cases("allgather", layouts=("zigzag",)) + [auto]:
        _check(case, [_attend(0, 1, case)])


@pytest.mark.parametrize("kwargs, error, match", [
    ({"pattern": "spiral"}, ValueError, "unknown context-parallel pattern 'spiral'"),
    ({"window": 0}, ValueError, "window must be a positive int"),
    ({"window": 4, "causal": False}, ValueError, "on top of causal attention"),
    ({"softcap": -1.0}, ValueError, "softcap must be a positive finite float"),
    ({"pattern": "hybrid"}, ValueError, "needs ulysses_size"),
    ({"ulysses_size": 2}, ValueError, "for pattern='hybrid' only"),
    ({"sinks": torch.zeros(HK)}, ValueError, r"sinks must be a float tensor of shape \(n_heads,\)"),
    ({"softcap": 2.0, "backend": "torch_cpu_flash"}, NotImplementedError,
     "'torch_cpu_flash' cannot compute logit softcapping; use backend='reference'"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    q, k, v, _, _ = _inputs()
    with pytest.raises(error, match=match):
        hf_ring.context_parallel_attn_func(q, k, v, **kwargs)


def test_a_ring_over_explicit_positions_needs_a_masked_kernel():
    from hf_ring.kernels import AttentionBackend
    from hf_ring.kernels.reference import reference_backward, reference_forward
    from hf_ring.patterns.plan import AttentionPlan

    unmasked = AttentionBackend(name="unmasked", description="no masked kernel", forward=reference_forward,
                                backward=reference_backward, devices=("cpu",), dtypes=(torch.float32,))
    positions = (torch.tensor([0, 3]), torch.tensor([1, 2]))
    with pytest.raises(NotImplementedError, match="has no masked kernel"):
        AttentionPlan(None, 0, 2, "stripe", True, 1.0, unmasked, positions=positions)
