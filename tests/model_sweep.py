"""The model sweep: every causal-LM family of the installed transformers under ``ring_flash``,
each exact against one process on the full sequence, or refused.

Why: a model that trains under context parallelism must compute the same function as
without it (DESIGN.md: exactness is the contract; refuse, never fall back silently). The
tests of ``ring_flash`` cover a few families by name; a user loads whatever transformers
knows. Tried that way (issue 10), a quarter of the families trained silently wrong: token
mixers other than attention, length-dependent RoPE, windows applied only through the mask,
attention sinks. This sweep runs them all, so that each fix shows up as a family turning
"exact" or "refused", and a new silent failure fails the suite.

For each family (``tests/model_sweep_configs.py`` builds the tiny configs), in one spawned
gloo world of 2 ranks shared by all families (spawning is the slow part), each family's
failure caught on its own:

- reference: one process, ``attn_implementation="sdpa"`` (``"eager"`` where transformers
  refuses SDPA for the model), the full 32-token rows, ``position_ids`` 0..31;
- CP: ``setup_context_parallel(2)``, a ``ring_flash`` model with the same weights, each rank
  its zigzag shard of the ids and of the global ``position_ids``; the loss is a fixed
  random weighting of the logits, so that its sum over the ranks is the full-sequence loss;
- no CP: ``ring_flash`` in one process without a CP state, on the full rows.

Outcomes: ``exact`` (logits, loss and every parameter's gradient within ``TOL``),
``refused`` (an error raised by hf_ring on every rank, or transformers refusing to create
the model with ``ring_flash``), ``WRONG`` (ran, outside tolerance: silently wrong),
``error`` (any other exception), ``skipped`` (not a decoder-only text LM, or its modeling
code needs a package that is not installed). ``EXPECTED`` below lists the families whose
outcome is known to be WRONG or an error today, with the reason; ``tests/test_model_sweep.py``
fails on any other WRONG or error, and on a listed family whose outcome changed.

Which of exact or refused each family is, and why, is checked in
(``tests/model_sweep_expected.json``, see ``tests/sweep_ratchet.py``): a family that moves
between them fails the test until the record is updated in the same change.

``python tests/model_sweep.py --write-table`` runs the sweep and writes
``tests/model_sweep_results.md``; ``--write-expected`` records the outcomes it found
(with ``--only NAME ...``, which runs some families: theirs only).
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import os
import sys
import time
import traceback
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sweep_ratchet  # noqa: E402
from closeness import rel_err  # noqa: E402
from model_sweep_configs import NOT_SWEPT, SEQ, WRITTEN_FOR, build_config, family_names, model_type_of  # noqa: E402

CP = 2
BATCH = 2
# Relative error (norm of the difference / norm of the reference) allowed on the logits and
# each gradient, and on the loss (against the sum of its terms' magnitudes, see compare).
# The ring computes the same sums as one process in another order and merges them through
# log-sum-exp, in float32: over the exact families of this sweep the worst is 5e-7 on the
# logits and 2e-6 on a gradient. 1e-4 leaves 50x for float32 noise in deeper or stranger
# stacks; the silently wrong families are 3e-4 and up on the logits and 1.7e-2 and up on
# their worst gradient, so the gap between the two is wide.
TOL = 1e-4
# A gradient whose reference norm is below this fraction of the largest one is float noise
# (a parameter the loss barely reaches: relative error is meaningless there); it must
# instead differ by less than TOL times the largest gradient norm.
GRAD_FLOOR = 1e-3
# Configs are checked on the meta device first: a family whose size knobs the tables
# missed fails as an error instead of filling the machine's memory.
MAX_PARAMS = 3_000_000
# The generator state every forward starts from (reference, CP ranks, no CP).
FORWARD_SEED = 20261205
# A rank left waiting in the ring by a peer that failed gives up after this long.
CP_TIMEOUT = timedelta(seconds=60)

RESULTS_MD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_sweep_results.md")
OUTCOMES = ("exact", "refused", "WRONG", "error", "skipped")


@dataclass(frozen=True)
class Expected:
    """A family whose outcome is known not to be exact or refused today."""

    outcome: str  # "WRONG" or "error"
    reason: str
    match: str = ""  # a substring the outcome's detail must contain (which path, which error)


# Families known to be silently wrong or to fail today: none. When this sweep first ran
# (before hf_ring read model features once per forward, computed attention sinks and
# refused keywords it does not compute), 40 families were WRONG and 4 raised errors; each
# is now exact or refused, by reason, in tests/model_sweep_results.md. A family that goes
# wrong again fails the test unless it is listed here, with why.
EXPECTED: dict[str, Expected] = {}


# --------------------------------------------------------------------------- errors

_HF_RING_DIRS: tuple[str, ...] = ()


def _hf_ring_dirs() -> tuple[str, ...]:
    global _HF_RING_DIRS
    if not _HF_RING_DIRS:
        import hf_ring
        import hf_ring.patches

        _HF_RING_DIRS = tuple(
            os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (hf_ring, hf_ring.patches)
        )
    return _HF_RING_DIRS


def _short(path: str) -> str:
    """A frame's file relative to site-packages or the repository (hf_ring/..., patches/...)."""
    if "/site-packages/" in path:
        return path.split("/site-packages/", 1)[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    return path[len(root):] if path.startswith(root) else os.path.basename(path)


def describe_error(exc: BaseException) -> dict[str, Any]:
    """Type, first line, where it was raised, and whether hf_ring raised it on purpose
    (the innermost frame is a ``raise`` statement in hf_ring or its patches)."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    in_hf_ring = [f for f in frames if f.filename.startswith(_hf_ring_dirs())]
    deliberate = (
        last is not None
        and last.filename.startswith(_hf_ring_dirs())
        and (last.line or "").lstrip().startswith("raise")
    )
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return {
        "type": type(exc).__name__,
        "message": message[:300],
        "where": f"{_short(last.filename)}:{last.lineno}" if last else "?",
        "hf_ring_frame": f"{_short(in_hf_ring[-1].filename)}:{in_hf_ring[-1].lineno}" if in_hf_ring else None,
        "by_hf_ring": deliberate,
    }


def _error_text(err: dict[str, Any]) -> str:
    text = f"{err['type']}: {err['message']} [{err['where']}]"
    if err.get("hf_ring_frame") and not err["by_hf_ring"]:
        text += f" (crash inside hf_ring at {err['hf_ring_frame']})"
    return text


# --------------------------------------------------------------------------- models and runs


def _count_params_on_meta(config, implementation: str) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation)
    return sum(p.numel() for p in model.parameters())


def _make_model(config, implementation: str, state_dict=None, seed: int = 0):
    """The tests' tiny_model, in training mode, with the family's default dropout and router
    noise (every forward starts from FORWARD_SEED: see _forward_backward)."""
    from test_hf_attention import tiny_model

    return tiny_model(config, implementation, state_dict, seed).train()


def _reference_model(config, seed: int):
    """SDPA, or eager where transformers refuses SDPA for the model."""
    try:
        return _make_model(config, "sdpa", seed=seed), "sdpa"
    except ValueError as e:
        if "scaled_dot_product_attention" not in str(e) and "sdpa" not in str(e).lower():
            raise
    return _make_model(config, "eager", seed=seed), "eager"


def _takes_position_ids(model) -> bool:
    # A forward without the argument but with **kwargs (Mamba) takes them for hf_ring's guard,
    # which checks the shard's layout from them.
    params = inspect.signature(type(model).forward).parameters.values()
    return any(p.name == "position_ids" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _seed(name: str, offset: int = 0) -> int:
    """A family's own seed: the same numbers whichever families run with it."""
    return zlib.crc32(name.encode()) + offset


def _inputs(name: str, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(_seed(name, 1))
    return torch.randint(3, vocab, (BATCH, SEQ), generator=g)


def _weights(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(_seed(name, 2))
    return torch.randn(shape, generator=g)


def _forward_backward(model, ids, positions, weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits, loss, and every parameter's gradient flattened (zeros where none); the forward
    starts from FORWARD_SEED on every rank, as transformers.set_seed leaves a process, so
    that a family's dropout and router noise draw what one process draws."""
    kwargs = {"position_ids": positions} if positions is not None else {}
    torch.manual_seed(FORWARD_SEED)
    logits = model(input_ids=ids, **kwargs).logits.float()
    loss = (logits.double() * weights.double()).sum()  # float64: no rounding of the sum itself
    loss.backward()
    grads = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for p in model.parameters()
    ]
    return logits.detach(), loss.detach(), torch.cat(grads)


def compare(ref: dict, logits, loss, flat_grads, names_and_sizes) -> dict[str, Any]:
    """Errors of one run against the reference (see TOL and GRAD_FLOOR)."""
    # The loss against the sum of its terms' magnitudes: a weighted sum with random signs
    # can nearly cancel (|loss| 1e-2 of that scale happens), and relative to itself its
    # rounding would then look 100 times larger than the logits' own error.
    scale = (ref["logits"].double() * ref["weights"].double()).abs().sum().item()
    out = {"logits": rel_err(logits, ref["logits"], floor=1e-30), "loss": abs(loss.item() - ref["loss"].item()) / max(scale, 1e-30)}
    worst, worst_name = 0.0, None
    pieces_ref = torch.split(ref["grads"], [n for _, n in names_and_sizes])
    pieces = torch.split(flat_grads, [n for _, n in names_and_sizes])
    norms = [g.double().norm().item() for g in pieces_ref]
    largest = max(norms) if norms else 0.0
    for (name, _), g, g_ref, norm in zip(names_and_sizes, pieces, pieces_ref, norms):
        diff = (g.double() - g_ref.double()).norm().item()
        err = diff / norm if norm >= GRAD_FLOOR * largest and norm > 0 else diff / max(largest, 1e-30)
        if err > worst:
            worst, worst_name = err, name
    out["grad"], out["grad_param"] = worst, worst_name
    out["exact"] = max(out["logits"], out["loss"], out["grad"]) <= TOL
    return out


# --------------------------------------------------------------------------- the world


def _agree(world: int, status: Optional[dict]) -> Optional[dict]:
    """Every rank's status of one step (None: fine); the first problem any rank had."""
    statuses: list[Optional[dict]] = [None] * world
    dist.all_gather_object(statuses, status)
    return next((s for s in statuses if s is not None), None)


def _setup_error(e: Exception) -> dict[str, Any]:
    return {"skip": isinstance(e, ImportError), **describe_error(e)}


def _family_on_rank(name: str, rank: int, run_without_cp: bool, world: int, state) -> dict[str, Any]:
    """Every rank runs this for every family, in the same order: the collectives stay in
    lockstep whatever fails, because every step's outcome is agreed on before the next."""
    import hf_ring

    record: dict[str, Any] = {"name": name, "rank": rank}
    started = time.perf_counter()
    # 1. config, size check on the meta device, reference model (every rank)
    status = None
    try:
        config = build_config(name)
        record["params"] = _count_params_on_meta(config, "eager")
        if record["params"] > MAX_PARAMS:
            raise RuntimeError(f"not tiny: {record['params']} parameters (see tests/model_sweep_configs.py)")
        ref_model, record["reference"] = _reference_model(config, seed=_seed(name))
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        status = _setup_error(e)
    record["setup"] = _agree(world, status)
    if record["setup"] is None:
        # one set of weights on every rank, whatever the initialisation's use of RNGs
        # (the state dict's tensors are the parameters' own storage)
        state_dict = ref_model.state_dict()
        for tensor in state_dict.values():
            dist.broadcast(tensor, src=0)
        # 2. the reference on the full rows (every rank, so that each compares locally)
        try:
            ids = _inputs(name, config.get_text_config().vocab_size)
            positions = torch.arange(SEQ).expand(BATCH, -1) if _takes_position_ids(ref_model) else None
            with torch.no_grad():
                vocab_out = ref_model(input_ids=ids[:, :2]).logits.shape[-1]
            weights = _weights(name, (BATCH, SEQ, vocab_out))
            logits, loss, grads = _forward_backward(ref_model, ids, positions, weights)
            ref = {"logits": logits, "loss": loss, "grads": grads, "weights": weights}
            names_and_sizes = [(n, p.numel()) for n, p in ref_model.named_parameters()]
        except Exception as e:  # noqa: BLE001
            status = _setup_error(e)
        record["setup"] = _agree(world, status)
        del ref_model
    if record["setup"] is not None:
        record["seconds"] = time.perf_counter() - started
        return record

    # 3. CP: each rank its zigzag shard of the ids, the positions and the loss weights
    shard = lambda x: hf_ring.shard_sequence(x, CP, rank) if x is not None else None  # noqa: E731
    out, status = _try_ring(config, state_dict, shard(ids), shard(positions), shard(weights))
    statuses: list[Optional[dict]] = [None] * world
    dist.all_gather_object(statuses, status)
    record["cp"] = {"errors": statuses}
    if all(s is None for s in statuses):
        logits, loss, grads = out
        shards = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(shards, logits)
        dist.all_reduce(loss)
        dist.all_reduce(grads)
        record["cp"].update(compare(ref, hf_ring.unshard_sequence(shards), loss, grads, names_and_sizes))

    # 4. no CP: ring_flash in one process on the full rows, on one rank (they take turns)
    if run_without_cp:
        hf_ring.set_context_parallel_state(None)
        try:
            out, status = _try_ring(config, state_dict, ids, positions, weights)
        finally:
            hf_ring.set_context_parallel_state(state)
        record["nocp"] = {"errors": [status], **(compare(ref, *out, names_and_sizes) if out else {})}
    record["seconds"] = time.perf_counter() - started
    return record


def _try_ring(config, state_dict, ids, positions, weights) -> tuple[Optional[tuple], Optional[dict]]:
    """A ring_flash model's logits, loss and gradients, or what went wrong and at which
    stage ("load": creating the model, "run": forward and backward)."""
    stage = "load"
    try:
        model = _make_model(config, "ring_flash", state_dict)
        stage = "run"
        return _forward_backward(model, ids, positions, weights), None
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        return None, {"stage": stage, **describe_error(e)}


def _rank_main(rank: int, world: int, names: list[str]) -> list[dict[str, Any]]:
    import warnings

    import transformers

    import hf_ring

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    state = hf_ring.setup_context_parallel(CP, timeout=CP_TIMEOUT)
    records = []
    for index, name in enumerate(names):
        records.append(_family_on_rank(name, rank, index % world == rank, world, state))
        gc.collect()
    return records


# --------------------------------------------------------------------------- outcomes


def _transformers_refusal(err: dict[str, Any]) -> bool:
    """transformers' own refusal to create the model with this attention implementation
    (a ValueError naming it), as opposed to a crash while creating it."""
    return err.get("stage") == "load" and err["type"] == "ValueError" and "attn" in err["message"].lower()


def _path_outcome(path: dict[str, Any]) -> tuple[str, str]:
    errors = path["errors"]
    if any(e is not None for e in errors):
        present = [e for e in errors if e is not None]
        if len(present) == len(errors) and all(e["by_hf_ring"] for e in present):
            return "refused", f"{present[0]['type']}: {present[0]['message']}"
        if len(present) == len(errors) and all(_transformers_refusal(e) for e in present):
            return "refused", f"transformers refuses ring_flash: {present[0]['type']}: {present[0]['message']}"
        ranks = [i for i, e in enumerate(errors) if e is not None]
        where = f" (on rank(s) {ranks} only)" if len(present) < len(errors) else ""
        return "error", _error_text(present[0]) + where
    text = f"logits {path['logits']:.1e}, loss {path['loss']:.1e}, grad {path['grad']:.1e}"
    if path["grad_param"] and path["grad"] > TOL:
        text += f" ({path['grad_param']})"
    return ("exact" if path["exact"] else "WRONG"), text


_SEVERITY = {"exact": 0, "refused": 1, "error": 2, "WRONG": 3}


def summarize(name: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One family's outcome from every rank's record."""
    first = ranks[0]
    summary = {"name": name, "model_type": model_type_of(name), "reference": first.get("reference"),
               "params": first.get("params"), "seconds": max(r["seconds"] for r in ranks)}
    setup = first.get("setup")
    if setup is not None:
        if setup["skip"]:
            summary.update(outcome="skipped", detail=f"needs a package that is not installed: {setup['message']}")
        else:
            summary.update(outcome="error", detail=f"could not build or run the reference: {_error_text(setup)}")
        return summary
    nocp = next(r["nocp"] for r in ranks if "nocp" in r)
    paths = {"cp": _path_outcome(first["cp"]), "no CP": _path_outcome(nocp)}
    summary["cp"], summary["nocp"] = first["cp"], nocp
    outcome = max((o for o, _ in paths.values()), key=_SEVERITY.__getitem__)
    detail = "; ".join(f"{path}: {o}, {text}" for path, (o, text) in paths.items())
    summary.update(outcome=outcome, detail=detail, paths=paths)
    return summary


def run_sweep(names: Optional[list[str]] = None) -> dict[str, dict[str, Any]]:
    """Every family's summary, by name; the skipped ones without a run."""
    from distributed import run_world

    names = family_names() if names is None else names
    results: dict[str, dict[str, Any]] = {}
    to_run = []
    for name in names:
        if model_type_of(name) in NOT_SWEPT:
            results[name] = {"name": name, "model_type": model_type_of(name), "outcome": "skipped",
                             "detail": NOT_SWEPT[model_type_of(name)]}
        else:
            to_run.append(name)
    if to_run:
        per_rank = run_world(CP, _rank_main, to_run)
        for i, name in enumerate(to_run):
            results[name] = summarize(name, [records[i] for records in per_rank])
    return {name: results[name] for name in names}


def verdict(summary: dict[str, Any]) -> tuple[str, str]:
    """("ok" | "xfail" | "skip" | "fail", message) for one family against EXPECTED."""
    name, outcome, detail = summary["name"], summary["outcome"], summary.get("detail", "")
    expected = EXPECTED.get(name)
    if outcome == "skipped":
        return "skip", detail
    if expected is None:
        if outcome in ("exact", "refused"):
            return "ok", detail
        return "fail", f"{name} is {outcome}: {detail} (not in EXPECTED of tests/model_sweep.py)"
    if outcome == expected.outcome and (not expected.match or expected.match in detail):
        return "xfail", f"{expected.reason} ({detail})"
    if outcome in ("exact", "refused"):
        return "fail", f"{name} is now {outcome} ({detail}): remove it from EXPECTED in tests/model_sweep.py"
    return "fail", f"{name} was expected {expected.outcome} ({expected.reason}) but is {outcome}: {detail}"


# --------------------------------------------------------------------------- the table


def markdown_table(results: dict[str, dict[str, Any]], seconds: Optional[float] = None) -> str:
    import transformers

    counts = {o: sum(r["outcome"] == o for r in results.values()) for o in OUTCOMES}
    lines = [
        "# Model sweep: every causal-LM family under ring_flash",
        "",
        f"Generated by `python tests/model_sweep.py --write-table` on transformers {transformers.__version__}, "
        f"torch {torch.__version__}: cp={CP} (zigzag) over {SEQ} tokens, batch {BATCH}, against one process on "
        f"the full sequence; tolerance {TOL:g} relative on logits, loss and every gradient "
        "(see TOL in tests/model_sweep.py).",
        "",
        "Counts: " + ", ".join(f"{o} {counts[o]}" for o in OUTCOMES)
        + (f". Sweep time {seconds:.0f} s on this machine." if seconds is not None else "."),
        "",
        "Columns: the outcome; the reference implementation (`eager` where transformers refuses SDPA); each "
        "path's result (relative error of logits and of the worst gradient, or the "
        "first line of the refusal or error); why, for a failure known today (`EXPECTED` in tests/model_sweep.py) "
        "or a family not swept.",
        "",
        "| family | outcome | reference | cp=2 | no CP | why |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        expected = EXPECTED.get(name)
        why = expected.reason if expected is not None else ""
        if "paths" in r:
            cp, nocp = (_cell(*r["paths"][p]) for p in ("cp", "no CP"))
        else:  # skipped, or no run
            cp = nocp = ""
            why = why or r.get("detail", "")
        cells = [name, r["outcome"], r.get("reference") or "", cp, nocp, why]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(outcome: str, text: str, width: int = 160) -> str:
    text = text if len(text) <= width else text[: width - 3] + "..."
    return f"{outcome}: {text}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-table", action="store_true", help=f"write {os.path.relpath(RESULTS_MD)}")
    parser.add_argument("--write-expected", action="store_true",
                        help=f"record the outcomes in {os.path.relpath(sweep_ratchet.EXPECTED_JSON)} "
                        "(with --only: those families' only)")
    parser.add_argument("--only", nargs="+", help="run only these families")
    args = parser.parse_args(argv)
    import transformers

    written_for = transformers.__version__ == WRITTEN_FOR
    if args.write_expected and not written_for:
        parser.error(f"the recorded outcomes are for transformers {WRITTEN_FOR}, not {transformers.__version__}")
    recorded = sweep_ratchet.load()["families"]
    started = time.perf_counter()
    results = run_sweep(args.only)
    seconds = time.perf_counter() - started
    failed = 0
    for name, r in results.items():
        kind, message = verdict(r)
        # What is being recorded is not compared with the record it replaces.
        if kind == "ok" and written_for and not args.write_expected:
            kind, message = sweep_ratchet.compare(r, recorded)
            message = message or r.get("detail", "")
        failed += kind == "fail"
        reference, spent = r.get("reference") or "-", r.get("seconds", 0.0)
        print(f"{name:26s} {r['outcome']:8s} {kind:5s} {reference:6s} {spent:4.1f}s  {message}")
    print(f"{len(results)} families in {seconds:.0f} s; {failed} not as expected")
    if args.write_table:
        with open(RESULTS_MD, "w") as f:
            f.write(markdown_table(results, seconds))
        print(f"wrote {RESULTS_MD}")
    if args.write_expected:
        changed = sweep_ratchet.write(results, transformers.__version__, merge=args.only is not None)
        print(f"wrote {sweep_ratchet.EXPECTED_JSON}; records changed: {', '.join(changed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
