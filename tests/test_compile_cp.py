"""``torch.compile`` of a ``ring_flash`` model under context parallelism, on a gloo world of 2.

The ring runs as one custom op per attention layer (hf_ring/hf/compiled.py); the compiled
model must compute what the uncompiled one does. Each case builds a tiny 2-layer Llama
(float32), runs one forward and backward eagerly and one compiled, on the same shard, and
checks on every rank: the compiled loss and every parameter's gradient against the eager
ones within 1e-4 relative error (the op's body is the eager code, so only the compiled
graph around it, inductor's fused RMSNorm / RoPE / MLP, may reorder float32 sums), and,
summed over the ranks, against one process running "sdpa" on the full sequence within 1e-4.

A compiled forward that silently fell back to eager Python, or to local attention, fails:
the backend records every graph it compiled, which must hold the op once per layer, and
the op's body must have run once per layer and forward (``OP_CALLS``); no tape may be left
waiting for a backward.

Cases: the ring on dense rows and on packed rows with inductor; the all-gather, Ulysses
and ``auto`` patterns and packed rows placed by length (``placement="by_length"``: some
documents whole on one rank) with aot_eager, which runs the same op and the same graph
around it without inductor's code generation (inductor is what the ring cases already
check, and each inductor compile costs ~10 s on 2 cores); the hybrid pattern (Ulysses
inside rings) on a world of 4, where it is more than the ring or Ulysses. The packed cases
run 3 steps with other document lengths each; the ring's checks that recompiles stay
bounded: the documents reach the op as a tensor (its length made dynamic by dynamo after
the first change) and the context's Python lengths never enter the graph.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import hf_ring
from closeness import grads, rel_err
from distributed import run_world
from hf_ring.sharding import shard_packed
from hf_ring.sharding.placement import SHARDED, place_by_length, shard_placed
from test_hf_attention import VOCAB, tiny_config, tiny_model

TOL = 1e-4
BATCH = 2
SEQ = 16  # 8 tokens per rank at cp 2
LAYERS = 2
# Packed rows of 32 tokens, other document lengths each step (each a multiple of 2 * cp), by world.
# By length at cp 2: a document over 16 tokens is sharded, the short ones stay whole ("by_length").
PACKED_STEPS = {2: ([8, 16, 8], [4, 12, 12, 4], [20, 12]), 4: ([8, 16, 8], [16, 8, 8], [24, 8]),
                "by_length": ([24, 4, 4], [4, 20, 4, 4], [20, 4, 4, 4])}


class Case(NamedTuple):
    pattern: str
    packed: bool
    backend: str
    placement: str = "sharded"
    world: int = 2


CASES = {
    "ring_dense": Case("ring", False, "inductor"),
    "ring_packed": Case("ring", True, "inductor"),
    "allgather_dense": Case("allgather", False, "aot_eager"),
    "allgather_packed": Case("allgather", True, "aot_eager"),
    "ulysses_dense": Case("ulysses", False, "aot_eager"),
    "ulysses_packed": Case("ulysses", True, "aot_eager"),
    "auto_dense": Case("auto", False, "aot_eager"),
    "ring_packed_by_length": Case("ring", True, "aot_eager", placement="by_length"),
    "hybrid_dense": Case("hybrid", False, "aot_eager", world=4),
    "hybrid_packed": Case("hybrid", True, "aot_eager", world=4),
}


def _inputs(packed: bool, step: int, steps: object = 2) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    if not packed:
        return {"ids": torch.randint(3, VOCAB, (BATCH, SEQ), generator=g),
                "weights": torch.randn(BATCH, SEQ, VOCAB, generator=g)}
    lens = PACKED_STEPS[steps][step]
    total = sum(lens)
    return {"ids": torch.randint(3, VOCAB, (1, total), generator=g),
            "weights": torch.randn(1, total, VOCAB, generator=g),
            "cu": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
            "positions": torch.cat([torch.arange(n) for n in lens])[None]}


class _Recorder:
    """A backend that counts the graphs it compiled and the ring ops in them."""

    def __init__(self, name: str) -> None:
        from torch._dynamo.backends.registry import lookup_backend
        self.inner, self.graphs, self.ops = lookup_backend(name), 0, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.ops += sum(n.op == "call_function" and "ring_flash_attention" in str(n.target) for n in gm.graph.nodes)
        return self.inner(gm, example_inputs)


def _step(model, batch: dict, rank: int, world: int, packed: bool, placement: str) -> dict:
    if packed:
        cu = batch["cu"]
        if placement == "by_length":
            plan = place_by_length(tuple((cu[1:] - cu[:-1]).tolist()), world)
            assert 0 < plan.owner.count(SHARDED) < len(plan.owner), plan.describe()  # some whole, some sharded
            shard = lambda x: shard_placed(x, plan, rank)  # noqa: E731
        else:
            shard = lambda x: shard_packed(x, cu, world, rank)  # noqa: E731
        longest = int((cu[1:] - cu[:-1]).max())
        extra = dict(position_ids=shard(batch["positions"]), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                     max_length_q=longest, max_length_k=longest)
    else:
        shard = lambda x: hf_ring.shard_sequence(x, world, rank)  # noqa: E731
        extra = dict(position_ids=shard(torch.arange(SEQ).expand(BATCH, -1)))
    logits = model(shard(batch["ids"]), **extra).logits
    loss = (logits * shard(batch["weights"])).sum()
    loss.backward()
    return {"loss": loss.detach(), "logits": logits.detach()}


def _case_on_rank(rank: int, world: int, state_dict: dict, case: Case) -> dict:
    pattern, packed, backend, placement = case.pattern, case.packed, case.backend, case.placement
    from hf_ring.hf.compiled import OP_CALLS
    from hf_ring.patterns.compiled import live_tapes
    torch._dynamo.reset()  # a fresh cache: no earlier case's graphs or recompile budget
    hf_ring.setup_context_parallel(world, pattern=pattern, placement=placement,
                                   ulysses_size=2 if pattern == "hybrid" else None)
    config = tiny_config("llama", num_hidden_layers=LAYERS)
    key = "by_length" if placement == "by_length" else world
    steps = len(PACKED_STEPS[key]) if packed else 1
    out = {"eager": [], "compiled": [], "graphs": [], "op_calls": []}
    eager = tiny_model(config, "ring_flash", state_dict).train()
    model = tiny_model(config, "ring_flash", state_dict).train()
    recorder = _Recorder(backend)
    compiled = torch.compile(model, backend=recorder)
    for step in range(steps):
        batch = _inputs(packed, step, key)
        for name, m, params in (("eager", eager, eager), ("compiled", compiled, model)):
            params.zero_grad(set_to_none=True)
            calls = sum(OP_CALLS.values())
            result = _step(m, batch, rank, world, packed, placement)
            result["grads"] = grads(params)
            out[name].append(result)
            if name == "compiled":
                out["op_calls"].append(sum(OP_CALLS.values()) - calls)
        out["graphs"].append(recorder.graphs)
    out["ops_in_graphs"] = recorder.ops
    out["live_tapes"] = live_tapes()
    return out


def _reference(state_dict: dict, batch: dict, packed: bool) -> dict:
    model = tiny_model(tiny_config("llama", num_hidden_layers=LAYERS), "sdpa", state_dict).train()
    if packed:
        cu = batch["cu"].tolist()
        logits = torch.cat([model(batch["ids"][:, a:b]).logits for a, b in zip(cu[:-1], cu[1:])], dim=1)
    else:
        logits = model(batch["ids"]).logits
    loss = (logits * batch["weights"]).sum()
    loss.backward()
    return {"loss": loss.detach(), "grads": grads(model)}


def _all_cases(rank: int, world: int, state_dict: dict) -> dict:
    return {name: _case_on_rank(rank, world, state_dict, case) for name, case in CASES.items() if case.world == world}


_RUN: dict = {}


def _run(world: int = 2) -> tuple[dict, list[dict]]:
    """Every case of ``world`` ranks, run once (one world of each size)."""
    if world not in _RUN:
        state_dict = tiny_model(tiny_config("llama", num_hidden_layers=LAYERS), "sdpa", seed=3).state_dict()
        _RUN[world] = (state_dict, run_world(world, _all_cases, state_dict))
    return _RUN[world]


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_equals_eager_and_one_process(case):
    packed, placement, world = CASES[case].packed, CASES[case].placement, CASES[case].world
    state_dict, ranks = _run(world)
    for rank in ranks:
        r = rank[case]
        assert r["live_tapes"] == 0, "a compiled forward left its tape behind"
        # Not a silent fallback: every forward ran the op once per layer, from compiled graphs.
        assert r["op_calls"] == [LAYERS] * len(r["compiled"]), r["op_calls"]
        assert r["ops_in_graphs"] >= LAYERS, r["ops_in_graphs"]
        for eager, compiled in zip(r["eager"], r["compiled"]):
            assert rel_err(compiled["loss"], eager["loss"]) <= TOL
            errors = {n: rel_err(g, eager["grads"][n]) for n, g in compiled["grads"].items()}
            assert set(errors) == set(eager["grads"]) and max(errors.values()) <= TOL, errors
            norm = lambda gs: torch.sqrt(sum(g.double().pow(2).sum() for g in gs.values()))  # noqa: E731
            assert rel_err(norm(compiled["grads"]), norm(eager["grads"])) <= TOL
    for step in range(len(ranks[0][case]["compiled"])):
        reference = _reference(state_dict, _inputs(packed, step, "by_length" if placement == "by_length" else world),
                               packed)
        loss = sum(r[case]["compiled"][step]["loss"] for r in ranks)
        assert rel_err(loss, reference["loss"]) <= TOL
        errors = {n: rel_err(sum(r[case]["compiled"][step]["grads"][n] for r in ranks), g)
                  for n, g in reference["grads"].items()}
        assert max(errors.values()) <= TOL, errors


def test_packed_document_lengths_recompile_a_bounded_number_of_times():
    _, ranks = _run()
    for rank in ranks:
        graphs = rank["ring_packed"]["graphs"]  # graphs compiled so far, after each step
        # The third step's lengths (two documents) compile nothing new: the documents are a tensor.
        assert graphs[2] == graphs[1], graphs
