"""Under context parallelism a hybrid model's token mixers save, per rank, about 1/cp of
what one process saves on the full sequence: no full-sequence buffer anywhere.

Qwen3.5 (gated delta nets with their causal conv) and LFM2 (short convolutions), the
sweep's tiny configs, built with ``ring_flash``; one forward of a ``SEQ``-token row,
zigzag-sharded over a gloo world of 2 (global ``position_ids``). Counted: the bytes of
tensors saved for backward while a mixer layer's forward runs
(``benchmarks/layer_accounting.py saved_bytes``: ``saved_tensors_hooks``, storages
counted once, parameters left out, plus the tensors custom autograd functions keep on
their ``ctx``). Each rank's count must be at most ``0.5 * (1 + MARGIN)`` of one process's
on the full row, against both one-process codes: hf_ring's mixer ops run in one process
(the same scan and conv each rank runs: what CP adds shows alone) and transformers' own
functions (what runs without hf_ring; its scan saves more per token).

Why ``MARGIN = 0.1``: a rank's extras over half the one-process bytes are
- the conv's halos: the all-gathered tails, ``2 ranks x 2 pieces x channels x (width - 1)``
  floats (6 KiB per layer here), and the delta rule's all-gathered summaries ``[S_ext |
  M]``, ``2 x 2 x heads x dk x (dv + dk)`` floats (32 KiB): fixed, whatever the length;
- the delta rule's ``Q_hat`` (each non-first piece's queries seen through its transition,
  ``heads x dk`` floats per token, kept on the op's ``ctx`` for the state-gradient
  shares): per local token, so it falls as 1/cp too, but it is extra: 256 B per token of
  a non-first piece here against the layer's ~10.7 KiB per token in one process (2.3 %;
  rank 1 holds only non-first pieces).
What a rank saves less: the CP conv's own backward keeps only its input and recomputes
the conv, where the one-process conv (plain autograd) keeps its padded input and its
output before the SiLU; transformers' scan also pads the row to whole chunks and keeps
more per chunk. Measured at 1024 tokens: 0.49 (against hf_ring's ops) and 0.45
(transformers') for Qwen3.5, 0.501 for LFM2 (its conv has no SiLU). 10 % holds those with
room; a full-sequence buffer worth more than ~6 % of a layer's one-process bytes breaks
it (the scan's ``c x c`` chunk matrices of the whole row would be 9 %). A smaller one
would pass (a full-sequence copy of q alone is 2.3 % here): ``saved_bytes(...,
listing=True)`` lists every storage with its shape, the way to find it.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import hf_ring
from distributed import run_world
from hf_ring.patches.transformers import release_line
from model_sweep_configs import build_config
from test_hf_attention import tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from layer_accounting import saved_bytes  # noqa: E402
from step_world import hf_ring_one_process_mixers  # noqa: E402

pytestmark = pytest.mark.skipif(
    release_line(__import__("transformers").__version__) != "5",
    reason="the hybrids' token mixers are routed to hf_ring's CP ops on transformers 5.x only",
)

FAMILIES = ("qwen3_5_text", "lfm2")
SEQ = 1024
WORLD = 2
MARGIN = 0.1


def _config(family: str):
    config = build_config(family)
    config.max_position_embeddings = SEQ
    return config


def _ids() -> torch.Tensor:
    return torch.randint(3, 128, (1, SEQ), generator=torch.Generator().manual_seed(0))


def _count(model, ids: torch.Tensor, positions: torch.Tensor) -> dict[str, int]:
    return saved_bytes(model.train(), lambda: model(ids, position_ids=positions).logits)


def _rank(rank: int, world: int) -> dict:
    hf_ring.setup_context_parallel(world)
    shard = lambda x: hf_ring.shard_sequence(x, world, rank)  # noqa: E731
    positions = torch.arange(SEQ)[None]
    return {f: _count(tiny_model(_config(f), "ring_flash"), shard(_ids()), shard(positions)) for f in FAMILIES}


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_world(WORLD, _rank)


@pytest.mark.parametrize("family", FAMILIES)
def test_mixer_activations_per_rank_fall_as_one_over_cp(per_rank, family):
    positions = torch.arange(SEQ)[None]
    model = tiny_model(_config(family), "sdpa")
    one_process = {"transformers": _count(model, _ids(), positions)}
    with hf_ring_one_process_mixers(model):
        one_process["hf_ring"] = _count(model, _ids(), positions)
    for name, full in one_process.items():
        assert full["mixers"] > 0, (name, full)
        ratios = [r[family]["mixers"] / full["mixers"] for r in per_rank]
        print(f"{family} vs {name} in one process: mixer bytes per rank / one process {ratios}; whole model "
              f"{[r[family]['total'] / full['total'] for r in per_rank]}")
        assert max(ratios) <= (1 + MARGIN) / WORLD, (name, ratios)
        # and the whole model's (ring attention, MLPs, head) the same way
        assert max(r[family]["total"] for r in per_rank) <= (1 + MARGIN) / WORLD * full["total"], name
