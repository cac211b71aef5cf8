"""Generation under context parallelism: prefill time and peak memory per rank at cp 1, 2
and 4, and decode time per token with the sharded and the gathered cache.

Every (cp, prompt length) point runs in fresh spawned gloo processes (one per rank), a
Llama-shaped model in float32, ``ring_flash``. Per rank:

- **prefill**: ``model(prompt, use_cache=True, logits_to_keep=1)`` under ``torch.no_grad()``
  (what ``generate()`` runs first); its wall time, and the resident set's high-water mark
  during it above the resident set before it (``/proc/self/clear_refs`` resets the mark;
  glibc is told to map large tensors apart and return them, so the resident set follows
  the live tensors), which counts the cache built, the activations and the kernels' work
  space;
- **decode**: ``--new-tokens`` greedy steps fed one token at a time from that cache, mean
  wall time per token: ``sharded`` (each step attends every rank's share, one all-gather
  per layer) and ``gathered`` (``ShardedCache(decode="gathered")``: the shares gathered once
  after the prefill, decoding local; its prefill figures include the gather).

cp 1 is one process without CP (transformers' ``DynamicCache``). The figures are per rank,
the slowest rank's time and the largest peak. On a 2-core machine cp 4 oversubscribes the
cores, so its times say little about speed; its memory is what it is.

    python benchmarks/generation.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _hwm_mb() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) / 1024


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 2, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=4096,
                         max_position_embeddings=1 << 20, use_cache=True)
    return LlamaForCausalLM(config).float().eval().requires_grad_(False)


def _run(model, prompt, cache_kwargs, new_tokens: int, cache_name: str) -> dict:
    before = _rss_mb()
    _reset_hwm()
    start = time.perf_counter()
    out = model(prompt, use_cache=True, logits_to_keep=1, **cache_kwargs)
    prefill = time.perf_counter() - start
    peak = _hwm_mb() - before
    cache = out[cache_name]
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(new_tokens):
        out = model(token, use_cache=True, **{cache_name: cache})
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    decode = (time.perf_counter() - start) / new_tokens
    return {"prefill_s": prefill, "prefill_peak_mb": peak, "decode_ms_per_token": decode * 1e3}


def _worker(rank: int, world: int, args, init_file: str, out_dir: str) -> None:
    import transformers

    import hf_ring

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cache_name = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    if world > 1:
        hf_ring.setup_context_parallel(world)
    model = _model(args)
    model.set_attn_implementation("ring_flash")
    prompt = torch.randint(0, 4096, (1, args.length), generator=torch.Generator().manual_seed(1))
    kwargs = {cache_name: hf_ring.ShardedCache(decode="gathered")} if args.mode == "gathered" else {}
    with torch.no_grad():
        row = {"cp": world, "length": args.length, "decode": args.mode,
               **_run(model, prompt, kwargs, args.new_tokens, cache_name)}
    torch.save(row, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # results are on disk; skip a teardown that can abort on gloo's threads


def _point(world: int, args) -> dict:
    """One (cp, length, decode mode) point in fresh processes: the allocator keeps what an
    earlier run freed, which would hide the next run's peak."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, args, os.path.join(tmp, "rdzv"), tmp), nprocs=world, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    figures = ("prefill_s", "prefill_peak_mb", "decode_ms_per_token")
    return {**ranks[0], **{k: max(r[k] for r in ranks) for k in figures}}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--out", default=None, help="folder for generation.jsonl")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 layers, short prompts")
    args = ap.parse_args(argv)
    if args.quick:
        args.lengths, args.layers, args.hidden, args.new_tokens = [256], 2, 64, 4
    from tqdm import tqdm

    # glibc then maps every tensor over 64 KiB on its own and returns it when freed, so the
    # resident set follows the live tensors and a rank's first call does not count the heap's
    # growth (measured at cp 2, 16K tokens: 349 MB without, 176 MB with, for a forward whose
    # later calls peak at 164 MB).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "0")
    rows = []
    points = [(cp, n, mode) for n in args.lengths for cp in args.cp_sizes
              for mode in (("sharded", "gathered") if cp > 1 else ("local",))]
    for cp, length, mode in tqdm(points, desc="generation (one world per point)", unit="point"):
        args.length, args.mode = length, mode
        row = _point(cp, args)
        rows.append(row)
        tqdm.write(f"cp={cp} length={length} decode={mode}: prefill {row['prefill_s']:.2f} s, "
                   f"peak {row['prefill_peak_mb']:.0f} MB per rank, {row['decode_ms_per_token']:.1f} ms/token")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "generation.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    main()
