"""Packed rows placed by length (``placement="by_length"``, hf_ring/sharding/placement.py):
short documents whole on one rank, long ones sharded over the CP group.

The plan (one process): every token on exactly one rank, the sharded part equal on every
rank, balanced within the tolerance where it keeps documents whole, the token bound kept,
the same plan on every call. The collator: each rank's rows, put back by the plan's
indices, are the full row's (input ids, shifted labels, positions), so a label shifted on a
rank's own piece shows. The model (gloo world of 2): a tiny Llama and a Mistral with a
4-token window, a packed row of long and short documents collated at cp 2 by length under
the ring, all-gather, Ulysses and ``auto`` patterns; the loss (token-mean of the shifted
labels over the whole row, the ranks' sums added) and every parameter's gradient (summed
over the ranks) must equal one process's on the same row within 1e-5 relative (float32;
only the order of the softmax sums differs, measured < 1e-6). The plan keeps some documents
whole and shards others on this row (asserted), so both parts of the attention run.
Hybrid families (one per kind of token mixer) on a placed row equal their documents run one
by one (tests/test_hf_hybrid.py's reference and tolerance).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hf_ring
import hf_ring.sharding.placement
from closeness import grads, grads_rel_err
from distributed import run_world
from hf_ring.sharding.placement import SHARDED, PlacementCosts, place_by_length
from hf_ring.sharding.placement_auto import place_auto
from test_hf_attention import VOCAB, tiny_config, tiny_model

TOL = 1e-5
# A long document and short ones: at cp 2 the long one is sharded, the short ones kept whole.
DOC_TOKENS = (300, 12, 20, 8, 40, 30, 6, 16, 10)


ROWS = [(64,) * 64, (2048, 1024, 512, 256, 256), (1640, 1024, 820, 408, 204), (4096,),
        (8, 8, 8, 2000, 16, 24, 40, 1000), tuple(8 * (1 + (i * 37) % 50) for i in range(60)), (512,) * 4 + (64,) * 3]


def _planned_rows(place):
    """Each of ROWS at cp 2 and 4 (lengths padded to 2 x cp), its plan by ``place``, checked
    to cover every token once and to be cached per row shape."""
    for lens in ROWS:
        for cp in (2, 4):
            lens_cp = tuple(-(-n // (2 * cp)) * 2 * cp for n in lens)
            p = place(lens_cp, cp)
            assert p is place(lens_cp, cp)  # cached: one plan per row shape
            every = torch.cat([p.local_indices(r) for r in range(cp)])
            assert torch.equal(every.sort().values, torch.arange(sum(lens_cp))), (lens, cp)
            yield lens_cp, cp, p


def test_plan_covers_every_token_once_and_balances():
    for lens_cp, cp, p in _planned_rows(place_by_length):
        front = [p.local_indices(r)[: p.sharded_local_len] for r in range(cp)]
        assert all(len(f) == sum(p.sharded_lens) // cp for f in front)
        if p.owner.count(SHARDED) < len(lens_cp):
            assert p.imbalance <= PlacementCosts().tolerance + 1e-12, (lens_cp, cp, p.describe())
    # 64 equal short documents: none sharded, 32 whole on each of 2 ranks.
    p = place_by_length((64,) * 64, 2)
    assert p.owner.count(SHARDED) == 0 and [len(p.whole_lens(r)) for r in (0, 1)] == [32, 32]
    # One long document alone: sharded (whole on one rank it would leave the other idle).
    assert place_by_length((4096,), 2).owner == (SHARDED,)


def _modelled_cost(p, costs: PlacementCosts = PlacementCosts()) -> float:
    """A plan's most loaded rank with the ring overhead of its sharded documents, written
    out again from the module docstring's model (not from the search's own sums)."""
    cp = p.cp_size
    sharded = sum(costs.work(n) / cp + costs.ring_cost(n, cp) for n in p.sharded_lens)
    return max(sharded + sum(costs.work(n) for n in p.whole_lens(r)) for r in range(cp))


def test_auto_is_never_modelled_dearer_than_either_placement():
    for lens_cp, cp, auto in _planned_rows(place_auto):
        sharded = sum(PlacementCosts().work(n) / cp + PlacementCosts().ring_cost(n, cp) for n in lens_cp)
        assert _modelled_cost(auto) <= min(sharded, _modelled_cost(place_by_length(lens_cp, cp))) * (1 + 1e-12)
    # Short documents: all whole, nothing sent.
    assert SHARDED not in place_auto((64,) * 64, 2).owner
    # The five-document mix at cp 4, where by_length measured 0.86x sharded's step: by_length
    # keeps the smallest document whole at 9 % imbalance to save its ring steps; auto does not.
    five = (1640, 1024, 824, 408, 200)
    assert SHARDED in place_by_length(five, 4).owner and place_by_length(five, 4).owner.count(SHARDED) == 4
    assert place_auto(five, 4).owner == (SHARDED,) * 5
    # Without ring overhead nothing beats sharding every document (balanced by construction).
    free = PlacementCosts(ring_doc_step=0.0, ring_token=0.0)
    assert place_auto((64,) * 64, 2, costs=free).owner == (SHARDED,) * 64
    with pytest.raises(ValueError, match="ring_doc_step"):
        PlacementCosts(ring_doc_step=-1.0)


def test_plan_keeps_the_token_bound_and_refuses_what_cannot_fit():
    lens = (512, 512, 512, 64, 64, 64, 64)
    p = place_by_length(lens, 2, max_tokens_per_rank=1000)
    assert max(p.local_len(r) for r in (0, 1)) <= 1000
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        place_by_length(lens, 2, max_tokens_per_rank=800)
    with pytest.raises(ValueError, match="multiples of 2 \\* cp_size"):
        place_by_length((10, 12), 2)
    p = place_auto(lens, 2, max_tokens_per_rank=1000)
    assert max(p.local_len(r) for r in (0, 1)) <= 1000
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        place_auto(lens, 2, max_tokens_per_rank=800)


def _collated(cp: int, placement: str = "by_length") -> list[dict]:
    g = torch.Generator().manual_seed(3)
    features = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in DOC_TOKENS]
    # Documents padded to a multiple of 4 at any cp: the one-process row is the same row.
    return [hf_ring.RingDataCollator(0, cp_size=cp, cp_rank=r, packing=True, placement=placement,
                                     pad_to_multiple_of=4)(features) for r in range(cp)]


def test_collator_rows_put_back_are_the_full_row():
    full = _collated(1)[0]
    per_rank = _collated(2)
    bounds = full["cu_seq_lens_q"].tolist()
    p = place_by_length(tuple(b - a for a, b in zip(bounds, bounds[1:])), 2)
    assert 0 < p.owner.count(SHARDED) < len(DOC_TOKENS)
    for key in ("input_ids", "labels", "shift_labels", "position_ids"):
        back = torch.empty_like(full[key])
        for r, batch in enumerate(per_rank):
            back[:, p.local_indices(r)] = batch[key]
            assert torch.equal(batch["cu_seq_lens_q"], full["cu_seq_lens_q"])
        assert torch.equal(back, full[key]), key
    lens = {batch["input_ids"].shape[1] for batch in per_rank}
    assert len(lens) == 2, "the row's placement should leave the ranks with different lengths"
    with pytest.raises(ValueError, match="packing=True"):
        hf_ring.RingDataCollator(0, cp_size=2, placement="by_length")


def _loss_and_grads(model, batch: dict, total_tokens: int) -> tuple[float, dict]:
    keep = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
    logits = model(**keep).logits
    loss = F.cross_entropy(logits[0].float(), batch["shift_labels"][0], reduction="sum") / total_tokens
    loss.backward()
    return float(loss.detach()), grads(model)


# (family, pattern, placement); placement="auto" places this row by length too (asserted).
CASES = [("llama", "ring", "by_length"), ("llama", "allgather", "by_length"), ("llama", "ulysses", "by_length"),
         ("llama", "auto", "by_length"), ("mistral_window4", "ring", "by_length"), ("llama", "ring", "auto")]


def _config(family: str):
    return tiny_config("mistral", sliding_window=4) if family == "mistral_window4" else tiny_config(family)


def _on_rank(rank: int, world: int, cases: list) -> dict:
    out = {}
    for family, pattern, placement in cases:
        batches = _collated(world, placement)
        tokens = sum(int((b["shift_labels"] != -100).sum()) for b in batches)
        hf_ring.setup_context_parallel(world, pattern=pattern, placement=placement)
        config = _config(family)
        model = tiny_model(config, "ring_flash", tiny_model(config, "sdpa", seed=5).state_dict()).train()
        out[(family, pattern, placement)] = _loss_and_grads(model, batches[rank], tokens)
    return out


def test_model_on_rows_placed_by_length_equals_one_process():
    ranks = run_world(2, _on_rank, CASES)
    full = _collated(1)[0]
    tokens = int((full["shift_labels"] != -100).sum())
    bounds = full["cu_seq_lens_q"].tolist()
    auto = place_auto(tuple(b - a for a, b in zip(bounds, bounds[1:])), 2)
    assert 0 < auto.owner.count(SHARDED) < len(DOC_TOKENS), auto.describe()
    for case in CASES:
        config = _config(case[0])
        ref_loss, ref_grads = _loss_and_grads(tiny_model(config, "ring_flash", seed=5).train(), full, tokens)
        loss = sum(r[case][0] for r in ranks)
        summed = {n: sum(r[case][1][n] for r in ranks) for n in ref_grads}
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (case, loss, ref_loss)
        assert grads_rel_err(summed, ref_grads) < TOL, (case, grads_rel_err(summed, ref_grads))


# Hybrid families, one per kind of token mixer: the sharded document's convolution and
# recurrent states pass over the group as under "sharded"; a whole document's never leave
# its rank. Compared, as tests/test_hf_hybrid.py compares packed rows, with the documents
# run one by one in one process (1e-4; a decay gradient past it must be within twice the
# float32 one-process error of a float64 run).
HYBRIDS = ("qwen3_next", "lfm2", "granitemoehybrid", "jamba", "kimi_linear", "mamba")
HYBRID_DOCS = [64, 4, 8, 4, 12]


def _hybrid_on_rank(rank: int, world: int, cases: dict) -> dict:
    hf_ring.setup_context_parallel(world, placement="by_length")
    placement = place_by_length(tuple(HYBRID_DOCS), world)
    cu = torch.tensor([0, *torch.tensor(HYBRID_DOCS).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in HYBRID_DOCS])[None]
    local = lambda x: hf_ring.sharding.placement.shard_placed(x, placement, rank)  # noqa: E731
    out = {}
    for name, case in cases.items():
        model = tiny_model(case["config"], "ring_flash", case["state_dict"]).train()
        logits = model(local(case["ids"]), position_ids=local(positions), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=max(HYBRID_DOCS), max_length_k=max(HYBRID_DOCS)).logits
        (logits * local(case["weights"])).sum().backward()
        out[name] = {"logits": logits.detach(), "grads": grads(model)}
    return out


def test_hybrid_mixers_on_rows_placed_by_length_equal_each_document_alone():
    pytest.importorskip("transformers")
    import test_hf_hybrid as hybrid

    if hybrid.release_line(__import__("transformers").__version__) != "5":
        pytest.skip("token mixers are routed to hf_ring's CP mixers on transformers 5.x only")
    placement = place_by_length(tuple(HYBRID_DOCS), 2)
    assert 0 < placement.owner.count(SHARDED) < len(HYBRID_DOCS), placement.describe()
    cases = {f: hybrid._case(f, 2, seed=9, doc_lens=HYBRID_DOCS) for f in HYBRIDS}
    ranks = run_world(2, _hybrid_on_rank, cases)
    for name, case in cases.items():
        reference = hybrid._reference(case)
        errors = {"logits": max(float((r[name]["logits"] - reference["logits"][:, placement.local_indices(i)]).norm()
                                      / reference["logits"][:, placement.local_indices(i)].norm())
                                for i, r in enumerate(ranks))}
        exact = None
        for n, ref in reference["grads"].items():
            cp = sum(r[name]["grads"][n] for r in ranks)
            errors[n] = float((cp - ref).norm() / ref.norm().clamp_min(1e-30))
            if errors[n] > hybrid.TOL:
                exact = exact or hybrid._reference(case, torch.float64)["grads"]
                single = float((ref.double() - exact[n]).norm() / exact[n].norm())
                mine = float((cp.double() - exact[n]).norm() / exact[n].norm())
                assert mine <= max(hybrid.TOL, 2 * single), (name, n, errors[n], mine, single)
                errors[n] = 0.0
        assert max(errors.values()) <= hybrid.TOL, (name, errors)
