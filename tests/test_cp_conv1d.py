"""``hf_ring.mixers.conv.context_parallel_causal_conv1d`` against a float64 causal conv written
here (a loop over the taps with left zero padding per document) on the full sequence, and
that reference against transformers' own ``causal_conv1d_fn`` (its pure-torch path).

Worlds 1 (no process group), 2, 3 and 4 (one spawned gloo world each, running every case;
the world of 4 also runs cases on subgroups of 2 and of 1), zigzag and contiguous, packed
rows, widths 1-4, pieces of 1 and 2 tokens (halos spanning up to 3 pieces on other ranks):
output and the gradients of x, weight and bias (weight and bias summed over the ranks of the
group, each rank holding its tokens' share), for a fixed output gradient; and per call one
all-gather and one reduce-scatter whose size does not change with the sequence length.

Tolerances, relative to the largest entry of the reference: float64 1e-12 (the op and the
reference sum the same <= 4 products per output and <= 2 * 40 per weight gradient in other
orders: ~1e-16 each). float32 1e-5: float32 rounding of unit-variance sums of that size is
~1e-7 (up to ~1e-6 for the weight gradient's 80 terms plus the sum over ranks), while a
wrong halo, a halo taken across a document or a lost halo gradient is off by > 1e-2 (each
case also checks that a conv without halos misses the reference by > 1e-3). bfloat16 2e-2:
the output and each rank's gradients are rounded to bf16 (2^-9 relative) once.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hf_ring
from distributed import run_world
from hf_ring.mixers.conv import context_parallel_causal_conv1d as cp_conv
from hf_ring.sharding import shard_packed

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

B, C = 2, 5
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}
MAX_ERR: dict = {}  # largest error seen per dtype and quantity (printed with -s)


def reference_conv(x, w, b, act, doc_lens):
    """Float64 causal depthwise conv: y[c, t] = b[c] + sum_j w[c, j] x[c, t - (width-1) + j]
    within each document, x (B, C, S), w (C, width), b (C,) or None -> (B, C, S)."""
    halo, outs, start = w.shape[1] - 1, [], 0
    for n in doc_lens:
        xd = F.pad(x[..., start:start + n], (halo, 0))  # zeros before the document
        y = sum(w[:, j, None] * xd[..., j:j + n] for j in range(halo + 1))
        outs.append(y if b is None else y + b[:, None])
        start += n
    y = torch.cat(outs, dim=-1)
    return y * torch.sigmoid(y) if act else y


def _cases(world: int) -> list[dict]:
    cases = []
    for layout in ("zigzag", "contiguous"):
        for width in (1, 2, 3, 4):
            for piece in (1, 2, 5):
                i = len(cases)
                cases.append({"layout": layout, "width": width, "piece": piece, "dtype": torch.float64,
                              "bias": i % 2 == 0, "act": "silu" if i % 3 else None})
        cases.append({"layout": layout, "width": 4, "piece": 1, "dtype": torch.float32, "bias": True, "act": "silu"})
        cases.append({"layout": layout, "width": 3, "piece": 5, "dtype": torch.float32, "bias": False, "act": None})
    for width in (2, 3, 4):  # packed rows: documents of 3, 1 and 2 tokens per piece
        cases.append({"layout": "zigzag", "width": width, "docs": (3, 1, 2), "dtype": torch.float64,
                      "bias": True, "act": "swish" if width == 3 else None})
    cases.append({"layout": "zigzag", "width": 4, "docs": (1, 2, 1), "dtype": torch.float32,
                  "bias": True, "act": "silu"})
    cases.append({"layout": "zigzag", "width": 4, "piece": 3, "dtype": torch.bfloat16, "bias": True, "act": "silu"})
    if world == 4:  # two CP groups of 2 and four of 1 inside the world
        cases += [{"layout": "zigzag", "width": 4, "piece": 1, "dtype": torch.float64, "bias": True, "act": None,
                   "cp": 2},
                  {"layout": "contiguous", "width": 3, "piece": 4, "dtype": torch.float64,
                   "bias": True, "act": "silu", "cp": 1}]
    return cases


def _refused(world: int) -> list[tuple[dict, str]]:
    base = {"width": 3, "dtype": torch.float64, "bias": False, "act": None}
    return [({**base, "layout": "stripe", "piece": 2}, "one-token runs.*use layout 'zigzag' or 'contiguous'"),
            ({**base, "layout": "contiguous", "docs": (2, 2)}, "packed rows are zigzag-sharded"),
            ({**base, "layout": "zigzag", "piece": 2, "local_doc_lens": [2, 3]}, "do not make up")]


def _geometry(case: dict, n: int):
    """(global doc lengths, local doc lengths or None) of a case at CP size n."""
    chunks = 2 * n if case["layout"] == "zigzag" else n
    if case.get("docs"):
        return [chunks * p for p in case["docs"]], [chunks * p // n for p in case["docs"]]
    return [chunks * case["piece"]], case.get("local_doc_lens")


def _inputs(case: dict, n: int):
    """Full-sequence x (B, C, S), w (C, width), b (C,) or None, dy (B, C, S), in the case's dtype."""
    seq = sum(_geometry(case, n)[0])
    g = torch.Generator().manual_seed(3)
    x, dy = (torch.randn(B, C, seq, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(C, case["width"], generator=g, dtype=torch.float64)
    b = torch.randn(C, generator=g, dtype=torch.float64) if case["bias"] else None
    return tuple(None if t is None else t.to(case["dtype"]) for t in (x, w, b, dy))


def _shard(t: torch.Tensor, case: dict, n: int, rank: int) -> torch.Tensor:
    doc_lens, local = _geometry(case, n)
    if case.get("docs"):
        return shard_packed(t, torch.tensor([0, *torch.tensor(doc_lens).cumsum(0).tolist()]), n, rank, dim=-1)
    return hf_ring.shard_sequence(t, n, rank, dim=-1, layout=case["layout"])


def _rank_case(rank: int, n: int, case: dict, group=None) -> dict:
    """This rank's output and gradients for the case (n: the CP group's size)."""
    x, w, b, dy = _inputs(case, n)
    x = _shard(x, case, n, rank).requires_grad_()
    w.requires_grad_()
    if b is not None:
        b.requires_grad_()
    y = cp_conv(x, w, b, activation=case["act"], group=group, layout=case["layout"],
                local_doc_lens=_geometry(case, n)[1])
    y.backward(_shard(dy, case, n, rank))
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "db": None if b is None else b.grad}


def _run_cases(rank: int, world: int, cases: list, refused: list) -> tuple[list, list]:
    groups = {}
    if dist.is_initialized():  # every rank creates every subgroup, in the same order
        for cp in sorted({c["cp"] for c in cases if "cp" in c}):
            groups[cp] = [dist.new_group(list(range(s, s + cp))) for s in range(0, world, cp)]
    results = []
    for case in cases:
        if "cp" in case:
            cp = case["cp"]
            results.append(_rank_case(rank % cp, cp, case, groups[cp][rank // cp]))
        else:
            results.append(_rank_case(rank, world, case))
    errors = []
    if dist.is_initialized():
        errors.append(_traffic(rank, world))
    for case, _ in refused:
        try:
            _rank_case(rank, world, case)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return results, errors


def _traffic(rank: int, world: int) -> list:
    """The collectives one forward + backward calls, with the elements each rank puts in,
    at two sequence lengths (8x apart)."""
    from hf_ring.distributed.collectives import GroupCollectives
    calls, saved = [], (GroupCollectives.all_gather, GroupCollectives.reduce_scatter)
    GroupCollectives.all_gather = lambda self, t: calls.append(("all_gather", t.numel())) or saved[0](self, t)
    GroupCollectives.reduce_scatter = lambda self, t: calls.append(("reduce_scatter", t.numel())) or saved[1](self, t)
    try:
        per_len = []
        for piece in (2, 16):
            calls.clear()
            _rank_case(rank, world, {"layout": "zigzag", "width": 4, "piece": piece, "dtype": torch.float32,
                                     "bias": True, "act": "silu"})
            per_len.append(list(calls))
        return per_len
    finally:
        GroupCollectives.all_gather, GroupCollectives.reduce_scatter = saved


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _check(case: dict, per_rank: list, n: int) -> None:
    """Compare the ranks of one CP group of size n (in group rank order) with the reference."""
    x, w, b, dy = (None if t is None else t.double().requires_grad_() for t in _inputs(case, n))
    doc_lens, local = _geometry(case, n)
    want = reference_conv(x, w, b, case["act"], doc_lens)
    want.backward(dy)
    errs = {"y": max(_err(r["y"], _shard(want.detach(), case, n, i)) for i, r in enumerate(per_rank)),
            "dx": max(_err(r["dx"], _shard(x.grad, case, n, i)) for i, r in enumerate(per_rank)),
            "dw": _err(sum(r["dw"].double() for r in per_rank), w.grad)}
    if b is not None:
        errs["db"] = _err(sum(r["db"].double() for r in per_rank), b.grad)
    for r in per_rank:
        assert r["y"].dtype == r["dx"].dtype == r["dw"].dtype == case["dtype"], case
    for k, e in errs.items():
        MAX_ERR[(str(case["dtype"]), k)] = max(MAX_ERR.get((str(case["dtype"]), k), 0.0), e)
        assert e < TOL[case["dtype"]], (case, n, k, e)
    if case["width"] > 1 and n > 1:  # the case needs its halos: without them it is far off
        naive = [cp_conv(_shard(x.detach(), case, n, i), w.detach(), None if b is None else b.detach(),
                         activation=case["act"], layout="contiguous") for i in range(n)]
        assert max(_err(y, _shard(want.detach(), case, n, i)) for i, y in enumerate(naive)) > 1e-3, case


def _check_world(world: int, out: list) -> None:
    cases, refused = _cases(world), _refused(world)
    for i, case in enumerate(cases):
        cp = case.get("cp", world)
        for start in range(0, world, cp):
            _check(case, [out[r][0][i] for r in range(start, start + cp)], cp)
    for r in range(world):
        errors = out[r][1]
        if world > 1:  # one all-gather of 2 pieces' tails (batch, channels, 3) and its reduce-scatter back
            tails = 2 * B * C * 3
            assert errors[0] == [[("all_gather", tails), ("reduce_scatter", world * tails)]] * 2, errors[0]
            errors = errors[1:]
        for j, (_, pattern) in enumerate(refused):
            assert errors[j] is not None and re.search(pattern, errors[j]), (j, errors[j])
    print(f"world {world}: largest relative errors {MAX_ERR}")


def test_world_of_one_without_process_group():
    _check_world(1, [_run_cases(0, 1, _cases(1), _refused(1))])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_spawned_worlds(world):
    _check_world(world, run_world(world, _run_cases, _cases(world), _refused(world)))


@pytest.mark.parametrize("model", ["mamba2", "qwen3_next"])
def test_reference_and_op_are_transformers_causal_conv1d_fn(model):
    """The semantics pinned to what the models run: transformers' causal_conv1d_fn (its pure
    torch path, unwrapped from the kernel-hub decorator), forward and gradients."""
    module = __import__(f"transformers.models.{model}.modeling_{model}", fromlist=["causal_conv1d_fn"])
    hf_fn = inspect.unwrap(module.causal_conv1d_fn)
    for width in (1, 2, 3, 4):
        for act in (None, "silu"):
            for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
                g = torch.Generator().manual_seed(width)
                x, dy = (torch.randn(B, C, 9, generator=g, dtype=dtype) for _ in range(2))
                w, b = torch.randn(C, width, generator=g, dtype=dtype), torch.randn(C, generator=g, dtype=dtype)
                got = []
                for fn in (hf_fn, lambda *a, **k: cp_conv(*a, **k, layout="contiguous")):
                    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
                    y = fn(*leaves, activation=act)
                    y.backward(dy)
                    got.append([y.detach()] + [t.grad for t in leaves])
                for name, theirs, ours in zip(("y", "dx", "dw", "db"), *got):
                    assert _err(ours, theirs.double()) < tol, (model, width, act, dtype, name)
                if dtype == torch.float64:
                    ref = reference_conv(x, w, b, act, [x.shape[-1]])
                    assert _err(got[0][0], ref) < 1e-12


def test_bad_arguments_raise_value_error():
    x, w, b = torch.randn(B, C, 8), torch.randn(C, 4), torch.randn(C)
    bad = [
        (dict(x=torch.randn(B, 8)), r"\(batch, channels, local_seq\).*transpose\(1, 2\)"),
        (dict(x=torch.ones(B, C, 8, dtype=torch.int64)), "floating tensor"),
        (dict(x=torch.randn(B, C, 0)), "no tokens"),
        (dict(w=torch.randn(C, 1, 4)), r"squeeze\(1\)"),
        (dict(w=torch.randn(C + 1, 4)), r"weight must be \(channels, width\)"),
        (dict(w=torch.randn(C, 0)), "width >= 1"),
        (dict(b=torch.randn(C + 1)), "bias must be None or"),
        (dict(activation="gelu"), "activation must be one of.*exactly"),
        (dict(layout="stripe"), "one-token runs.*use layout 'zigzag' or 'contiguous'"),
        (dict(layout="diagonal"), "unknown context-parallel layout"),
        (dict(local_doc_lens=[3, 3]), "do not make up"),
        (dict(local_doc_lens=[4, 4], layout="contiguous"), "packed rows are zigzag-sharded"),
        (dict(local_doc_lens=[4.0, 4.0]), "sequence of ints"),
        (dict(local_doc_lens=torch.tensor([4.0, 4.0])), "integer tensor"),
    ]
    for change, pattern in bad:
        args = {"x": x, "w": w, "b": b, "activation": None, "layout": "zigzag", "local_doc_lens": None, **change}
        with pytest.raises(ValueError, match=pattern):
            cp_conv(args["x"], args["w"], args["b"], activation=args["activation"], layout=args["layout"],
                    local_doc_lens=args["local_doc_lens"])
    # a packed row given as a tensor of lengths is read as ints: the documents stay apart
    y = cp_conv(x, w, b, local_doc_lens=torch.tensor([3, 5]))
    assert torch.allclose(y.double(), reference_conv(x.double(), w.double(), b.double(), None, [3, 5]), atol=1e-5)


def test_mixers_import_no_higher_layer():
    """The layer rule of DESIGN.md, read from the sources: no transformers, accelerate, or
    hf_ring's hf, memory, training or wrap layers."""
    import ast
    import pathlib

    import hf_ring.mixers

    forbidden = ("transformers", "accelerate", "hf_ring.hf", "hf_ring.memory", "hf_ring.training", "hf_ring.wrap")
    folder = pathlib.Path(hf_ring.mixers.__file__).parent
    assert "must not import" in hf_ring.mixers.__doc__
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not any(name == f or name.startswith(f + ".") for f in forbidden), (path.name, name)
