"""A whole hybrid model's training step under context parallelism: time per rank against
the ideal, where the time goes, and the activation memory each rank saves for backward.

Models: Qwen3.5 (gated delta nets, each with its causal conv, between full-attention
layers) and LFM2 (short convolutions between attention layers) by default
(``--families``): the sweep's tiny configs (tests/model_sweep_configs.py) scaled to hidden
256, 4 layers (mixer, attention, mixer, attention), 8 query / 4 KV heads, MLP 512, the
mixers' head sizes scaled with the hidden size (step_world.family_config), a 259-token
vocabulary, float32, built with ``attn_implementation="ring_flash"``. Each configuration
runs forward + backward + AdamW step on its zigzag shard in ``cp`` spawned gloo
processes (benchmarks/step_world.py), for total sequence lengths 4096 and 8192.

Figures, per family, length and cp:

- ``seconds``: the slowest rank's step (median of ``--steps`` after a warm-up; of the
  ``--rounds`` runs of each configuration, interleaved with the others', the fastest), by
  ``--clock``: ``process`` (default: each process's CPU time, which other work on a shared
  machine does not inflate; one thread per process; time blocked on transfers is left
  out, ``comm_wait`` gives it) or ``wall``.
- ``ideal``: the cp=1 step over cp ranks of the same compute, ``t1 * r1 / (cp * r_cp)``
  with ``r`` the cores a process has (its threads; under ``--clock wall`` at most
  ``cores / cp``): ``t1 / cp`` when every process has as many threads (the default, one
  each, and on GPUs one device per rank). The cp=1 reference runs hf_ring's mixer ops in
  one process (the same scan and conv each rank runs, on the full sequence;
  ``mixer_impl="hf_ring"``); transformers' own CPU fallbacks (``torch_chunk_gated_delta_rule``,
  ``causal_conv1d_fn``) are timed too (``transformers`` rows), not used for the ideal.
- ``efficiency`` = ideal / seconds (1.0: CP splits the step perfectly, adds nothing);
  ``efficiency_of_minima`` the same from each run's fastest step (other work on the
  machine only ever adds time).
- where the time goes: every timed step runs with forward hooks and autograd tensor hooks
  timing each layer kind's forward and backward (benchmarks/layer_accounting.py, same
  clock; a few clock readings per layer); the slowest rank's median step, split:
  ``mixers`` (the routed token mixers, their collectives included), ``attention`` (the
  ``self_attn`` modules: ring attention), ``grad_all_reduce`` (summing the ranks'
  gradients, one all-reduce per parameter), ``optimizer`` (AdamW's step), ``rest`` (that
  step's time minus all of those: MLPs, norms, embeddings, LM head and loss); mixers,
  attention and rest each with its own efficiency against the cp=1 median step's same kind (the
  all-reduce and the optimizer do not split across ranks: a fixed cost per rank).
- activation memory: the bytes of tensors saved for backward in one forward (storages
  counted once; parameters left out; custom autograd functions' ``ctx`` tensors
  included), of the whole model and of the mixer layers alone, on the rank that saves
  most, and their ratio to cp=1's (ideal 1/cp).

    python benchmarks/hybrid_step.py --out benchmarks/results             # ~9 min on 2 shared cores
    python benchmarks/hybrid_step.py --cp-sizes 1 2 4 --seq-lens 8192
    python benchmarks/hybrid_step.py --clock wall --threads 2             # training_speed.py's threads
    python benchmarks/hybrid_step.py --quick                              # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plotting import new_axes, save  # noqa: E402
from step_world import StepConfig, run_step  # noqa: E402

FAMILIES = ("qwen3_5_text", "lfm2")
MODEL = dict(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8, num_kv_heads=4)
KINDS = ("mixers", "attention", "grad_all_reduce", "optimizer", "rest")
PER_TOKEN = ("mixers", "attention", "rest")  # kinds whose work splits across the ranks
MiB = 2 ** 20
LISTED = 12


def _kind_seconds(acc: dict, cpu: bool) -> dict:
    """Seconds of one rank's step by kind (``rest``: what the others leave)."""
    suffix, clock = ("_cpu", "cpu") if cpu else ("", "wall")
    out = {k: acc["layer_seconds"][k]["forward" + suffix] + acc["layer_seconds"][k]["backward" + suffix]
           for k in ("mixers", "attention")}
    out.update({k: v[clock] for k, v in acc["phase_seconds"].items()})
    out["rest"] = acc["step"][clock] - sum(out.values())
    return {**out, "step": acc["step"][clock]}


def _median_step(steps: list[dict], cpu: bool) -> dict:
    by_time = sorted((_kind_seconds(a, cpu) for a in steps), key=lambda k: k["step"])
    return by_time[len(by_time) // 2]  # the step run_step's median is


def _row(family: str, cp: int, impl: str, threads: int, rounds: list[dict], cpu: bool) -> dict:
    """One configuration at one length from its rounds' results (run_step entries): the
    round whose median step is fastest, split by kind as the slowest rank's median step;
    the fastest step of all."""
    key = "cpu_seconds" if cpu else "step_seconds"
    res = min(rounds, key=lambda r: r[key])
    ranks = res["accounting_per_rank"]
    by_kind = max((_median_step(a["step_accounts"], cpu) for a in ranks), key=lambda k: k["step"])
    saved = {k: max(a["saved_bytes"][k] for a in ranks) for k in ("total", "mixers")}
    most = max(ranks, key=lambda a: a["saved_bytes"]["mixers"])["saved_bytes"]
    return {
        "family": family, "cp": cp, "mixer_impl": impl, "seq_len": res["seq_len"], "threads_per_process": threads,
        "seconds": res[key], "seconds_per_round": [r[key] for r in rounds],
        "seconds_min": min(r[key + "_min"] for r in rounds),
        "wall_seconds": res["step_seconds"], "cpu_seconds": res["cpu_seconds"],
        "comm_wait_seconds": res["comm_wait_seconds"],
        "kind_seconds": {k: by_kind[k] for k in KINDS},
        "kind_share": {k: by_kind[k] / by_kind["step"] for k in KINDS},
        "saved_bytes": saved,
        "saved_bytes_per_rank": [{k: a["saved_bytes"][k] for k in ("total", "mixers")} for a in ranks],
        # (shape, dtype, bytes) of the largest storages the mixers save, on the rank saving most
        "mixer_storages_top": most["mixer_storages"][:LISTED],
    }


def _cores_per_process(threads: int, cp: int, cores: int, cpu: bool) -> float:
    # CPU time counts what a process got whoever shares its cores; wall time does not.
    return threads if cpu else min(threads, cores / cp)


def _saved_ratios(row: dict, one: dict) -> dict:
    return {k: row["saved_bytes"][k] / one["saved_bytes"][k] if one["saved_bytes"][k] else None
            for k in ("total", "mixers")}


def _derive(rows: list[dict], cores: int, cpu: bool) -> None:
    """Ideal, efficiencies and memory ratios of every row, against its cp=1 hf_ring row."""
    cp1 = {(r["family"], r["seq_len"], r["mixer_impl"]): r for r in rows if r["cp"] == 1}
    for r in rows:
        b = cp1[(r["family"], r["seq_len"], "hf_ring")]
        scale = (_cores_per_process(b["threads_per_process"], 1, cores, cpu)
                 / (r["cp"] * _cores_per_process(r["threads_per_process"], r["cp"], cores, cpu)))
        r["ideal_seconds"] = b["seconds"] * scale
        r["efficiency"] = r["ideal_seconds"] / r["seconds"]
        r["efficiency_of_minima"] = b["seconds_min"] * scale / r["seconds_min"]
        r["kind_efficiency"] = {k: b["kind_seconds"][k] * scale / r["kind_seconds"][k] for k in PER_TOKEN}
        r["saved_ratio_to_cp1"] = _saved_ratios(r, b)
        t = cp1.get((r["family"], r["seq_len"], "transformers"))
        if t is not None:
            r["saved_ratio_to_transformers_cp1"] = _saved_ratios(r, t)


def _print(rows: list[dict], clock: str) -> None:
    print(f"\n{clock} clock; efficiency = ideal / seconds; saved = bytes saved for backward per rank (MiB), "
          "x cp1 = ratio to cp=1 (hf_ring mixers)")
    print("shares of the step: mixers / attention / gradient all-reduce / optimizer / rest (%); "
          "eff per kind: mixers / attention / rest")
    print(f"{'family':>13} {'seq':>5} {'cp':>2} {'mixers':>12} {'thr':>3} {'seconds':>8} {'ideal':>7} {'eff':>5} "
          f"{'(min)':>5} {'wait%':>5} {'shares %':>24} {'eff per kind':>14} {'saved mix':>9} {'x cp1':>5} "
          f"{'saved all':>9} {'x cp1':>5}")
    for r in rows:
        shares = "/".join(f"{100 * r['kind_share'][k]:.0f}" for k in KINDS)
        kinds = "/".join(f"{r['kind_efficiency'][k]:.2f}" for k in PER_TOKEN)
        ratio = r["saved_ratio_to_cp1"]
        wait = 100 * r["comm_wait_seconds"] / r["wall_seconds"]
        print(f"{r['family']:>13} {r['seq_len']:>5} {r['cp']:>2} {r['mixer_impl']:>12} {r['threads_per_process']:>3} "
              f"{r['seconds']:>8.3f} {r['ideal_seconds']:>7.3f} {r['efficiency']:>5.2f} "
              f"{r['efficiency_of_minima']:>5.2f} {wait:>5.1f} {shares:>24} {kinds:>14} "
              f"{r['saved_bytes']['mixers'] / MiB:>9.1f} {ratio['mixers'] or 0:>5.3f} "
              f"{r['saved_bytes']['total'] / MiB:>9.1f} {ratio['total']:>5.3f}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2], help="cp=1 (the reference) always runs")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192], help="total tokens per sequence")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of the cp=1 process; a cp rank gets max(1, threads // cp)")
    ap.add_argument("--clock", default="process", choices=["process", "wall"])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="every configuration runs once per round, the cp sizes of a family one after another")
    ap.add_argument("--no-transformers-baseline", action="store_true",
                    help="skip timing cp=1 with transformers' own mixer functions (first round only)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seq_lens, args.steps, args.rounds = [512], 1, 1
    cpu = args.clock == "process"
    if cpu and args.threads != 1:
        ap.error("--clock process counts one thread per process (several would add their spin-waits): "
                 "pass --threads 1, or --clock wall")
    from tqdm import tqdm

    cores = os.cpu_count() or 1
    seqs = tuple(sorted(args.seq_lens))
    runs = [(1, "hf_ring")] + ([] if args.no_transformers_baseline else [(1, "transformers")])
    runs += [(cp, "hf_ring") for cp in sorted(set(args.cp_sizes) - {1})]  # under CP the routed mixers run hf_ring's
    configs = [(family, cp, impl) for family in args.families for cp, impl in runs]
    # transformers' own mixers are timed for reference, in the first round only
    jobs = [(r, c) for r in range(args.rounds) for c in configs if r == 0 or c[2] == "hf_ring"]
    results: dict[tuple, list] = {}
    for rnd, (family, cp, impl) in tqdm(jobs, desc="runs", unit="run"):
        cfg = StepConfig(cp_size=cp, seq_lens=seqs, steps=args.steps, warmup=0 if args.quick else 1,
                         threads_per_process=max(1, args.threads // cp), family=family, account_layers=True,
                         mixer_impl=impl if cp == 1 else "transformers", **MODEL)  # (a cp=1 option)
        results.setdefault((family, cp, impl), []).append(run_step(cfg))
        tqdm.write(f"round {rnd}: {family} cp={cp} {impl}: "
                   + ", ".join(f"{res['seq_len']}: {res['cpu_seconds' if cpu else 'step_seconds']:.2f} s"
                               for res in results[(family, cp, impl)][-1]))
    rows = [_row(family, cp, impl, max(1, args.threads // cp), [r[i] for r in rounds], cpu)
            for (family, cp, impl), rounds in results.items() for i in range(len(seqs))]
    _derive(rows, cores, cpu)
    _print(rows, args.clock)
    result = {"device": "cpu", "cores": cores, "clock": args.clock, "threads": args.threads, "steps": args.steps,
              "rounds": args.rounds, "model": MODEL, "families": args.families, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hybrid_step.json"), "w") as f:
        json.dump(result, f, indent=2)
    _plot(rows, args.clock, os.path.join(args.out, "hybrid_step.png"))
    return result


NAMES = {"qwen3_5_text": "Qwen3.5", "lfm2": "LFM2"}
PLOTTED = {"mixers": ("mixers",), "attention": ("attention",),
           "all-reduce + optimizer": ("grad_all_reduce", "optimizer"), "rest": ("rest",)}


def _plot(rows: list[dict], clock: str, path: str) -> None:
    """Per-rank step time by kind (stacked), the ideal as a black tick, every row of hf_ring's mixers."""
    fig, ax = new_axes()
    shown = [r for r in rows if r["mixer_impl"] == "hf_ring"]
    labels = [f"{NAMES.get(r['family'], r['family'])}\n{r['seq_len'] // 1024}k cp{r['cp']}" for r in shown]
    bottom = [0.0] * len(shown)
    for name, kinds in PLOTTED.items():
        # The kinds' shares of the slowest rank's median step.
        heights = [r["seconds"] * sum(r["kind_share"][k] for k in kinds) for r in shown]
        ax.bar(labels, heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylim(0, 1.5 * max(bottom))  # room for the legend above the bars
    ax.scatter(labels, [r["ideal_seconds"] for r in shown], marker="_", s=400, color="black", zorder=3,
               label="ideal (cp=1 / cp)")
    for i, r in enumerate(shown):
        if r["cp"] > 1:
            ax.text(i, r["seconds"], f"eff {r['efficiency']:.2f}\nmixer mem x{r['saved_ratio_to_cp1']['mixers']:.2f}",
                    ha="center", va="bottom", fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    save(fig, ax, path, "Hybrid training step per rank (efficiency, mixer memory vs cp=1)", "",
         f"step {'CPU ' if clock == 'process' else ''}seconds, slowest rank")


if __name__ == "__main__":
    main()
