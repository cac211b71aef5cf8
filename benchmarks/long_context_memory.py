"""Peak memory per process against tokens per process, for a 259- and a 128,256-token
vocabulary, with and without each long-context option (chunked loss, checkpoints offloaded
to host memory, tiled MLP); then the fitted memory model (memory_model.py), the longest
sequence per process under a budget, and the Llama-3-8B projection.

Every configuration runs in a fresh process (step_world.py, cp_size 1: the memory per
process depends on the tokens it holds, which is ``seq_len / cp_size`` under CP), two
training steps (forward, backward, AdamW) per length, lengths in increasing order. The
figure is the peak of the second step's forward + backward (AdamW's moments exist then, as
in any step but the first; ``peak_mb``); the optimizer step's own peak is kept beside it
(``peak_step_mb``: for the tiny model with a 128K vocabulary, AdamW's temporaries over the
embeddings can exceed the activations, which says nothing about a large sharded model).
Peak memory on CPU is the peak resident set minus the resident set after start-up (see
step_world.py), with glibc's mmap threshold pinned at 64 KiB (``MALLOC_MMAP_THRESHOLD_``, set
here for the spawned processes): every tensor above it gets its own mapping, returned to the
system when freed, so the resident set follows the live tensors (with glibc's default
sliding threshold, freed tensors stay in the heap and the peak resident set was up to twice
the live memory, and noisy). On CPU "offloading" the checkpoints to host memory moves nothing (the host
is the device), so the offload runs measure plain checkpointing, and the bytes the offload
would move off a GPU are counted by its hooks (``offloaded_peak_mb``).

    python benchmarks/long_context_memory.py --out benchmarks/results          # ~30 min on a busy 2-core machine
    python benchmarks/long_context_memory.py --refit --out benchmarks/results  # fit + plots only

Writes long_context_memory.json (points, fit, budget table, projection) and
long_context_memory.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from memory_model import LLAMA3_8B, OPTION_SETS, Shape, fit, longest_tokens, predict, project  # noqa: E402
from plotting import new_axes, save  # noqa: E402
from step_world import StepConfig, run_step  # noqa: E402

LLAMA3_VOCAB = 128_256
BYTE_VOCAB = 259
SMALL = Shape(hidden=128, intermediate=256, layers=2, heads=8, kv_heads=4, vocab=BYTE_VOCAB)
# A second shape (wider MLP, more layers) separates per-layer from per-model and hidden-
# from intermediate-sized terms in the fit.
WIDE = Shape(hidden=128, intermediate=768, layers=4, heads=8, kv_heads=4, vocab=BYTE_VOCAB)
TILE = 1024


def sweep(quick: bool) -> list[tuple[Shape, str, tuple[int, ...], int]]:
    """(model shape, option set, tokens per process, cp_size) of every run."""
    short = (2048, 4096, 8192)
    full_logits_128k = (512, 1024, 2048)  # (tokens x 128K) float32 logits: 0.5 GB per copy at 1024
    if quick:
        short = full_logits_128k = (256, 512)
    big_vocab = Shape(**{**asdict(SMALL), "vocab": LLAMA3_VOCAB})
    runs = [(SMALL, name, short, 1) for name in ("none", "chunked", "offload", "offload+tiled", "chunked+offload+tiled")]
    runs += [(big_vocab, "none", full_logits_128k, 1)]
    runs += [(big_vocab, name, short, 1) for name in ("chunked", "chunked+offload+tiled")]
    runs += [(WIDE, name, short, 1) for name in ("none", "offload", "offload+tiled")]
    # Under CP the ring adds per-token buffers (K/V blocks in flight, float32 gradient
    # accumulators): measured once, at cp_size 2, for the model's ring term.
    runs += [(SMALL, "chunked+offload+tiled", short, 2)]
    return runs


def measure(shape: Shape, options: str, tokens: tuple[int, ...], cp: int, threads: int) -> list[dict]:
    flags = OPTION_SETS[options]
    cfg = StepConfig(
        cp_size=cp, seq_lens=tuple(n * cp for n in tokens), steps=1, warmup=1, phase_peaks=True, hidden_size=shape.hidden, num_layers=shape.layers,
        num_heads=shape.heads, num_kv_heads=shape.kv_heads, intermediate_size=shape.intermediate,
        vocab_size=shape.vocab, threads_per_process=max(1, threads // cp), chunked_loss=flags["chunked"],
        offload_checkpoints=flags["offload"], tiled_mlp=TILE if flags["tiled"] else 0,
    )
    return [{"shape": asdict(shape), "options": options, "cp": cp, "tokens": p["seq_len"] // cp,
             "peak_mb": p["peak_backward_mb"], "peak_step_mb": p["peak_step_mb"], "offloaded_peak_mb": p["offloaded_peak_mb"],
             "step_seconds": p["step_seconds"]} for p in run_step(cfg)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--budget-gib", type=float, nargs="+", default=[2.0, 4.0, 8.0, 16.0],
                    help="per-process budgets for the longest sequence")
    ap.add_argument("--refit", action="store_true", help="reuse the measured points of the JSON in --out")
    ap.add_argument("--quick", action="store_true", help="tiny sweep (smoke test)")
    ap.add_argument("--markdown", action="store_true", help="print the README's tables from the JSON in --out")
    args = ap.parse_args(argv)
    if args.markdown:
        with open(os.path.join(args.out, "long_context_memory.json")) as f:
            return markdown(json.load(f))
    path = os.path.join(args.out, "long_context_memory.json")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # read by the spawned processes' glibc
    if args.refit:
        with open(path) as f:
            points = json.load(f)["points"]
    else:
        points = []
        for shape, options, tokens, cp in sweep(args.quick):
            for p in measure(shape, options, tokens, cp, args.threads):
                points.append(p)
                print(f"vocab {shape.vocab:>6} H{shape.hidden} I{shape.intermediate} L{shape.layers} cp{cp} {options:<22} "
                      f"{p['tokens']:>6} tokens: peak {p['peak_mb']:8.1f} MB "
                      f"(with the optimizer step {p['peak_step_mb']:8.1f}; {p['step_seconds']:.1f} s)", flush=True)

    model = fit(points, tile=TILE)
    print("\nmemory model (bytes):", ", ".join(f"{k} {v:.4g}" for k, v in model.items()))
    worst = 0.0
    for p in points:
        p["model_mb"] = predict(model, Shape(**p["shape"]), p["options"], p["tokens"], TILE, p["cp"]) / 2**20
        worst = max(worst, abs(p["model_mb"] - p["peak_mb"]) / p["peak_mb"])
    print(f"largest relative error of the model on the {len(points)} measurements: {worst:.1%}")

    table = []
    for budget_gib in args.budget_gib:
        for options in OPTION_SETS:
            row = {"budget_gib": budget_gib, "options": options}
            for vocab in (BYTE_VOCAB, LLAMA3_VOCAB):
                shape = Shape(**{**asdict(SMALL), "vocab": vocab})
                row[f"peak_mb_at_8192_v{vocab}"] = predict(model, shape, options, 8192, TILE) / 2**20
                row[f"longest_tokens_v{vocab}"] = longest_tokens(model, shape, options, budget_gib * 2**30, TILE)
            row["ratio"] = row[f"longest_tokens_v{LLAMA3_VOCAB}"] / row[f"longest_tokens_v{BYTE_VOCAB}"]
            table.append(row)
    print("\nsmall model, longest tokens per process under a budget (from the model):")
    print(f"{'GiB':>4} {'options':<22} {'vocab 259':>10} {'vocab 128256':>13} {'ratio':>6}")
    for row in table:
        print(f"{row['budget_gib']:>4g} {row['options']:<22} {row['longest_tokens_v259']:>10,.0f} "
              f"{row['longest_tokens_v128256']:>13,.0f} {row['ratio']:>6.2f}")

    projection = project(model, LLAMA3_8B, TILE)
    print("\nLlama-3-8B, FSDP2 + CP over 8 GPUs (tokens per GPU x 8):")
    for row in projection:
        print(f"{row['gpu_gb']:>4} GB {row['options']:<22} {row['activation_dtype']:<8} "
              f"{row['longest_context']:>12,.0f} tokens (host memory for offload {row['host_gb_per_gpu']:.0f} GB per GPU)")

    result = {"malloc_mmap_threshold": os.environ["MALLOC_MMAP_THRESHOLD_"], "points": points, "model": model,
              "tile_tokens": TILE, "budget_gib": args.budget_gib,
              "largest_relative_error": worst, "budget_table": table, "projection": projection}
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    _plot(points, os.path.join(args.out, "long_context_memory.png"))
    return result


def _table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def markdown(result: dict) -> dict:
    """The README's tables: measured peaks, longest tokens under a budget, the projection."""
    print("| vocab | options | " + " | ".join(f"{n:,} tok" for n in (512, 1024, 2048, 4096, 8192)) + " | model, worst |")
    print("|" + " --- |" * 8)
    rows: dict[tuple, dict] = {}
    for p in result["points"]:
        if p["shape"]["layers"] == SMALL.layers:
            rows.setdefault((p["shape"]["vocab"], p["options"], p["cp"]), {})[p["tokens"]] = p
    for (vocab, options, cp), by_n in rows.items():
        cells = [f"{by_n[n]['peak_mb']:.0f}" if n in by_n else "" for n in (512, 1024, 2048, 4096, 8192)]
        worst = max(abs(p["model_mb"] - p["peak_mb"]) / p["peak_mb"] for p in by_n.values())
        label = options + (f", cp {cp}" if cp > 1 else "")
        print(f"| {vocab:,} | {label} | " + " | ".join(cells) + f" | {worst:.1%} |")
    print()
    _table(["budget", "options", "longest, vocab 259", "longest, vocab 128,256", "ratio"],
           [[f"{r['budget_gib']:g} GiB", r["options"], f"{r['longest_tokens_v259']:,.0f}",
             f"{r['longest_tokens_v128256']:,.0f}", f"{r['ratio']:.2f}"] for r in result["budget_table"]])
    print()
    _table(["GPU", "options", "tokens per GPU", "context (8 GPUs)", "host GB per GPU", "context, 2 TB host per node"],
           [[f"{r['gpu_gb']} GB", f"{r['options']} ({r['activation_dtype']})", f"{r['tokens_per_gpu']:,}",
             f"{r['longest_context']:,}", f"{r['host_gb_per_gpu']:.0f}", f"{r['longest_context_2tb_host']:,}"]
            for r in result["projection"]])
    return result


def _plot(points: list[dict], path: str) -> None:
    fig, ax = new_axes()
    series: dict[str, list[dict]] = {}
    for p in points:
        if p["shape"]["layers"] == SMALL.layers and p["cp"] == 1:
            series.setdefault(f"vocab {p['shape']['vocab']:,}, {p['options']}", []).append(p)
    for label, mine in series.items():
        style = "o-" if "128" in label else "s--"
        ax.plot([p["tokens"] for p in mine], [p["peak_mb"] for p in mine], style, label=label, ms=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.legend(fontsize=6)
    save(fig, ax, path, "Peak memory per process (H=128, 2 layers, CPU)", "tokens per process", "peak memory (MB)")


if __name__ == "__main__":
    main()
