"""The multimodal sweep: every image-text family of the installed transformers under
``ring_flash`` at cp=2, exact against one process on the full batch, or refused by name.

Why: a user loads whatever image-text model transformers knows. hf_ring serves those whose
merge of image features and whose positions were read (``hf_ring/hf/multimodal/families.py``)
and must refuse the rest by name on every rank, never train them silently wrong. This sweep
runs every family of ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` (``tests/vlm_sweep_configs.py``),
so a family added by the next release shows up as refused or not swept, not missing.

In one spawned gloo world of 2 ranks shared by all families (spawning is the slow part),
each family's failure caught on its own:

- a **checked** family (a hand-written case in ``tests/vlm_cases.py`` or
  ``tests/vlm_sweep_cases.py``: a tiny config and a
  batch with the family's own input format and placeholder counts): every rank runs the
  ``ring_flash`` model on the same full batch and gets its zigzag shard of the logits; its
  loss is its share of a fixed random weighting of the logits. Against one process with
  ``sdpa`` on the full batch (``tests/vlm_checks.py``): the unsharded logits and every
  parameter's gradient summed over the ranks within ``TOL``; and without a CP state the same
  ``ring_flash`` model's logits within ``TOL`` of SDPA's. The families of ``FLOAT64``
  (Qwen3.5 image-text: gated delta rule layers) run both sides in float64 instead, the
  reference's recurrence in float64 too (``tests/float64_reference.py``), within ``TOL64``;
- any other family (a tiny config from its own config class, a batch of text and one image
  a row): under CP it must raise an hf_ring error on every rank. The refusal by name fires at
  the base model's entry, before any image is read, so the batch need not be the family's
  exact format.

Outcomes: ``exact``, ``refused`` (raised by hf_ring on every rank), ``WRONG`` (ran, outside
tolerance, or ran at all without being checked: silently wrong), ``error`` (any other
exception), ``not swept`` (its config cannot be built tiny from its config class, the model
is not tiny, or its modeling code needs a package that is not installed: the reason).
``tests/test_vlm_sweep.py`` fails on WRONG and error, and ratchets exact / refused / not
swept against ``tests/vlm_sweep_expected.json`` (``tests/sweep_ratchet.py``).

``python tests/vlm_sweep.py --write-table`` runs it all and rewrites the table in
docs/multimodal.md; ``--write-expected`` records the outcomes (with ``--only NAME ...``:
those families' only).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time
import zlib
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sweep_ratchet  # noqa: E402
from float64_reference import cast_floats, float64_delta_rule, to_dtype  # noqa: E402
import vlm_cases  # noqa: E402
import vlm_sweep_cases  # noqa: E402
from model_sweep import describe_error  # noqa: E402
from vlm_checks import errors, run_full, run_shard  # noqa: E402
from vlm_sweep_configs import WRITTEN_FOR, build_config, family_names, model_class_name  # noqa: E402

CP = 2
# Both sides run float32 and differ only in the order of their sums (the ring's online
# softmax against SDPA's one pass, a gradient summed from two shards): the checked families
# measure <= 2e-6; a wrong merge or wrong positions are 1e-3 and up (tests/test_cp_vlm.py).
TOL = 1e-4
# Checked in float64: the gradients of their gated delta rule layers' decay parameters
# (linear_attn.A_log, dt_bias) are 1e-3 to 2e-2 relative from exact in float32 whichever
# side computes them, one process included (tests/test_cp_vlm_hybrid.py). In float64 CP
# measures <= 2.1e-7 (what the models' own float32 casts leave: RMSNorms, rotary, the ring's
# float32 accumulators); a wrong merge or wrong positions are 1e-3 and up.
FLOAT64 = ("qwen3_5", "qwen3_5_moe")
TOL64 = 1e-6
# Configs are checked on the meta device first: a family whose size knobs the tables
# missed is not swept instead of filling the machine's memory.
MAX_PARAMS = 4_000_000
CP_TIMEOUT = timedelta(seconds=60)
OUTCOMES = ("exact", "refused", "WRONG", "error", "not swept")
DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "multimodal.md")
EXPECTED_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vlm_sweep_expected.json")
UPDATE = "python tests/vlm_sweep.py --only {names} --write-expected"
TABLE_START, TABLE_END = "<!-- vlm-sweep table: start -->", "<!-- vlm-sweep table: end -->"


class NotSwept(Exception):
    """The family cannot be swept here (the reason)."""


def checked_cases() -> dict:
    """Family (model type) -> (config(), batch(seed)) for the families with a hand-written case."""
    return {**vlm_cases.FAMILIES, **vlm_sweep_cases.CASES}


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


def _model_class(name: str):
    import transformers

    return getattr(transformers, model_class_name(name))


def _dtype(name: str) -> torch.dtype:
    return torch.float64 if name in FLOAT64 else torch.float32


def _build(name: str, config, implementation: str, state_dict=None):
    torch.manual_seed(0)
    model = _model_class(name)._from_config(copy.deepcopy(config), attn_implementation=implementation)
    model = to_dtype(model.float(), _dtype(name))
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.train()


def _reference_model(name: str, config):
    """SDPA, or eager where transformers refuses SDPA for the model."""
    try:
        return _build(name, config, "sdpa")
    except ValueError as e:
        if "scaled_dot_product_attention" not in str(e):
            raise
    return _build(name, config, "eager")


def _run_reference(name: str, model, batch: dict, weights: torch.Tensor) -> dict:
    """One process on the full batch; a ``FLOAT64`` family with its recurrence in float64."""
    if name not in FLOAT64:
        return run_full(model, batch, weights)
    with float64_delta_rule(model):
        return run_full(model, batch, weights)


def _generic_batch(name: str, config) -> dict[str, Any]:
    """Text and one image a row (the family's vision config's image size), for a family
    hf_ring refuses at its base model's entry."""
    g = torch.Generator().manual_seed(_seed(name))
    batch: dict[str, Any] = {"input_ids": torch.randint(3, 100, (vlm_cases.ROWS, vlm_cases.SEQ), generator=g)}
    vision = getattr(config, "vision_config", None)
    size = getattr(vision, "image_size", None)
    if isinstance(size, (list, tuple)):
        size = size[0]
    if isinstance(size, int) and size <= 1024:
        channels = getattr(vision, "num_channels", 3)
        batch["pixel_values"] = torch.randn(vlm_cases.ROWS, channels, size, size, generator=g)
    return batch


def _case(name: str):
    """(config, batch, checked) of one family; NotSwept with the reason where it cannot be."""
    cases = checked_cases()
    try:
        if name in cases:
            config, batch = cases[name][0](), cast_floats(cases[name][1](_seed(name)), _dtype(name))
        else:
            config = build_config(name)
            batch = _generic_batch(name, config)
        with torch.device("meta"):
            n = sum(p.numel() for p in _model_class(name)._from_config(copy.deepcopy(config)).parameters())
    except ImportError as e:
        raise NotSwept(f"needs a package that is not installed: {describe_error(e)['message']}") from e
    except Exception as e:  # noqa: BLE001 - the reason is recorded
        err = describe_error(e)
        raise NotSwept(f"not built tiny from its config class: {err['type']}: {err['message']}") from e
    if n > MAX_PARAMS:
        raise NotSwept(f"not tiny from its config class: {n / 1e6:.0f}M parameters (sub-configs the sweep does not shrink)")
    return config, batch, name in cases


def _agree(world: int, status: Optional[dict]) -> list[Optional[dict]]:
    statuses: list[Optional[dict]] = [None] * world
    dist.all_gather_object(statuses, status)
    return statuses


def _family_on_rank(name: str, rank: int, world: int, state) -> dict[str, Any]:
    """Every rank runs this for every family in the same order; every step's outcome is
    agreed on before the next, so the collectives stay in lockstep whatever fails."""
    import hf_ring

    record: dict[str, Any] = {"name": name}
    started = time.perf_counter()
    status = None
    try:
        config, batch, checked = _case(name)
        sdpa = _reference_model(name, config)
    except NotSwept as e:
        status = {"not_swept": str(e)}
    except Exception as e:  # noqa: BLE001
        status = {"not_swept": f"its reference does not build: {describe_error(e)['type']}: {describe_error(e)['message']}"}
    setup = next((s for s in _agree(world, status) if s is not None), None)
    if setup is not None:
        return {**record, "outcome": "not swept", "detail": setup["not_swept"], "seconds": time.perf_counter() - started}
    record["checked"] = checked
    state_dict = sdpa.state_dict()
    for tensor in state_dict.values():  # one set of weights on every rank
        dist.broadcast(tensor, src=0)
    weights = reference = None
    if checked:
        try:
            with torch.no_grad():
                vocab = sdpa(**batch).logits.shape[-1]
            g = torch.Generator().manual_seed(_seed(name) + 1)
            weights = torch.randn(vlm_cases.ROWS, vlm_cases.SEQ, vocab, generator=g).to(_dtype(name))
            mask = batch.get("attention_mask")
            weights = weights if mask is None else weights * mask[..., None]
            reference = _run_reference(name, sdpa, batch, weights)
        except Exception as e:  # noqa: BLE001
            status = describe_error(e)
        failed = next((s for s in _agree(world, status) if s is not None), None)
        if failed is not None:
            return {**record, "errors": [{**failed, "by_hf_ring": False, "where": "the reference: " + failed["where"]}] * world,
                    "seconds": time.perf_counter() - started}
    out, status = None, None
    try:
        model = _build(name, config, "ring_flash", state_dict)
        if weights is None:
            with torch.no_grad():
                out = {"logits": model(**batch).logits.detach()}
        else:
            out = run_shard(model, batch, weights, world, rank)
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        status = describe_error(e)
    statuses = _agree(world, status)
    record["errors"] = statuses
    if all(s is None for s in statuses):
        ranks: list[Any] = [None] * world
        dist.all_gather_object(ranks, out)
        if checked:
            record["errors_by_tensor"] = errors(ranks, reference, batch.get("attention_mask"))
            hf_ring.set_context_parallel_state(None)
            try:
                with torch.no_grad():
                    record["no_cp"] = errors([{"logits": model(**batch).logits, "grads": {}}],
                                             {"logits": reference["logits"], "grads": {}})["logits"]
            finally:
                hf_ring.set_context_parallel_state(state)
    record["seconds"] = time.perf_counter() - started
    return record


def _rank_main(rank: int, world: int, names: list[str]) -> list[dict[str, Any]]:
    import warnings

    import transformers

    import hf_ring

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    state = hf_ring.setup_context_parallel(CP, timeout=CP_TIMEOUT)
    records = []
    for name in names:
        records.append(_family_on_rank(name, rank, world, state))
        gc.collect()
    return records


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """One family's outcome and detail from rank 0's record (every rank's errors are in it)."""
    name = record["name"]
    summary = {"name": name, "seconds": record["seconds"], "checked": record.get("checked", False)}
    tol, dtype = (TOL64, "float64; ") if name in FLOAT64 else (TOL, "")
    if record.get("outcome") == "not swept":
        return {**summary, "outcome": "not swept", "detail": record["detail"]}
    present = [e for e in record["errors"] if e is not None]
    if present:
        if len(present) == len(record["errors"]) and all(e["by_hf_ring"] for e in present):
            return {**summary, "outcome": "refused", "detail": f"{present[0]['type']}: {present[0]['message']}"}
        ranks = [i for i, e in enumerate(record["errors"]) if e is not None]
        only = f" (on rank(s) {ranks} only)" if len(present) < len(record["errors"]) else ""
        err = present[0]
        return {**summary, "outcome": "error", "detail": f"{err['type']}: {err['message']} [{err['where']}]{only}"}
    if not summary["checked"]:
        return {**summary, "outcome": "WRONG",
                "detail": "ran under CP without being checked: hf_ring must refuse a family it has not read"}
    errs = record["errors_by_tensor"]
    worst = max((n for n in errs if n != "logits"), key=errs.get)
    detail = (f"{dtype}logits {errs['logits']:.1e}, worst gradient {errs[worst]:.1e} ({worst}), "
              f"{len(errs) - 1} gradients; no CP: logits {record['no_cp']:.1e}")
    exact = max(*errs.values(), record["no_cp"]) <= tol
    return {**summary, "outcome": "exact" if exact else "WRONG", "detail": detail}


def run_sweep(names: Optional[list[str]] = None) -> dict[str, dict[str, Any]]:
    """Every family's summary, by name."""
    from distributed import run_world

    names = family_names() if names is None else names
    records = run_world(CP, _rank_main, names)[0]
    return {r["name"]: summarize(r) for r in records}


def verdict(summary: dict[str, Any]) -> tuple[str, str]:
    """("ok" | "fail", message): exact, refused and not swept are ok; WRONG and error fail."""
    if summary["outcome"] in ("exact", "refused", "not swept"):
        return "ok", summary["detail"]
    return "fail", f"{summary['name']} is {summary['outcome']}: {summary['detail']}"


# --------------------------------------------------------------------------- the record and the table


def judge(summary: dict[str, Any], recorded: Optional[dict[str, dict[str, str]]]) -> tuple[str, str]:
    """("ok" | "fail", message): the verdict, then (with a record) the ratchet."""
    kind, message = verdict(summary)
    if kind == "ok" and recorded is not None:
        kind, message = sweep_ratchet.compare(summary, recorded, record=outcome_record, paths=("cp",),
                                              update=UPDATE, expected_json=EXPECTED_JSON)
    return kind, message or summary["detail"]


def outcome_record(summary: dict[str, Any]) -> Optional[dict[str, str]]:
    """The ratchet's record of a family: ``{"cp": "exact" | "refused: <key>" | "not swept: <key>"}``."""
    if summary["outcome"] not in ("exact", "refused", "not swept"):
        return None
    if summary["outcome"] == "exact":
        return {"cp": "exact"}
    return {"cp": f"{summary['outcome']}: {sweep_ratchet.reason_key(summary['detail'])}"}


def markdown_table(results: dict[str, dict[str, Any]], seconds: float) -> str:
    import transformers

    counts = {o: sum(r["outcome"] == o for r in results.values()) for o in OUTCOMES}
    lines = [
        f"Generated by `python tests/vlm_sweep.py --write-table` on transformers {transformers.__version__}, "
        f"torch {torch.__version__}: cp={CP} (zigzag), {vlm_cases.ROWS} rows of {vlm_cases.SEQ} tokens, against "
        f"one process with SDPA on the full batch; tolerance {TOL:g} relative on the logits and every gradient "
        f"(float64 and {TOL64:g} for {', '.join(FLOAT64)}). "
        "Counts: " + ", ".join(f"{o} {counts[o]}" for o in OUTCOMES) + f"; {seconds:.0f} s on this machine.",
        "",
        "| family | outcome | what was checked, or why |",
        "| --- | --- | --- |",
    ]
    for name, r in results.items():
        detail = r["detail"] if len(r["detail"]) <= 220 else r["detail"][:217] + "..."
        lines.append(f"| {name} | {r['outcome']} | {detail.replace('|', '/')} |")
    return "\n".join(lines)


def write_table(results: dict[str, dict[str, Any]], seconds: float, path: str = DOC) -> None:
    with open(path) as f:
        text = f.read()
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    with open(path, "w") as f:
        f.write(text[:start] + "\n" + markdown_table(results, seconds) + "\n" + text[end:])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-table", action="store_true", help="rewrite the table in docs/multimodal.md")
    parser.add_argument("--write-expected", action="store_true", help=f"record the outcomes in {EXPECTED_JSON}")
    parser.add_argument("--only", nargs="+", help="run only these families")
    args = parser.parse_args(argv)
    import transformers

    if args.write_expected and transformers.__version__ != WRITTEN_FOR:
        parser.error(f"the recorded outcomes are for transformers {WRITTEN_FOR}, not {transformers.__version__}")
    started = time.perf_counter()
    results = run_sweep(args.only)
    seconds = time.perf_counter() - started
    # What is being recorded is not compared with the record it replaces.
    recorded = None if args.write_expected else sweep_ratchet.load(EXPECTED_JSON)["families"]
    judged = {name: judge(r, recorded) for name, r in results.items()}
    for name, (kind, message) in judged.items():
        first = message.splitlines()[0] if message else ""
        print(f"{name:26s} {results[name]['outcome']:9s} {kind:4s} {results[name]['seconds']:4.1f}s  {first[:200]}")
    failed = sum(kind == "fail" for kind, _ in judged.values())
    print(f"{len(results)} families in {seconds:.0f} s; {failed} not as expected")
    if args.write_table:
        write_table(results, seconds)
        print(f"wrote the table in {DOC}")
    if args.write_expected:
        changed = sweep_ratchet.write(results, transformers.__version__, merge=args.only is not None,
                                      path=EXPECTED_JSON, record=outcome_record)
        print(f"wrote {EXPECTED_JSON}; records changed: {', '.join(changed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
