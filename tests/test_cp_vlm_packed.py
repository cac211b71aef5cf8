"""Packed image-text rows under context parallelism, at the model level (issue 21), transformers 5.24.

Each family's samples (tests/vlm_cases.py ``PACKED_SAMPLES``: two image-text samples of 23 and
17 to 19 tokens, Qwen2.5-VL's and Qwen3-VL's second one a video, and a text-only one of 5)
are packed into one row by ``hf_ring.training.vision.packing.pack_image_text``: each document
padded to a multiple of 4 (cp=2), its images in document order, its positions the model's own
for it alone (Qwen's M-RoPE from ``compute_3d_position_ids`` per document, after a text row),
``cu_seq_lens_q/k``. Every rank of a gloo world of 2 (one CP group, zigzag) feeds the same
full batch; hf_ring cuts the merged row document by document (``shard_packed``) at the
language model's entry. The reference is one process running the same weights with
``attn_implementation="sdpa"`` on **each sample alone** (its own positions from 0, computed by
the model itself; no other sample in its row):

- logits, put back in order (``unshard_packed``), on each document's real tokens: within 1e-4
  relative error (float32);
- every parameter's gradient, vision tower and projector included, summed over the ranks
  (each rank's loss: a fixed random weighting of its shard of the packed logits, zero on
  padding, whose sum over ranks is the sum of the samples' weighted logits), within 1e-4
  relative error of the sum of the samples' gradients;
- the cross-entropy on ``shift_labels`` (shifted per document, image placeholders -100),
  summed over the ranks over the world's valid tokens, within 1e-4 of the samples' token mean.

1e-4 because both sides run float32 and differ only in the order of the sums (the varlen
ring's online softmax against SDPA's one pass per sample, a gradient summed over two shards
and three samples); measured errors are <= 3e-7 (logits), <= 1e-6 (gradients), 1e-7 (loss). A gradient
that is zero in exact arithmetic (CLIP's key biases: without rotary positions a key bias
shifts every score of a query alike) holds rounding only on both sides: there both norms must
stay below 1e-5. The same packed rows without CP (``ring_flash``, cp_size 1: the varlen ring
in one process) must meet the same tolerances, and stock transformers' SDPA on the same packed
batch (``use_cache=False``: it reads the documents from the text row of the positions) gives
the samples' logits too. Gemma 3's row (its images' bidirectional spans and its sliding
window inside each document) is checked the same way under the all-gather and Ulysses
patterns at cp=2, and under every pattern at cp=4 (the hybrid over 2 groups of 2).

Controls: without ``cu_seq_lens`` the documents attend to each other and the logits move by
far more than 1e-4; with the M-RoPE rows replaced by the text row, Qwen2.5-VL's logits move by
more than 10 x 1e-4 (the per-document 3-D positions are exercised); each rank's tower gradient
alone is far from the full one (images straddle the shards). Refused on every rank: a packed
row in the stripe layout, a document length the layout cannot split, boundaries that do not
cover the row, a padding mask; refused by the packing function: PaliGemma, a text
model, samples it cannot pack (an unknown key, padding, images of other sizes, videos timed in part);
and without CP, packed rows for a family not in the table.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import hf_ring
from distributed import run_world
from hf_ring.patches.transformers import release_line
from hf_ring.sharding import shard_packed, unshard_packed
from hf_ring.training.collator import RingCollatorConfig
from hf_ring.training.loss import all_reduce_sum, count_valid_tokens, token_loss_sum
from hf_ring.training.vision.packing import pack_image_text
from closeness import grads, rel_err
from vlm_checks import TOL, WORLD, ZERO, assert_tower_exercised
from vlm_cases import (
    FAMILIES, IMAGE, PACKED_CONFIGS, PACKED_SAMPLES, VIDEO, VOCAB, assert_refused_on_every_rank,
    assert_tower_gradient_split, build, tiny_gemma,
)

pytestmark = pytest.mark.skipif(
    release_line(__import__("transformers").__version__) != "5",
    reason="the multimodal families were read and tested on transformers 5.x",
)

# What each refusal under CP must say, on every rank.
REFUSALS = {
    "stripe": "packed rows are zigzag-sharded document by document",
    "document_length": "document 2 has length 6, not a multiple of 2 * cp_size = 4",
    "boundaries": "cu_seq_lens_q ends at 44 but the packed row holds 52 tokens",
    "padding_mask": "take no padding attention_mask",
}


def _config(cp_size: int, cp_rank: int = 0) -> RingCollatorConfig:
    return RingCollatorConfig(pad_token_id=0, cp_size=cp_size, cp_rank=cp_rank, packing=True)


def _packed_weights(case: dict, cu: torch.Tensor) -> torch.Tensor:
    """``(1, L, vocab)``: each sample's weights at its document's real tokens, 0 on padding."""
    full = torch.zeros(1, int(cu[-1]), VOCAB)
    for start, w in zip(cu.tolist(), case["weights"]):
        full[0, start:start + w.shape[0]] = w
    return full


_SDPA: dict[str, torch.nn.Module] = {}


def _cases() -> dict[str, dict]:
    cases, g = {}, torch.Generator().manual_seed(7)
    for i, (name, config) in enumerate(PACKED_CONFIGS.items()):
        c = config()
        _SDPA[name] = build(c, "sdpa")
        samples = PACKED_SAMPLES[name](i)
        weights = [torch.randn(s["input_ids"].shape[-1], VOCAB, generator=g) for s in samples]
        cases[name] = {"config": c, "state_dict": _SDPA[name].state_dict(), "samples": samples, "weights": weights}
    return cases


def _packed_run(model, case: dict, cp_size: int, rank: int) -> dict:
    """Forward and backward of the packed row on this rank (cp_size 1: the whole row)."""
    batch = pack_image_text(case["samples"], model, _config(cp_size, rank))
    shift_labels = batch.pop("shift_labels")
    model.zero_grad(set_to_none=True)
    logits = model(**batch).logits  # (1, L / cp_size, vocab)
    cu = batch["cu_seq_lens_q"]
    (logits * shard_packed(_packed_weights(case, cu), cu, cp_size, rank)).sum().backward()
    count = count_valid_tokens(shift_labels)
    if cp_size > 1:
        count = all_reduce_sum(count)
    loss = token_loss_sum(logits.detach(), shift_labels) / count
    return {"logits": logits.detach(), "grads": grads(model), "loss": loss, "cu": cu}


def _refusals(model, case: dict, rank: int) -> dict[str, str]:
    batch = pack_image_text(case["samples"], model, _config(WORLD, rank))
    batch.pop("shift_labels")
    cu = batch["cu_seq_lens_q"]
    short = {**batch, "cu_seq_lens_q": cu[:-1], "cu_seq_lens_k": cu[:-1]}
    unsplit = pack_image_text(case["samples"], model, _config(1))  # documents of 24, 20 and 6
    unsplit.pop("shift_labels")
    mask = torch.ones_like(batch["input_ids"])
    mask[0, -4:] = 0  # padding in the last document's chunks of both ranks
    errors = {}

    def attempt(what: str, call) -> None:
        try:
            call()
            errors[what] = "no error"
        except (ValueError, NotImplementedError, RuntimeError) as e:
            errors[what] = f"{type(e).__name__}: {e}"

    hf_ring.setup_context_parallel(WORLD, layout="stripe")
    attempt("stripe", lambda: model(**batch))
    hf_ring.setup_context_parallel(WORLD)
    attempt("document_length", lambda: model(**unsplit))
    attempt("boundaries", lambda: model(**short))
    attempt("padding_mask", lambda: model(**batch, attention_mask=mask))
    return errors


def _rank_main(rank: int, world: int, cases: dict) -> dict:
    hf_ring.setup_context_parallel(world)
    result = {}
    for name, case in cases.items():
        model = build(case["config"], "ring_flash", case["state_dict"])
        result[name] = _packed_run(model, case, world, rank)
        if name == "qwen2_5_vl":
            result["refusals"] = _refusals(model, case, rank)
        if name == "gemma3":
            result.update(_other_patterns(model, case, world, rank))
    return result


# Gemma 3's packed row (its images' bidirectional spans and its sliding window, each inside its
# document) under the other patterns that run packed rows: each local chunk against its
# document's prefix after an all-gather; the row put back in order for a rank's heads (Ulysses).
PACKED_PATTERNS = ("allgather", "ulysses")


def _other_patterns(model, case: dict, world: int, rank: int) -> dict:
    result = {}
    for pattern in PACKED_PATTERNS:
        hf_ring.setup_context_parallel(world, pattern=pattern)
        result["gemma3", pattern] = _packed_run(model, case, world, rank)
    hf_ring.setup_context_parallel(world)
    return result


def _gemma3_at_cp4(rank: int, world: int, case: dict) -> dict:
    model = build(case["config"], "ring_flash", case["state_dict"])
    hf_ring.setup_context_parallel(world, pattern="hybrid", ulysses_size=2)
    hybrid = _packed_run(model, case, world, rank)
    hf_ring.setup_context_parallel(world)
    return {("gemma3", "ring"): _packed_run(model, case, world, rank), ("gemma3", "hybrid"): hybrid,
            **_other_patterns(model, case, world, rank)}


@functools.cache
def _run() -> tuple[dict, list[dict]]:
    """One spawn for every test of this module: the cases, and each rank's results."""
    cases = _cases()
    return cases, run_world(WORLD, _rank_main, cases)


@functools.cache
def _reference(name: str) -> dict:
    """One process, SDPA, each sample alone."""
    case, model = _run()[0][name], _SDPA[name]
    model.zero_grad(set_to_none=True)
    logits = [model(**s).logits[0] for s in case["samples"]]  # each (n_i, vocab)
    sum(((x * w).sum() for x, w in zip(logits, case["weights"]))).backward()
    losses, count = 0.0, 0
    for x, s in zip(logits, case["samples"]):
        ids = s["input_ids"][0]
        labels = ids.masked_fill(torch.isin(ids, torch.tensor([IMAGE, VIDEO])), -100)[1:]  # shifted
        losses += F.cross_entropy(x[:-1].detach(), labels, ignore_index=-100, reduction="sum")
        count += int((labels != -100).sum())
    return {"logits": [x.detach() for x in logits], "grads": grads(model), "loss": losses / count}


def _errors(name: str, logits: torch.Tensor, cu: torch.Tensor, grads: dict, loss: torch.Tensor) -> dict[str, float]:
    """Relative errors against each sample alone: ``logits`` ``(1, L, vocab)`` of the packed row."""
    reference = _reference(name)
    errors = {"loss": rel_err(loss, reference["loss"])}
    for i, (start, ref) in enumerate(zip(cu.tolist(), reference["logits"])):
        errors[f"logits of sample {i}"] = rel_err(logits[0, start:start + ref.shape[0]], ref)
    assert set(grads) == set(reference["grads"])
    for n, ref in reference["grads"].items():
        if ref.norm() < ZERO:  # zero in exact arithmetic: both sides hold rounding only
            assert grads[n].norm() < ZERO, (n, grads[n].norm().item())
            errors[n] = 0.0
        else:
            errors[n] = rel_err(grads[n], ref)
    tower = [n for n in grads if ".visual." in n or ".vision_tower." in n]
    assert tower and any("merger" in n or "multi_modal_projector" in n for n in grads), "tower and projector"
    assert_tower_exercised(reference["grads"])
    worst = max(errors, key=errors.get)
    print(f"{name}: logits {max(v for k, v in errors.items() if k.startswith('logits')):.1e}, loss "
          f"{errors['loss']:.1e}, worst {worst} {errors[worst]:.1e}, tower {max(errors[n] for n in tower):.1e}")
    return errors


def _cp_errors(name: str, ranks: list[dict], key) -> dict[str, float]:
    """:func:`_errors` of the ranks' results under ``key``: logits put back in order,
    gradients and loss shares summed over the ranks."""
    cu = ranks[0][key]["cu"]
    logits = unshard_packed([r[key]["logits"] for r in ranks], cu)
    grads = {n: sum(r[key]["grads"][n] for r in ranks) for n in ranks[0][key]["grads"]}
    return _errors(name, logits, cu, grads, sum(r[key]["loss"] for r in ranks))


@pytest.mark.parametrize("name", PACKED_CONFIGS)
def test_packed_row_at_cp2_is_each_sample_alone(name):
    errors = _cp_errors(name, _run()[1], name)
    assert max(errors.values()) <= TOL, sorted(errors.items(), key=lambda e: -e[1])[:4]


@pytest.mark.parametrize("pattern", PACKED_PATTERNS)
def test_packed_gemma3_at_cp2_under_other_patterns_is_each_sample_alone(pattern):
    errors = _cp_errors("gemma3", _run()[1], ("gemma3", pattern))
    assert max(errors.values()) <= TOL, sorted(errors.items(), key=lambda e: -e[1])[:4]


def test_packed_gemma3_at_cp4_under_every_pattern_is_each_sample_alone():
    """cp 4: each document padded to a multiple of 8, its images' spans cut over 8 chunks;
    the hybrid with Ulysses inside 2 groups of 2."""
    case = _run()[0]["gemma3"]
    ranks = run_world(4, _gemma3_at_cp4, case)
    for pattern in ("ring", "hybrid", *PACKED_PATTERNS):
        errors = _cp_errors("gemma3", ranks, ("gemma3", pattern))
        assert max(errors.values()) <= TOL, (pattern, sorted(errors.items(), key=lambda e: -e[1])[:4])


@pytest.mark.parametrize("name", PACKED_CONFIGS)
def test_packed_row_without_cp_is_each_sample_alone(name):
    cases, _ = _run()
    case = cases[name]
    model = build(case["config"], "ring_flash", case["state_dict"])
    out = _packed_run(model, case, 1, 0)
    errors = _errors(name, out["logits"], out["cu"], out["grads"], out["loss"])
    assert max(errors.values()) <= TOL, sorted(errors.items(), key=lambda e: -e[1])[:4]


def test_packed_gemma3_without_cp_builds_no_sdpa_mask(monkeypatch):
    """The varlen ring reads no mask: on a packed Gemma 3 row ring_flash's mask builder must
    not build SDPA's (batch, 1, seq, seq) one (still each sample alone: the test above). The
    control, one sample unpacked, builds it: the counter sees the builder."""
    import hf_ring.hf.mask as ring_mask

    built = []
    sdpa = ring_mask.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setattr(ring_mask, "ALL_MASK_ATTENTION_FUNCTIONS",
                        {"sdpa": lambda *a, **k: built.append(sdpa(*a, **k)) or built[-1]})
    case = _run()[0]["gemma3"]
    model = build(case["config"], "ring_flash", case["state_dict"])
    with torch.no_grad():
        model(**_without(pack_image_text(case["samples"], model, _config(1)), "shift_labels"), use_cache=False)
        assert built == []
        model(**case["samples"][0], use_cache=False)
    assert any(m is not None and m.shape[-1] == case["samples"][0]["input_ids"].shape[-1] for m in built), built


def _without(batch: dict, *names: str) -> dict:
    return {k: v for k, v in batch.items() if k not in names}


@pytest.mark.parametrize("name", ("qwen2_5_vl", "qwen3_vl", "llava"))
def test_stock_sdpa_reads_the_same_packed_batch(name):
    """transformers' own packed convention: SDPA finds the documents in the text row."""
    cases, _ = _run()
    batch = pack_image_text(cases[name]["samples"], _SDPA[name], _config(WORLD))
    cu = batch["cu_seq_lens_q"]
    with torch.no_grad():
        logits = _SDPA[name](**_without(batch, "shift_labels", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                        "max_length_k"), use_cache=False).logits
    for start, ref in zip(cu.tolist(), _reference(name)["logits"]):
        assert rel_err(logits[0, start:start + ref.shape[0]], ref) <= TOL


def test_stock_gemma3_packs_wrong_so_its_stock_collator_refuses():
    """transformers 5.24's own Gemma 3 mask on a packed row is not each sample alone (its
    sliding layers): the collator for the stock model's loss refuses to pack it. If a
    release fixes the mask, the first assertion fails: lift ``Family.stock_packing`` and
    ``patches/transformers/defects.py``'s ``GEMMA3_PACKED_MASK``."""
    cases, _ = _run()
    model = _SDPA["gemma3"]
    model.config.get_text_config().use_cache = False
    batch = pack_image_text(cases["gemma3"]["samples"], model, _config(1))
    cu = batch["cu_seq_lens_q"].tolist()
    with torch.no_grad():
        logits = model(**_without(batch, "shift_labels", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                  "max_length_k")).logits
    second = _reference("gemma3")["logits"][1]
    assert rel_err(logits[0, cu[1]:cu[1] + second.shape[0]], second) > 1e-2
    collator = hf_ring.RingVisionDataCollator(pad_token_id=0, image_token_id=IMAGE, model_labels=True, packing=True,
                                              model=model)
    features = [{k: v[0] if k in ("input_ids", "token_type_ids") else v for k, v in f.items()}
                for f in cases["gemma3"]["samples"]]  # the collator's examples: one row of ids each
    with pytest.raises(ValueError, match="Gemma 3 mask on a packed row is not each document alone"):
        collator(features)


def test_the_documents_and_their_positions_are_exercised():
    """Without the boundaries the documents attend to each other; with the text row in place
    of the M-RoPE rows Qwen2.5-VL numbers its images as text: both move the logits."""
    cases, _ = _run()
    case = cases["qwen2_5_vl"]
    model = build(case["config"], "ring_flash", case["state_dict"])
    batch = _without(pack_image_text(case["samples"], model, _config(1)), "shift_labels")
    flat = batch["position_ids"][:1].expand(4, -1, -1)
    cu = batch["cu_seq_lens_q"].tolist()
    reference = _reference("qwen2_5_vl")["logits"]
    with torch.no_grad():
        across = model(**_without(batch, "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")).logits
        text_only = model(**{**batch, "position_ids": flat}).logits
    assert rel_err(across[0, cu[1]:cu[1] + reference[1].shape[0]], reference[1]) > 10 * TOL
    assert rel_err(text_only[0, :reference[0].shape[0]], reference[0]) > 10 * TOL


def test_each_rank_holds_part_of_the_tower_gradient():
    assert_tower_gradient_split([r["qwen2_5_vl"]["grads"] for r in _run()[1]], _reference("qwen2_5_vl")["grads"])


@pytest.mark.parametrize("what", REFUSALS)
def test_refused_on_every_rank(what):
    assert_refused_on_every_rank(_run()[1], what, REFUSALS[what])


def test_the_packing_function_refuses_what_it_cannot_pack():
    llava = build(FAMILIES["llava"][0](), "ring_flash")
    samples = PACKED_SAMPLES["llava"](0)
    qwen, timed = _SDPA.get("qwen2_5_vl") or build(FAMILIES["qwen2_5_vl"][0](), "sdpa"), PACKED_SAMPLES["qwen2_5_vl"](0)
    cases = {
        "not packing": (lambda: pack_image_text(samples, llava, RingCollatorConfig(pad_token_id=0)), "packing=True"),
        "unknown key": (lambda: pack_image_text([{**samples[0], "image_attention_mask": samples[0]["input_ids"]}],
                                                llava, _config(2)),
                        "image_attention_mask, which pack_image_text does not know"),
        "padded": (lambda: pack_image_text([{**samples[2], "attention_mask": torch.tensor([[1, 1, 1, 0, 0]])}], llava,
                                           _config(2)), "already padded"),
        "image sizes": (lambda: pack_image_text([samples[0], {**samples[1], "pixel_values": torch.randn(1, 3, 16, 16)}],
                                                llava, _config(2)), "process the samples' images to one size"),
        "untimed video": (lambda: pack_image_text([*timed, {**timed[1], "second_per_grid_ts": None}], qwen, _config(2)),
                          "1 second_per_grid_ts for 2 videos"),
        "paligemma": (lambda: pack_image_text(samples, tiny_gemma("paligemma"), _config(2)),
                      "PaliGemmaModel (PaliGemma) is not supported with packed image-text rows"),
        "text model": (lambda: pack_image_text(samples, llava.model.language_model, _config(2)),
                       "not an image-text model"),
    }
    for what, (call, expected) in cases.items():
        with pytest.raises((ValueError, NotImplementedError)) as info:
            call()
        assert expected in str(info.value), (what, str(info.value))


def test_packed_rows_of_an_unchecked_family_are_refused_without_cp():
    """Without CP a packed row runs the varlen ring, causal per document (plus the spans of
    a family that has them): PaliGemma's one prefix a row is not read on packed rows."""
    model = tiny_gemma("paligemma")
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="PaliGemmaModel .*with packed rows"):
        model(input_ids=torch.randint(3, 100, (1, 8)), position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
              cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4, max_length_k=4)


def test_gemma3_image_runs_are_cut_at_the_documents():
    """A run of image tokens across a document boundary is two blocks: with one block, the
    first document's last image would see the next document's first (the ring refuses a
    span that crosses a boundary; transformers' mask ANDs the documents')."""
    from hf_ring.patterns.ring.spans import BidirectionalSpans

    spans = BidirectionalSpans((((3, 7), (20, 28), (33, 37)),), 48).cut_at([0, 24, 44, 48])
    assert spans.rows == (((3, 7), (20, 24), (24, 28), (33, 37)),)
    batch = pack_image_text(PACKED_SAMPLES["gemma3"](0), _SDPA.get("gemma3") or build(PACKED_CONFIGS["gemma3"](), "sdpa"),
                            _config(WORLD))
    types, cu = batch["token_type_ids"][0], batch["cu_seq_lens_q"].tolist()
    assert bool(types[cu[1] - 1]) and bool(types[cu[1]]), "the samples put an image on each side of a boundary"


def test_the_position_reader_refuses_a_model_of_another_shape(monkeypatch):
    """The per-document positions come from the model's own method, or not at all."""
    import transformers

    from hf_ring.patches.transformers.positions import own_position_ids
    from hf_ring.patches.transformers.versions import UnsupportedTransformersVersion

    sample = PACKED_SAMPLES["qwen2_5_vl"](0)[0]
    with pytest.raises(UnsupportedTransformersVersion, match="has no compute_3d_position_ids"):
        own_position_ids(torch.nn.Linear(1, 1), sample)
    qwen = _SDPA.get("qwen2_5_vl") or build(FAMILIES["qwen2_5_vl"][0](), "sdpa")
    monkeypatch.setattr(transformers, "__version__", "4.56.2")
    with pytest.raises(UnsupportedTransformersVersion, match="transformers 4.56.2"):
        own_position_ids(qwen.model, sample)
