"""``torch.compile`` of hybrid models under context parallelism: each routed token-mixer layer
one custom op (hf_ring/hf/mixers/compiled.py), on a gloo world of 2.

One family per kind of mixer: Qwen3-Next (gated delta rule and its short convolution),
LFM2 (short convolution), GraniteMoeHybrid (Mamba-2 scan), Kimi Linear (Kimi delta
attention); the sweep's tiny configs (one layer of each type), float32, training mode with
the families' own dropout defaults. Each runs one forward and backward eagerly and one
compiled (aot_eager: the graph around the ops as inductor would get it, without code
generation) on a packed row of three documents at cp 2, and checks on every rank the
compiled loss and every parameter's gradient against the eager ones within 1e-5 relative
(the op's body is the eager layer; only the graph around it may reorder float32 sums), and,
summed over the ranks, against one process running each document alone within 1e-4 (the
hybrid suites' tolerance: the ring and the CP scans merge float32 partial sums in another
order). Qwen3-Next also on dense rows.

A compiled forward that fell back to eager Python fails: every graph the backend compiled
is searched for the mixer op, which must appear once per routed layer, and no tape may be
left waiting for a backward. The models whose Mamba blocks run without keyword arguments
(their carriers: Mamba, FalconMamba, Jamba) are refused by name instead
(tests/test_compile_refusals.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import hf_ring  # noqa: E402
from closeness import grads, rel_err  # noqa: E402
from distributed import run_world  # noqa: E402
from hf_ring.patches.transformers import release_line  # noqa: E402
from hf_ring.sharding import shard_packed  # noqa: E402
from test_hf_attention import tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(release_line(__import__("transformers").__version__) != "5",
                                reason="token mixers are routed on transformers 5.x only")

EAGER_TOL, REFERENCE_TOL = 1e-5, 1e-4
FAMILIES = ("qwen3_next", "lfm2", "granitemoehybrid", "kimi_linear")
DOCS = [8, 16, 8]  # a packed row of 32 tokens, each document a multiple of 2 x cp
ROWS, SEQ = 2, 16  # dense rows


def _config(family: str):
    from model_sweep_configs import build_config

    return build_config(family)


def _batch(config, packed: bool) -> dict:
    g = torch.Generator().manual_seed(7)
    shape = (1, sum(DOCS)) if packed else (ROWS, SEQ)
    return {"ids": torch.randint(3, config.vocab_size, shape, generator=g),
            "weights": torch.randn(*shape, config.vocab_size, generator=g)}


class _Recorder:
    """The aot_eager backend, counting the mixer ops in the graphs it compiled."""

    def __init__(self) -> None:
        from torch._dynamo.backends.registry import lookup_backend
        self.inner, self.ops = lookup_backend("aot_eager"), 0

    def __call__(self, gm, example_inputs):
        self.ops += sum(n.op == "call_function" and "token_mixer_layer" in str(n.target) for n in gm.graph.nodes)
        return self.inner(gm, example_inputs)


def _step(model, batch: dict, rank: int, world: int, packed: bool, seed: int) -> dict:
    if packed:
        cu = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()], dtype=torch.int32)
        shard = lambda x: shard_packed(x, cu, world, rank)  # noqa: E731
        positions = torch.cat([torch.arange(n) for n in DOCS])[None]
        extra = dict(position_ids=shard(positions), cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(DOCS),
                     max_length_k=max(DOCS))
    else:
        shard = lambda x: hf_ring.shard_sequence(x, world, rank)  # noqa: E731
        extra = dict(position_ids=shard(torch.arange(SEQ).expand(ROWS, -1)))
    torch.manual_seed(seed)  # the same draws for the eager and the compiled forward
    loss = (model(shard(batch["ids"]), **extra).logits * shard(batch["weights"])).sum()
    loss.backward()
    return {"loss": loss.detach()}


def _cases_on_rank(rank: int, world: int, cases: dict) -> dict:
    from hf_ring.patterns.compiled import live_tapes
    hf_ring.setup_context_parallel(world)
    out = {}
    for name, case in cases.items():
        torch._dynamo.reset()
        config, packed = case["config"], case["packed"]
        eager = tiny_model(config, "ring_flash", case["state_dict"]).train()
        model = tiny_model(config, "ring_flash", case["state_dict"]).train()
        recorder = _Recorder()
        result = {"eager": _step(eager, case["batch"], rank, world, packed, 11),
                  "compiled": _step(torch.compile(model, backend=recorder), case["batch"], rank, world, packed, 11)}
        result["eager"]["grads"], result["compiled"]["grads"] = grads(eager), grads(model)
        result.update(ops=recorder.ops, live_tapes=live_tapes(),
                      routed=sum(hf_ring.patches.transformers.mixers.is_routed_layer(m) for m in model.modules()))
        out[name] = result
    return out


def _reference(case: dict) -> dict:
    """One process, the documents (or the dense rows) alone, sdpa, the same weights."""
    model = tiny_model(case["config"], "sdpa", case["state_dict"]).train()
    ids = case["batch"]["ids"]
    torch.manual_seed(11)
    if case["packed"]:
        bounds = [0, *torch.tensor(DOCS).cumsum(0).tolist()]
        logits = torch.cat([model(ids[:, a:b]).logits for a, b in zip(bounds, bounds[1:])], dim=1)
    else:
        logits = model(ids).logits
    loss = (logits * case["batch"]["weights"]).sum()
    loss.backward()
    return {"loss": loss.detach(), "grads": grads(model)}


CASES = [(family, True) for family in FAMILIES] + [("qwen3_next", False)]
_RUN: list = []


def _run() -> dict:
    if not _RUN:
        cases = {}
        for family, packed in CASES:
            config = _config(family)
            # Dropout left at the families' defaults, but no draw may differ between the runs compared.
            cases[(family, packed)] = {"config": config, "packed": packed, "batch": _batch(config, packed),
                                       "state_dict": tiny_model(config, "sdpa", seed=5).state_dict()}
        _RUN.append((cases, run_world(2, _cases_on_rank, cases)))
    return _RUN[0]


@pytest.mark.parametrize("family,packed", CASES, ids=[f"{f}-{'packed' if p else 'dense'}" for f, p in CASES])
def test_compiled_mixer_layers_equal_eager_and_one_process(family, packed):
    cases, ranks = _run()
    case = cases[(family, packed)]
    for rank in ranks:
        r = rank[(family, packed)]
        assert r["live_tapes"] == 0, "a compiled forward left its tape behind"
        assert r["routed"] >= 1 and r["ops"] == r["routed"], (r["ops"], r["routed"])  # not run eagerly
        assert rel_err(r["compiled"]["loss"], r["eager"]["loss"]) <= EAGER_TOL
        errors = {n: rel_err(g, r["eager"]["grads"][n]) for n, g in r["compiled"]["grads"].items()}
        assert set(errors) == set(r["eager"]["grads"]) and max(errors.values()) <= EAGER_TOL, errors
    reference = _reference(case)
    assert rel_err(sum(r[(family, packed)]["compiled"]["loss"] for r in ranks), reference["loss"]) <= REFERENCE_TOL
    summed = {n: sum(r[(family, packed)]["compiled"]["grads"][n] for r in ranks) for n in reference["grads"]}
    errors = {n: rel_err(g, reference["grads"][n]) for n, g in summed.items()}
    assert max(errors.values()) <= REFERENCE_TOL, errors
