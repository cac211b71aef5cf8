"""The README's headline plots, drawn from the committed results (nothing is measured here).

- ``efficiency_by_layout.png``: forward+backward efficiency of the ring against cp, one line
  per layout (``results/ring_efficiency_default.jsonl``: the virtual ring, 2048 tokens per
  rank, 2 threads, wall clock);
- ``efficiency_by_pattern.png``: the same for each pattern on zigzag rows
  (``results/pattern_efficiency.jsonl``: 1024 tokens per rank, one thread, process clock);
- ``packed_placement.png``: packed rows' attention efficiency at cp 2 and 4 under each
  placement (``sharded``, ``by_length``, ``auto``) on placement.py's four mixes
  (``results/placement.jsonl``'s virtual rows: each rank's compute, one thread, process clock).

The memory plot beside them in the README is ``memory_scaling.py``'s own. Run again after
either results file changes:

    python benchmarks/headline_plots.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plotting import new_axes, save  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SOURCES = {
    "efficiency_by_layout.png": ("ring_efficiency_default.jsonl", "layout"),
    "efficiency_by_pattern.png": ("pattern_efficiency.jsonl", "pattern"),
}


def series(path: str, key: str) -> dict[str, dict[int, float]]:
    """Forward+backward efficiency by ``key`` (layout or pattern), then by cp, from the JSON
    lines at ``path`` (rows a benchmark skipped are left out)."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row.get("pass") == "forward+backward":
                out[row[key]][row["cp"]] = row["efficiency"]
    return dict(out)


def conditions(path: str) -> str:
    with open(path) as f:
        row = json.loads(f.readline())
    return (f"{row['seq_per_rank']} tokens per rank, {row['heads']}/{row['kv_heads']} heads of {row['head_dim']}, "
            f"{row['dtype']}, {row['threads']} thread(s), {row['clock']} clock")


def plot(name: str, results: str, out_dir: str) -> dict[str, dict[int, float]]:
    source, key = SOURCES[name]
    path = os.path.join(results, source)
    data = series(path, key)
    fig, ax = new_axes()
    for label, by_cp in data.items():
        cps = sorted(by_cp)
        ax.plot(cps, [by_cp[c] for c in cps], marker="o", label=label)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xticks(sorted({c for by_cp in data.values() for c in by_cp}))
    ax.set_ylim(0, 1.2)
    save(fig, ax, os.path.join(out_dir, name), f"Forward+backward efficiency by {key} (CPU, virtual ring)\n"
         f"{conditions(path)}", "cp", "efficiency (1 = ideal)")
    return data


PLACEMENT_SOURCE = "placement.jsonl"


def plot_placement(results: str, out_dir: str) -> dict[tuple[str, int], dict[str, float]]:
    """``packed_placement.png``: bars of attention efficiency, a group per (mix, cp), a bar per
    placement, from the virtual attention rows of placement.jsonl."""
    rows = []
    with open(os.path.join(results, PLACEMENT_SOURCE)) as f:
        rows = [r for r in map(json.loads, f) if r["part"] == "attention" and r["mode"] == "virtual"]
    data: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for r in rows:
        data[(r["mix"], r["cp"])][r["placement"]] = r["efficiency"]
    groups = sorted(data, key=lambda mc: (mc[1], [r["mix"] for r in rows].index(mc[0])))
    placements = list(dict.fromkeys(r["placement"] for r in rows))
    fig, ax = new_axes()
    width = 0.8 / len(placements)
    for i, pl in enumerate(placements):
        ax.bar([g + (i - (len(placements) - 1) / 2) * width for g in range(len(groups))],
               [data[mc].get(pl, 0.0) for mc in groups], width, label=pl)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\ncp {c}" for m, c in groups], fontsize=8)
    ax.set_ylim(0, 1.2)
    first = rows[0]
    save(fig, ax, os.path.join(out_dir, "packed_placement.png"),
         f"Packed rows: attention efficiency by placement\n(CPU, each rank's compute; {first['heads']}/"
         f"{first['kv_heads']} heads of {first['head_dim']}, {first['dtype']}, 4096-token rows)", "mix, cp",
         "efficiency (1 = ideal)")
    return dict(data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=RESULTS, help="where the committed results are read")
    p.add_argument("--out", default=RESULTS, help="where the PNGs are written")
    a = p.parse_args(argv)
    for name in SOURCES:
        plot(name, a.results, a.out)
    plot_placement(a.results, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
