"""Fit ``pattern="auto"``'s cost model for packed rows: the ring against the all-gather.

Times both patterns on the same packed rows (the virtual ring of ring_efficiency.py, every
rank in this process, the two interleaved in one run), for several document mixes and cp
sizes, forward+backward, and fits :class:`hf_ring.patterns.auto.PackedCost` (seconds per
unit of each term of :func:`hf_ring.patterns.auto.packed_terms`) to the slowest rank's
median time by non-negative least squares on relative error. It prints, per row, the
measured and predicted times of both patterns, which one was faster and which one the
model picks; and the coefficients to put in ``PACKED_COSTS``.

    python benchmarks/packed_pattern_cost.py                     # measure, save, fit
    python benchmarks/packed_pattern_cost.py --fit-only          # fit the saved figures again

The mixes (``--mixes``): ``default`` (5 documents, 40/25/20/10/5 %), ``equal:N`` (N
documents of one length), ``uneven:N`` (N documents of drawn lengths, seeded).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ring_efficiency import BenchConfig, group_units, measure_group  # noqa: E402

from hf_ring.patterns.auto import PackedCost, packed_seconds, packed_terms  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "packed_pattern_cost.jsonl")
MIXES = ("default", "equal:64", "uneven:64", "equal:16", "uneven:16", "equal:2")
PATTERNS = {"packed": "ring", "packed_allgather": "allgather"}


def row_terms(row: dict) -> dict[str, float]:
    """The measured row's terms, for its pattern."""
    local = tuple(n // row["cp"] for n in row["doc_lens"])
    return packed_terms(local, row["cp"], row["heads"], row["kv_heads"], row["head_dim"])[PATTERNS[row["layout"]]]


def mix_config(mix: str, base: BenchConfig) -> BenchConfig:
    if mix == "default":
        return dataclasses.replace(base, docs=0, uneven=False)
    kind, _, count = mix.partition(":")
    if kind not in ("equal", "uneven") or not count.isdigit():
        raise ValueError(f"a mix is 'default', 'equal:N' or 'uneven:N', got {mix!r}")
    return dataclasses.replace(base, docs=int(count), uneven=kind == "uneven")


def _nnls(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """argmin ||a x - y|| over x >= 0: every subset of the columns solved unconstrained, the
    best whose solution is non-negative kept (three columns: seven subsets)."""
    best, best_err = torch.zeros(a.shape[1], dtype=a.dtype), float("inf")
    for size in range(1, a.shape[1] + 1):
        for subset in itertools.combinations(range(a.shape[1]), size):
            sol = torch.linalg.lstsq(a[:, subset], y[:, None]).solution[:, 0]
            err = float(((a[:, subset] @ sol - y) ** 2).sum())
            if (sol >= 0).all() and err < best_err:
                best = torch.zeros(a.shape[1], dtype=a.dtype)
                best[list(subset)] = sol
                best_err = err
    return best


def fit(rows: list[dict], source: str) -> PackedCost:
    """Each pattern's coefficients by non-negative least squares on relative error (each
    row's residual over its measured time) against the slowest rank's median time."""
    per_pattern = {}
    for pattern in PATTERNS.values():
        mine = [r for r in rows if PATTERNS[r["layout"]] == pattern]
        names = list(row_terms(mine[0]))
        y = torch.tensor([r["t_slowest_rank_s"] for r in mine], dtype=torch.float64)
        a = torch.tensor([[row_terms(r)[t] for t in names] for r in mine], dtype=torch.float64) / y[:, None]
        per_pattern[pattern] = dict(zip(names, _nnls(a, torch.ones_like(y)).tolist()))
    return PackedCost(per_pattern, source)


def report(rows: list[dict], cost: PackedCost) -> list[dict]:
    """Per measured row (both patterns): measured and predicted seconds, the faster, the pick."""
    by_row: dict[tuple, dict] = {}
    for r in rows:
        key = (r["cp"], tuple(r["doc_lens"]))
        by_row.setdefault(key, {})[PATTERNS[r["layout"]]] = r
    out = []
    for (cp, doc_lens), pair in sorted(by_row.items()):
        if set(pair) != set(PATTERNS.values()):
            continue
        measured = {p: r["t_slowest_rank_s"] for p, r in pair.items()}
        local = tuple(n // cp for n in doc_lens)
        any_row = next(iter(pair.values()))
        terms = packed_terms(local, cp, any_row["heads"], any_row["kv_heads"], any_row["head_dim"])
        predicted = {p: packed_seconds(cost, p, terms[p]) for p in measured}
        out.append({"cp": cp, "docs": len(doc_lens), "mix": any_row.get("mix"), "measured_s": measured,
                    "predicted_s": predicted, "faster": min(measured, key=measured.get),
                    "picked": min(predicted, key=predicted.get),
                    "relative_errors": {p: predicted[p] / measured[p] - 1 for p in measured}})
    return out


def measure(a: argparse.Namespace) -> list[dict]:
    from tqdm import tqdm

    base = BenchConfig(a.heads, a.kv_heads, a.head_dim, repeats=a.repeats, warmup=1)
    groups = [(cp, mix) for cp in a.cp for mix in a.mixes]
    ticks = sum((base.warmup + a.repeats) * group_units(cp, list(PATTERNS), base.kernel()) for cp, _ in groups)
    rows = []
    with tqdm(total=ticks, desc="packed pattern cost", file=sys.stderr) as bar:
        for cp, mix in groups:
            for r in measure_group(cp, a.seq_per_rank, list(PATTERNS), mix_config(mix, base), bar.update):
                if r["pass"] == "forward+backward":
                    rows.append({**r, "mix": mix})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seq-per-rank", type=int, default=2048)
    p.add_argument("--mixes", nargs="+", default=list(MIXES))
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--out", default=RESULTS, help="where the measured rows go (JSON lines)")
    p.add_argument("--fit-only", action="store_true", help="fit the rows already saved at --out")
    a = p.parse_args(argv)
    for mix in a.mixes:
        mix_config(mix, BenchConfig())  # a bad mix fails before any measurement
    torch.set_num_threads(a.threads)
    if a.fit_only:
        with open(a.out) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        rows = measure(a)
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    cost = fit(rows, f"fitted to {os.path.relpath(a.out)}")
    print(f"# {len(rows)} rows; threads {rows[0]['threads']}, clock {rows[0]['clock']}")
    print("| cp | mix | docs | ring ms (predicted) | all-gather ms (predicted) | faster | picked |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    reported = report(rows, cost)
    for r in reported:
        m, pr = r["measured_s"], r["predicted_s"]
        print(f"| {r['cp']} | {r['mix']} | {r['docs']} | {m['ring'] * 1e3:.1f} ({pr['ring'] * 1e3:.1f}) | "
              f"{m['allgather'] * 1e3:.1f} ({pr['allgather'] * 1e3:.1f}) | {r['faster']} | {r['picked']} |")
    errors = [abs(e) for r in reported for e in r["relative_errors"].values()]
    print(f"# relative error of the predictions: median {sorted(errors)[len(errors) // 2]:.3f}, max {max(errors):.3f}")
    coefficients = {p: {t: float(f"{c:.4g}") for t, c in terms.items()} for p, terms in cost.per_pattern.items()}
    print(f"PackedCost({coefficients}, source={cost.source!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
