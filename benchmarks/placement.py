"""Placement by length against sharding every document, on the same packed rows (issue 50).

Two parts, both printed and written to ``benchmarks/results/`` (``--out``):

1. **The cost model's coefficient** (``placement_costs.json``). One process, one thread, the
   example's default model (``examples/finetune_llama_long.py``: a Llama of hidden 128, 2
   layers, 8 / 4 heads of 16, MLP 256, the byte tokenizer's 259 ids) on one document of
   ``n`` tokens, forward + backward, for several ``n``; and one layer's attention alone
   (the same CPU kernel ``ring_flash`` runs). Least squares on
   ``t(n) = c + a * n + b * n^2`` gives ``crossover = a / (2 * b)``: the length at which a
   token's causal attention costs as much as its per-token layers, what
   ``hf_ring.sharding.placement.PlacementCosts(crossover=...)`` takes
   (``work(n) = n + n^2 / (2 * crossover)``, in units of ``a``).

2. **Side by side** (``placement.jsonl``), on the same rows under ``placement="sharded"``
   (every document zigzag-sharded over the group, what ``ring_flash_attn_varlen_func``
   runs) and ``"by_length"`` (``place_by_length``: each document whole on one rank or
   sharded; ``hf_ring.patterns.run.PlacedPlan``: the sharded documents through the ring,
   the rank's whole ones through a plan of one process) and ``"auto"`` (``place_auto``:
   that plan or every document sharded, whichever the cost model with the ring's overhead
   makes cheaper; ``benchmarks/ring_overhead.py`` measures that overhead). Mixes of one row of ``--row``
   tokens: ``short`` (64-token documents), ``five`` (40/25/20/10/5 %, ring_efficiency's
   DOC_FRACTIONS), ``long_tail`` (:func:`long_tail_lens`, seeded) and ``one_long`` (a single
   document).

   - ``attention``: one attention layer, forward + backward through
     ``hf_ring.patterns.run_plan`` with the plans the forward builds (ring pattern;
     ring_efficiency's shape, 8 / 2 heads of 128, float32). ``efficiency`` = the fastest
     one-process way over the whole row (one call per document or one varlen call) / (cp x
     the slowest rank). ``virtual``: one process runs each rank's work in turn (process
     clock, one thread, the reference too; the ring's transfers are in-process copies, so
     this is the ranks' compute alone); ``spawn``: ``cp`` gloo processes, one thread each,
     transfers included; rank 0 times the reference between rounds. Spawned rows give wall
     clock figures (``efficiency``: transfers and waits included, meaningful on an idle
     machine) and CPU-time ones (``efficiency_cpu``, ``throughput_vs_sharded_cpu``: what each
     rank computed, robust to other load on a shared machine, blind to waits for a peer,
     which ``t_ranks_blocked_s`` gives apart).
   - ``step``: a whole training step of the example's default model (``ring_flash``, the
     ``RingDataCollator``'s rows, forward + backward + the gradients' all-reduce over the
     group + AdamW), in the same spawned processes; tokens/s per process and the ratio
     by_length / sharded. Both placements start from the same weights: their first step's
     losses must agree (checked, 1e-5 relative).

   Per row: each rank's median time, the plan's work per rank (its cost model) and
   imbalance, the bytes each rank sends per attention layer (counted on the transport:
   forward + backward), and the documents. Every round runs both placements, the first
   alternating from round to round; the median of ``--repeats`` after a warm-up. The
   attention's out and gradients under both placements, put back in row order, are checked
   against one process (1e-4 relative).

    python benchmarks/placement.py                 # both parts, cp 2 and 4: ~10 min on 2 idle cores
    python benchmarks/placement.py --costs-only    # part 1
    python benchmarks/placement.py --tiny          # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ring_efficiency import DOC_FRACTIONS, DTYPES, Problem, _kernel_unit, _sync, _varlen_unit, time_unit  # noqa: E402
from ring_efficiency import CLOCKS, BenchConfig  # noqa: E402
from pattern_efficiency import Counter, counting_transport  # noqa: E402

from hf_ring.distributed.comm import CommWaitStats, VirtualRing, process_group_transport  # noqa: E402
from hf_ring.kernels import get_backend  # noqa: E402
from hf_ring.patterns import AttentionPlan, run_plan  # noqa: E402
from hf_ring.patterns.run import PlacedPlan  # noqa: E402
from hf_ring.sharding.packed import packed_shard_indices  # noqa: E402
from hf_ring.sharding.placement import PlacementCosts, place_by_length  # noqa: E402
from hf_ring.sharding.placement_auto import place_auto  # noqa: E402

PLACEMENTS = ("sharded", "by_length", "auto")
MIXES = ("short", "five", "long_tail", "one_long")
SHORT_LEN = 64
# The example's default model (examples/finetune_llama_long.py, _default_config): hidden 128,
# 2 layers, heads hidden // 16 = 8, KV heads 4, MLP 2 x hidden, the byte tokenizer's 259 ids.
MODEL = dict(hidden=128, layers=2, vocab=259)


# ------------------------------------------------------------------------------ the mixes


def long_tail_lens(row: int, mult: int, seed: int = 0) -> list[int]:
    """A long-tailed packed row of ``row`` tokens, every length a multiple of ``mult``.

    Long documents, each uniform in [row / 8, row / 2], are drawn (``random.Random(seed)``)
    until they hold at least 60 % of the row; short ones, log-uniform in [32, row / 16], fill
    the rest (the last cut to what is left; a remainder under ``mult`` goes to the one
    before); then the order is shuffled with the same generator. So most documents are
    under 1/8 of the row and a few long ones fill most of it.
    """
    rng = random.Random(seed)
    snap = lambda n, left: min(left, max(mult, round(n / mult) * mult))  # noqa: E731
    lens: list[int] = []
    while sum(lens) < 0.6 * row:
        lens.append(snap(rng.uniform(row / 8, row / 2), row - sum(lens)))
    while sum(lens) < row:
        left = row - sum(lens)
        n = snap(math.exp(rng.uniform(math.log(32), math.log(max(33, row / 16)))), left)
        lens.append(left if left - n < mult else n)
    rng.shuffle(lens)
    return lens


def mix_doc_lens(mix: str, row: int, mult: int) -> list[int]:
    """The row's document lengths for ``mix`` (:data:`MIXES`), multiples of ``mult``."""
    if row % mult:
        raise ValueError(f"--row {row} must be a multiple of {mult} (2 x the largest cp)")
    if mix == "short":
        if row % SHORT_LEN or SHORT_LEN % mult:
            raise ValueError(f"the short mix needs --row a multiple of {SHORT_LEN} and 2 x cp dividing it")
        return [SHORT_LEN] * (row // SHORT_LEN)
    if mix == "five":
        lens = [max(mult, round(f * row / mult) * mult) for f in DOC_FRACTIONS[:-1]]
        return lens + [row - sum(lens)]
    if mix == "long_tail":
        return long_tail_lens(row, mult)
    if mix == "one_long":
        return [row]
    raise ValueError(f"unknown mix {mix!r}; choose from {MIXES}")


def _brief(lens: list[int]) -> object:
    """The lengths, or a summary when there are many equal ones."""
    return lens if len(set(lens)) > 1 or len(lens) <= 4 else f"{len(lens)} x {lens[0]}"


# ---------------------------------------------------------------- part 1: the coefficient


def default_model(seq_len: int, attn: str = "ring_flash", seed: int = 0):
    """The example's default model (float32, training mode)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_ring  # noqa: F401  (registers ring_flash)

    h = MODEL["hidden"]
    heads = max(2, h // 16)
    config = LlamaConfig(vocab_size=MODEL["vocab"], hidden_size=h, intermediate_size=2 * h,
                         num_hidden_layers=MODEL["layers"], num_attention_heads=heads,
                         num_key_value_heads=heads // 2, max_position_embeddings=2 * seq_len,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).train()


def _fit(ns: list[int], ts: list[float]) -> dict:
    """Least squares of ``t = c + a n + b n^2`` in relative terms (each row divided by its
    ``t``: the lengths span 32x, and plain squares would fit the longest alone, leaving the
    short documents the plan mostly places 30 % off); ``crossover = a / (2 b)``."""
    t = torch.tensor(ts, dtype=torch.float64)
    x = torch.tensor([[1.0, n, n * n] for n in ns], dtype=torch.float64) / t[:, None]
    c, a, b = torch.linalg.lstsq(x, torch.ones(len(ns), 1, dtype=torch.float64)).solution[:, 0].tolist()
    pred = [c + a * n + b * n * n for n in ns]
    return {"c_s": c, "a_s_per_token": a, "b_s_per_token2": b,
            "crossover": a / (2 * b) if b > 0 else math.inf,
            "max_rel_residual": max(abs(p - t) / t for p, t in zip(pred, ts))}


def measure_costs(lengths: list[int], repeats: int) -> dict:
    """Part 1 (one thread, process clock): the whole model and one layer's attention alone,
    forward + backward, at each length; both fitted."""
    torch.set_num_threads(1)
    model = default_model(max(lengths))
    cfg = model.config
    kernel = get_backend("auto", torch.device("cpu"), torch.float32)
    scale = 1 / math.sqrt(cfg.head_dim)
    model_s, attn_s = [], []
    for n in lengths:
        ids = torch.randint(3, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        q = torch.randn(1, n, cfg.num_attention_heads, cfg.head_dim)
        k, v = (torch.randn(1, n, cfg.num_key_value_heads, cfg.head_dim) for _ in range(2))
        times = {"model": [], "attn": []}
        for i in range(1 + repeats):  # the first round warms up
            t0 = time.process_time()
            model(input_ids=ids, labels=ids).loss.backward()
            t1 = time.process_time()
            out, lse = kernel.forward(q, k, v, True, scale)
            kernel.backward(out, q, k, v, out, lse, True, scale)
            t2 = time.process_time()
            model.zero_grad(set_to_none=True)
            if i:
                times["model"].append(t1 - t0)
                times["attn"].append(t2 - t1)
        model_s.append(statistics.median(times["model"]))
        attn_s.append(statistics.median(times["attn"]))
        print(f"  n={n:6d}: model fwd+bwd {model_s[-1]:.4f} s, one layer's attention {attn_s[-1]:.4f} s",
              file=sys.stderr, flush=True)
    whole = _fit(lengths, model_s)
    attn = _fit(lengths, attn_s)
    # The same coefficient from the split: per-token work = the model's minus its attention's
    # linear part; quadratic = the layers' attention.
    rest = _fit(lengths, [m - cfg.num_hidden_layers * a for m, a in zip(model_s, attn_s)])
    split = rest["a_s_per_token"] / (2 * cfg.num_hidden_layers * attn["b_s_per_token2"])
    return {"lengths": lengths, "model_s": model_s, "attention_layer_s": attn_s, "fit_model": whole,
            "fit_attention_layer": attn, "fit_model_less_attention": rest, "crossover": whole["crossover"],
            "crossover_from_split": split, "model": MODEL | {"heads": cfg.num_attention_heads,
                                                            "kv_heads": cfg.num_key_value_heads,
                                                            "head_dim": cfg.head_dim},
            "backend": kernel.name, "threads": 1, "clock": "process", "repeats": repeats,
            "default_crossover": PlacementCosts().crossover}


# ----------------------------------------------------------- part 2: the attention's plans


@dataclass
class RankWork:
    """One rank's share of the row under one placement."""

    indices: torch.Tensor  # int64 (local_len,): the global row index of each local token
    plan: object  # AttentionPlan or PlacedPlan
    sent: Optional[Counter]  # the bytes this rank's ring sends (None: no ring)
    work: float  # the cost model's work of this rank
    sharded_tokens: int  # local tokens of sharded documents (the ring's part)


def rank_work(placement: str, doc_lens: list[int], cp: int, rank: int, kernel, scale: float,
              make_transport, costs: PlacementCosts = PlacementCosts()) -> RankWork:
    """Rank ``rank``'s plan, tokens and work under ``placement``; ``make_transport()`` gives
    the ring's transport (real: P2P over the default group; virtual: a ``VirtualRing`` over
    every rank's K/V of the sharded documents), wrapped to count the bytes it sends."""
    def ring_plan(local_docs):
        counter = Counter()
        return AttentionPlan(None, rank, cp, "zigzag", True, scale, kernel, local_doc_lens=tuple(local_docs),
                             transport=counting_transport(make_transport(), counter)), counter

    if placement == "sharded":
        plan, counter = ring_plan(n // cp for n in doc_lens)
        cu = torch.tensor([0, *torch.tensor(doc_lens).cumsum(0).tolist()])
        work = sum(costs.work(n) for n in doc_lens) / cp
        return RankWork(packed_shard_indices(cu, cp, rank), plan, counter, work, sum(doc_lens) // cp)
    p = (place_by_length if placement == "by_length" else place_auto)(tuple(doc_lens), cp, costs=costs)
    sharded, whole = p.sharded_lens, p.whole_lens(rank)
    ring, counter = ring_plan(n // cp for n in sharded) if sharded else (None, None)
    local = AttentionPlan(None, 0, 1, "zigzag", True, scale, kernel, local_doc_lens=tuple(whole)) if whole else None
    plan = PlacedPlan(ring, local, p.sharded_local_len, sum(whole))
    return RankWork(p.local_indices(rank), plan, counter, p.loads[rank], p.sharded_local_len)


def make_row(doc_lens: list[int], cfg: BenchConfig, seed: int = 0) -> Problem:
    """The full row's q, k, v and output gradient ``(1, S, heads, head_dim)``."""
    g = torch.Generator().manual_seed(seed)
    total = sum(doc_lens)
    t = [torch.randn(1, total, h, cfg.head_dim, generator=g).to(device=cfg.device, dtype=DTYPES[cfg.dtype])
         for h in (cfg.heads, cfg.kv_heads, cfg.kv_heads, cfg.heads)]
    return Problem("packed", 1, *t, shards=[], doc_lens=list(doc_lens))


def reference_units(pb: Problem, kernel, scale: float) -> list:
    """The exact ways one process runs the whole row (ring_efficiency's, less the masked SDPA,
    which is quadratic in the row and never the fastest here)."""
    units = [_kernel_unit(pb, kernel, scale)]
    if kernel.varlen_forward is not None:
        units.append(_varlen_unit(pb, kernel, scale))
    return units


def run_rank(pb: Problem, w: RankWork) -> dict:
    """Forward + backward of one rank's attention; its out and gradients, local order."""
    q, k, v = (t[:, w.indices].detach().requires_grad_() for t in (pb.q, pb.k, pb.v))
    out, _ = run_plan(q, k, v, w.plan)
    out.backward(pb.dout[:, w.indices])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_exact(pb: Problem, per_rank: list[tuple[torch.Tensor, dict]], kernel, scale: float,
                what: tuple[str, ...] = ("out", "dq", "dk", "dv")) -> float:
    """The ranks' results put back in row order against one process (per-document calls)."""
    q, k, v = (t.detach().requires_grad_() for t in (pb.q, pb.k, pb.v))
    outs = []
    for a, b in zip(pb.cu_seqlens[:-1].tolist(), pb.cu_seqlens[1:].tolist()):
        o, _ = run_plan(q[:, a:b], k[:, a:b], v[:, a:b],
                        AttentionPlan(None, 0, 1, "zigzag", True, scale, kernel))
        outs.append(o)
    out = torch.cat(outs, 1)
    out.backward(pb.dout)
    full = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    worst = 0.0
    for name in what:
        back = torch.zeros_like(full[name])
        for idx, res in per_rank:
            back[:, idx] = res[name]
        worst = max(worst, _rel(back, full[name]))
    return worst


def measure_virtual(mix: str, doc_lens: list[int], cp: int, cfg: BenchConfig) -> list[dict]:
    """Attention rows of one mix at one cp, every rank run in turn in this process: on the
    CPU on its process clock (one thread), on a GPU on the wall clock, synchronised
    (``benchmarks/gpu_placement.py`` runs it there)."""
    kernel, scale = cfg.kernel(), 1 / math.sqrt(cfg.head_dim)
    pb = make_row(doc_lens, cfg)
    works = {}
    for pl in PLACEMENTS:
        probe = [rank_work(pl, doc_lens, cp, r, kernel, scale, lambda: None) for r in range(cp)]
        kv = [torch.stack([pb.k[:, w.indices[:w.sharded_tokens]], pb.v[:, w.indices[:w.sharded_tokens]]])
              for w in probe]
        works[pl] = [rank_work(pl, doc_lens, cp, r, kernel, scale, lambda r=r: VirtualRing(r, kv))
                     for r in range(cp)]
    # Exact first: the virtual ring's out and dq are (dK/dV travel through ranks not yet run).
    err = {pl: check_exact(pb, [(w.indices, run_rank(pb, w)) for w in works[pl]], kernel, scale, ("out", "dq"))
           for pl in PLACEMENTS}
    for pl in PLACEMENTS:
        for w in works[pl]:
            if w.sent is not None:
                w.sent.sent = 0
            run_rank(pb, w)  # one call's bytes
    sent = {pl: [w.sent.sent if w.sent else 0 for w in works[pl]] for pl in PLACEMENTS}
    refs = reference_units(pb, kernel, scale)
    times = {pl: [[] for _ in range(cp)] for pl in PLACEMENTS}
    clock = "process" if cfg.device == "cpu" else "wall"  # a GPU's work is not this process's CPU time
    now = CLOCKS[clock]
    for i in range(cfg.warmup + cfg.repeats):
        for u in refs:  # on the ranks' clock
            time_unit(u, replace(cfg, clock=clock), keep=i >= cfg.warmup)
        for pl in PLACEMENTS if i % 2 == 0 else PLACEMENTS[::-1]:
            for r, w in enumerate(works[pl]):
                _sync(cfg.device)
                t0 = now()
                run_rank(pb, w)
                _sync(cfg.device)
                if i >= cfg.warmup:
                    times[pl][r].append(now() - t0)
    ref = min(refs, key=lambda u: statistics.median(u.fb_s))
    ideal = statistics.median(ref.fb_s) / cp
    return [_attention_row("virtual", mix, doc_lens, cp, pl, [statistics.median(t) for t in times[pl]], ideal,
                           ref.name, [w.work for w in works[pl]], sent[pl], works[pl], err[pl], cfg)
            for pl in PLACEMENTS]


def _attention_row(mode, mix, doc_lens, cp, pl, ranks_s, ideal, ref_name, work, sent, works, err, cfg,
                   **extra) -> dict:
    kv_bytes = [2 * len(w.indices) * cfg.kv_heads * cfg.head_dim * DTYPES[cfg.dtype].itemsize for w in works]
    mean = sum(work) / cp
    row = {"part": "attention", "mode": mode, "mix": mix, "cp": cp, "placement": pl,
           "efficiency": ideal / max(ranks_s), "t_ideal_s": ideal, "reference": ref_name,
           "t_ranks_s": ranks_s, "t_slowest_rank_s": max(ranks_s),
           "time_imbalance": max(ranks_s) / statistics.mean(ranks_s) - 1,
           "work_ranks": work, "work_imbalance": max(work) / mean - 1,
           "tokens_ranks": [len(w.indices) for w in works], "sharded_tokens_per_rank": works[0].sharded_tokens,
           "bytes_sent_per_layer_ranks": sent, "bytes_over_local_kv": max(s / b for s, b in zip(sent, kv_bytes)),
           "max_rel_err": err, "docs": len(doc_lens), "doc_lens": _brief(doc_lens),
           "crossover": PlacementCosts().crossover, "tolerance": PlacementCosts().tolerance,
           "heads": cfg.heads, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "dtype": cfg.dtype,
           "backend": cfg.kernel().name, "repeats": cfg.repeats, "threads": 1, "device": cfg.device,
           "clock": "process" if mode == "virtual" and cfg.device == "cpu" else "wall",
           "date": time.strftime("%Y-%m-%d")}
    return row | extra


# --------------------------------------------------------------- part 2: spawned processes


def _step_batches(doc_lens: list[int], cp: int, rank: int, vocab: int) -> dict:
    """Rank ``rank``'s collated row under each placement (the same documents)."""
    import hf_ring

    g = torch.Generator().manual_seed(len(doc_lens))
    features = [{"input_ids": torch.randint(3, vocab, (n,), generator=g).tolist()} for n in doc_lens]
    return {pl: hf_ring.RingDataCollator(0, cp_size=cp, cp_rank=rank, packing=True, placement=pl)(features)
            for pl in PLACEMENTS}


def _worker(rank: int, cp: int, mixes: dict, cfg: BenchConfig, step_row: int, out_dir: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    import hf_ring

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rdzv", rank=rank, world_size=cp)
    kernel, scale = cfg.kernel(), 1 / math.sqrt(cfg.head_dim)
    result = {}
    for mix, doc_lens in mixes.items():
        pb = make_row(doc_lens, cfg)
        stats = {pl: CommWaitStats() for pl in PLACEMENTS}
        works = {pl: rank_work(pl, doc_lens, cp, rank, kernel, scale,
                               lambda pl=pl: process_group_transport(None, stats[pl])) for pl in PLACEMENTS}
        res = {pl: run_rank(pb, works[pl]) for pl in PLACEMENTS}  # warm-up, and what is checked
        sent = {pl: works[pl].sent.sent if works[pl].sent else 0 for pl in PLACEMENTS}
        refs = reference_units(pb, kernel, scale) if rank == 0 else []
        times = {pl: {"wall": [], "cpu": [], "blocked": []} for pl in PLACEMENTS}
        for i in range(cfg.warmup + cfg.repeats):
            for pl in PLACEMENTS if i % 2 == 0 else PLACEMENTS[::-1]:
                dist.barrier()
                b0, c0, t0 = stats[pl].seconds, time.process_time(), time.perf_counter()
                run_rank(pb, works[pl])
                if i >= cfg.warmup:
                    times[pl]["wall"].append(time.perf_counter() - t0)
                    times[pl]["cpu"].append(time.process_time() - c0)
                    times[pl]["blocked"].append(stats[pl].seconds - b0)
            dist.barrier()
            for u in refs:  # rank 0, while the others wait: one process's time on the whole row, both clocks
                c0, t0 = time.process_time(), time.perf_counter()
                u.bwd(u.fwd())
                if i >= cfg.warmup:
                    u.fb_s.append(time.perf_counter() - t0)
                    u.fwd_s.append(time.process_time() - c0)  # here: the CPU seconds of forward + backward
        result[("attention", mix)] = {
            "times": times, "sent": sent, "work": {pl: works[pl].work for pl in PLACEMENTS},
            "tokens": {pl: len(works[pl].indices) for pl in PLACEMENTS},
            "sharded_tokens": {pl: works[pl].sharded_tokens for pl in PLACEMENTS},
            "results": {pl: (works[pl].indices, res[pl]) for pl in PLACEMENTS},
            "refs": [(u.name, u.fb_s, u.fwd_s) for u in refs]}
        if step_row:
            result[("step", mix)] = _time_steps(rank, cp, doc_lens, cfg, step_row, dist, F, hf_ring)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _time_steps(rank, cp, doc_lens, cfg, step_row, dist, F, hf_ring, placements=PLACEMENTS) -> dict:
    """Training steps of the default model under each of ``placements``, from the same weights."""
    batches = _step_batches(doc_lens, cp, rank, MODEL["vocab"])
    count = torch.tensor(float((batches["sharded"]["shift_labels"] != -100).sum()))
    dist.all_reduce(count)  # the row's valid tokens: the loss is their mean over every rank
    models = {pl: default_model(step_row) for pl in placements}
    opts = {pl: torch.optim.AdamW(m.parameters(), lr=1e-4) for pl, m in models.items()}
    stats = {pl: CommWaitStats() for pl in placements}
    times = {pl: {"wall": [], "cpu": [], "blocked": []} for pl in placements}
    first_loss = {}
    for i in range(cfg.warmup + cfg.repeats):
        for pl in placements if i % 2 == 0 else placements[::-1]:
            hf_ring.setup_context_parallel(cp, placement=pl)
            batch = batches[pl]
            keep = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
            dist.barrier()
            b0, c0, t0 = stats[pl].seconds, time.process_time(), time.perf_counter()
            logits = models[pl](**keep, hf_ring_comm_stats=stats[pl]).logits
            loss = F.cross_entropy(logits[0].float(), batch["shift_labels"][0], reduction="sum") / count
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in models[pl].parameters()])
            dist.all_reduce(flat)  # what DDP / FSDP does over dp x cp: one bucket, the same under both
            offset = 0
            for p in models[pl].parameters():
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            opts[pl].step()
            opts[pl].zero_grad(set_to_none=True)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if i >= cfg.warmup:
                times[pl]["wall"].append(wall)
                times[pl]["cpu"].append(cpu)
                times[pl]["blocked"].append(stats[pl].seconds - b0)
            if i == 0:
                total = loss.detach().clone()
                dist.all_reduce(total)
                first_loss[pl] = float(total)
    return {"times": times, "first_loss": first_loss, "tokens": {pl: batches[pl]["input_ids"].shape[1]
                                                                 for pl in placements}}


def measure_spawn(cp: int, mixes: dict, cfg: BenchConfig, step_row: int, load: str) -> list[dict]:
    """Attention and step rows of every mix at one cp over gloo."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(cp, mixes, cfg, step_row, tmp), nprocs=cp, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(cp)]
    kernel, scale = cfg.kernel(), 1 / math.sqrt(cfg.head_dim)
    rows = []
    for mix, doc_lens in mixes.items():
        att = [r[("attention", mix)] for r in ranks]
        pb = make_row(doc_lens, cfg)
        ref_name, ref_s, ref_cpu = min(att[0]["refs"], key=lambda nr: statistics.median(nr[2]))
        ideal = statistics.median(ref_s) / cp
        for pl in PLACEMENTS:
            err = check_exact(pb, [a["results"][pl] for a in att], kernel, scale)
            ranks_s = [statistics.median(a["times"][pl]["wall"]) for a in att]
            ranks_cpu = [statistics.median(a["times"][pl]["cpu"]) for a in att]
            works = [RankWork(a["results"][pl][0], None, None, a["work"][pl], a["sharded_tokens"][pl]) for a in att]
            rows.append(_attention_row(
                "spawn", mix, doc_lens, cp, pl, ranks_s, ideal, ref_name, [a["work"][pl] for a in att],
                [a["sent"][pl] for a in att], works, err, cfg,
                t_ranks_cpu_s=ranks_cpu, t_ideal_cpu_s=statistics.median(ref_cpu) / cp,
                efficiency_cpu=statistics.median(ref_cpu) / cp / max(ranks_cpu),
                t_ranks_blocked_s=[statistics.median(a["times"][pl]["blocked"]) for a in att], load=load))
        if ("step", mix) in ranks[0]:
            rows += _step_rows(mix, doc_lens, cp, [r[("step", mix)] for r in ranks], cfg, load)
    return rows


def _step_rows(mix, doc_lens, cp, steps, cfg, load) -> list[dict]:
    losses = steps[0]["first_loss"]
    diff = max(abs(losses[pl] - losses["sharded"]) / abs(losses["sharded"]) for pl in PLACEMENTS)
    if diff > 1e-5:
        raise AssertionError(f"{mix}, cp {cp}: the first step's loss differs by placement: {losses}")
    slowest = {pl: max(statistics.median(s["times"][pl]["wall"]) for s in steps) for pl in PLACEMENTS}
    # CPU seconds: what each rank computed, robust to other load on a shared machine, but blind to
    # the time a rank waited for a peer (the blocked seconds, given apart)
    cpu = {pl: max(statistics.median(s["times"][pl]["cpu"]) for s in steps) for pl in PLACEMENTS}
    rows = []
    for pl in PLACEMENTS:
        ranks_s = [statistics.median(s["times"][pl]["wall"]) for s in steps]
        rows.append({
            "part": "step", "mode": "spawn", "mix": mix, "cp": cp, "placement": pl,
            "t_step_s": slowest[pl], "t_ranks_s": ranks_s,
            "t_ranks_cpu_s": [statistics.median(s["times"][pl]["cpu"]) for s in steps],
            "t_ranks_blocked_s": [statistics.median(s["times"][pl]["blocked"]) for s in steps],
            "tokens_per_s_per_process": sum(doc_lens) / slowest[pl] / cp,
            "throughput_vs_sharded": slowest["sharded"] / slowest[pl],
            "t_step_cpu_s": cpu[pl], "throughput_vs_sharded_cpu": cpu["sharded"] / cpu[pl],
            "tokens_ranks": [s["tokens"][pl] for s in steps], "first_loss": losses[pl],
            "loss_rel_diff": diff, "docs": len(doc_lens), "doc_lens": _brief(doc_lens),
            "crossover": PlacementCosts().crossover,
            "model": MODEL, "repeats": cfg.repeats, "threads": 1, "clock": "wall", "load": load,
            "date": time.strftime("%Y-%m-%d")})
    return rows


# ------------------------------------------------------- the GPU side, modelled (not measured)


@dataclass(frozen=True)
class GpuModel:
    """Llama-3-8B on H100s, per layer, by arithmetic: modelled, not measured.

    The assumptions, each stated: bf16 K/V on the wire, dK/dV in float32 (the ring's
    accumulators travel); per pass, ``cp - 1`` K/V transfers forward and backward and ``cp``
    dK/dV transfers (what the CPU run counts: ``bytes_over_local_kv``); GEMMs at
    ``gemm_flops`` and FlashAttention at ``attn_flops`` (forward; backward 2.5x), on tiles of
    ``tile`` query x key rows, so a block of ``m`` rows costs as if it had ``ceil(m / tile) *
    tile`` (what a short document's pieces lose); ``launch_s`` per kernel call; a transfer
    costs ``latency_s`` plus its bytes over ``link_bytes_s`` and hides behind the same step's
    attention (whatever is longer is paid).
    """

    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 14336
    gemm_flops: float = 700e12
    attn_flops: float = 400e12
    tile: int = 128
    launch_s: float = 5e-6
    links: tuple = (("NVLink, inside a node", 450e9, 10e-6), ("InfiniBand, across nodes", 50e9, 20e-6))

    @property
    def token_s(self) -> float:
        """One token's per-token layers, forward + backward (6 flops per weight)."""
        weights = self.hidden * (2 * self.heads + 2 * self.kv_heads) * self.head_dim + 3 * self.hidden * self.mlp
        return 6 * weights / self.gemm_flops

    def attn_s(self, q_rows: int, k_rows: int, causal: bool) -> float:
        """One block's forward + backward attention, tiles rounded up."""
        tq, tk = (math.ceil(r / self.tile) * self.tile for r in (q_rows, k_rows))
        pairs = tq * tk / (2 if causal else 1)
        return 3.5 * 4 * self.heads * self.head_dim * pairs / self.attn_flops

    @property
    def crossover(self) -> float:
        """``a / (2 b)`` of ``t(n) = a n + b n^2`` under this model (no tiles)."""
        return self.token_s / (2 * 3.5 * 4 * self.heads * self.head_dim / 2 / self.attn_flops)


def _ring_doc_s(m: GpuModel, n: int, cp: int) -> float:
    """One rank's attention of a document of ``n`` tokens zigzag-sharded over ``cp``: two
    chunks of ``n / 2cp`` rows against every chunk before them (2cp chunks in all)."""
    c = n // (2 * cp)
    # the rank's 2 query chunks see 2cp chunks' keys in all: 2 diagonal (causal) and 2cp - 1 full blocks
    return 2 * m.attn_s(c, c, True) + (2 * cp - 1) * m.attn_s(c, c, False)


def gpu_model(lens: list[int], cp: int, m: GpuModel = GpuModel()) -> dict:
    """Per layer, per rank, a packed row of documents ``lens`` at ``cp`` under both placements."""
    row = sum(lens)
    kv_bytes = lambda tokens, size: 2 * tokens * m.kv_heads * m.head_dim * size  # noqa: E731
    costs = PlacementCosts(crossover=m.crossover)
    out = {"row": row, "cp": cp, "doc_lens": lens, "crossover": m.crossover, "model": "modelled, not measured",
           "assumptions": GpuModel.__doc__.split("\n\n")[1].split(), "placements": {}}
    for pl in ("sharded", "by_length"):  # auto's ring coefficients are this CPU's, not a GPU's
        p = place_by_length(tuple(lens), cp, costs=costs) if pl == "by_length" else None
        sharded = [n for i, n in enumerate(lens) if p is None or p.owner[i] < 0]
        local = sum(sharded) // cp
        docs = []
        for i, n in enumerate(lens):
            whole = p is not None and p.owner[i] >= 0
            docs.append({"tokens": n, "where": f"rank {p.owner[i]}" if whole else "sharded",
                         "rows_per_rank": n if whole else n // cp, "ring_steps": 0 if whole else cp,
                         "attn_s": m.attn_s(n, n, True) if whole else _ring_doc_s(m, n, cp)})
        per_link = {}
        for name, bw, lat in m.links:
            fwd_step = lat + kv_bytes(local, 2) / bw
            bwd_step = lat + (kv_bytes(local, 2) + kv_bytes(local, 4)) / bw
            ring_attn = sum(d["attn_s"] for d in docs if d["ring_steps"])
            # each step's transfer against that step's share of the ring's attention (fwd 1/3.5, bwd 2.5/3.5)
            exposed = ((cp - 1) * max(0.0, fwd_step - ring_attn / 3.5 / cp)
                       + cp * max(0.0, bwd_step - ring_attn * 2.5 / 3.5 / cp)) if local else 0.0
            ranks = []
            for r in range(cp):
                tokens = local + sum(d["tokens"] for d in docs if d["where"] == f"rank {r}")
                attn = ring_attn + sum(d["attn_s"] for d in docs if d["where"] == f"rank {r}")
                calls = (2 * cp if local else 0) + (2 if any(d["where"] == f"rank {r}" for d in docs) else 0)
                ranks.append({"tokens": tokens, "gemm_s": tokens * m.token_s, "attn_s": attn, "calls": calls,
                              "comm_exposed_s": exposed, "total_s": tokens * m.token_s + attn + exposed
                              + calls * m.launch_s})
            per_link[name] = {"ranks": ranks, "slowest_s": max(r["total_s"] for r in ranks),
                              "transfer_fwd_step_s": fwd_step if local else 0.0,
                              "transfer_bwd_step_s": bwd_step if local else 0.0,
                              "ring_attn_step_s": ring_attn / cp if local else 0.0}
        out["placements"][pl] = {
            "docs": docs, "sharded_tokens_per_rank": local, "work_imbalance": p.imbalance if p else 0.0,
            "bytes_per_layer_per_rank": ((2 * (cp - 1)) * kv_bytes(local, 2) + cp * kv_bytes(local, 4)),
            "links": per_link}
    for name, *_ in m.links:
        slow = {pl: out["placements"][pl]["links"][name]["slowest_s"] for pl in out["placements"]}
        out.setdefault("speedup_by_length", {})[name] = slow["sharded"] / slow["by_length"]
    return out


def _print_gpu(g: dict) -> None:
    print(f"# modelled, not measured: Llama-3-8B, cp {g['cp']}, a row of {g['row']} tokens "
          f"({len(g['doc_lens'])} documents), crossover {g['crossover']:.0f}; per layer, per rank")
    for pl, x in g["placements"].items():
        print(f"{pl}: {x['sharded_tokens_per_rank']} sharded tokens per rank, plan's work imbalance "
              f"{100 * x['work_imbalance']:.1f} %, "
              f"{x['bytes_per_layer_per_rank'] / 2**20:.1f} MiB sent per layer per rank")
        for name, link in x["links"].items():
            t = [r["total_s"] * 1e3 for r in link["ranks"]]
            print(f"  {name:26} per ring step: transfer fwd {link['transfer_fwd_step_s'] * 1e6:.0f} / bwd "
                  f"{link['transfer_bwd_step_s'] * 1e6:.0f} us vs attention {link['ring_attn_step_s'] * 1e6:.0f} us; "
                  f"ranks {min(t):.2f}-{max(t):.2f} ms, exposed comm {link['ranks'][0]['comm_exposed_s'] * 1e3:.2f} ms, "
                  f"calls {max(r['calls'] for r in link['ranks'])}")
    print("by_length / sharded (slowest rank): " + ", ".join(f"{k} {v:.2f}x" for k, v in g["speedup_by_length"].items()))


# ----------------------------------------------------------------------------- the driver


def _load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _print(rows: list[dict]) -> None:
    print(f"{'part':9} {'mode':7} {'mix':9} {'cp':>2} {'placement':9} {'eff':>6} {'slowest s':>9} "
          f"{'ratio':>6} {'work imb':>8} {'time imb':>8} {'KiB/layer/rank':>15}")
    for r in rows:
        if r["part"] == "attention":
            kib = "/".join(f"{s / 1024:.0f}" for s in r["bytes_sent_per_layer_ranks"])
            print(f"{'attention':9} {r['mode']:7} {r['mix']:9} {r['cp']:>2} {r['placement']:9} "
                  f"{r['efficiency']:6.3f} {r['t_slowest_rank_s']:9.4f} {'':>6} {100 * r['work_imbalance']:7.1f}% "
                  f"{100 * r['time_imbalance']:7.1f}% {kib:>15}")
        else:
            print(f"{'step':9} {r['mode']:7} {r['mix']:9} {r['cp']:>2} {r['placement']:9} {'':>6} "
                  f"{r['t_step_s']:9.4f} {r['throughput_vs_sharded']:6.2f}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--row", type=int, default=4096, help="tokens in the packed row (attention and step)")
    p.add_argument("--mixes", nargs="+", default=list(MIXES), choices=MIXES)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cost-lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    p.add_argument("--cost-repeats", type=int, default=5)
    p.add_argument("--costs-only", action="store_true", help="part 1 only")
    p.add_argument("--no-costs", action="store_true", help="part 2 only")
    p.add_argument("--no-virtual", action="store_true")
    p.add_argument("--no-step", action="store_true", help="attention only over gloo")
    p.add_argument("--no-spawn", action="store_true", help="no gloo processes: the virtual rows alone")
    p.add_argument("--out", default="benchmarks/results", help="folder for placement_costs.json, placement.jsonl")
    p.add_argument("--tag", default="", help="suffix of the rows' file: placement{tag}.jsonl")
    p.add_argument("--tiny", action="store_true", help="smoke test: cp 2, a 256-token row, small heads, 1 repeat")
    p.add_argument("--json", action="store_true", help="print one JSON object per row")
    p.add_argument("--gpu-model", action="store_true",
                   help="only the GPU side, modelled (Llama-3-8B, cp 8; a long-tail row of 131072 tokens and one "
                        "of 64 x 2048): placement_gpu_model.json")
    a = p.parse_args(argv)
    if a.gpu_model:
        # the long-tail mix at 128K tokens, and a row of 2K-token documents (where sharding cuts blocks finest)
        rows = {"long_tail": long_tail_lens(131072, 16), "64 x 2048": [2048] * 64}
        g = {name: gpu_model(lens, 8) for name, lens in rows.items()}
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "placement_gpu_model.json"), "w") as f:
            json.dump(g, f, indent=2)
        for one in g.values():
            _print_gpu(one)
        return 0
    cfg = BenchConfig(heads=8, kv_heads=2, head_dim=128, repeats=a.repeats, warmup=1)
    if a.tiny:
        a.cp, a.row, a.cost_lengths, a.cost_repeats = [2], 256, [64, 128, 256], 1
        cfg = BenchConfig(heads=4, kv_heads=2, head_dim=16, repeats=1, warmup=1)
    command = " ".join(["python benchmarks/placement.py", *(argv if argv is not None else sys.argv[1:])])
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(1)
    load0 = _load()
    print(f"# {load0}", file=sys.stderr)
    if not a.no_costs:
        print("part 1: the cost model's coefficient (one thread, process clock)", file=sys.stderr)
        costs = measure_costs(a.cost_lengths, a.cost_repeats) | {"command": command, "load": load0,
                                                                 "date": time.strftime("%Y-%m-%d")}
        with open(os.path.join(a.out, "placement_costs.json"), "w") as f:
            json.dump(costs, f, indent=2)
        fm = costs["fit_model"]
        print(f"crossover = a / (2 b) = {costs['crossover']:.0f} tokens (whole model: a {fm['a_s_per_token']:.3e} s/token, "
              f"b {fm['b_s_per_token2']:.3e} s/token^2, worst residual {100 * fm['max_rel_residual']:.1f} %); "
              f"from the split (model less attention / layers' attention): {costs['crossover_from_split']:.0f}; "
              f"PlacementCosts' default {costs['default_crossover']:.0f}", file=sys.stderr if a.json else sys.stdout)
        if a.costs_only:
            return 0
    mult = 2 * max(a.cp)
    mixes = {mix: mix_doc_lens(mix, a.row, mult) for mix in a.mixes}
    rows: list[dict] = []
    for cp in a.cp:
        if not a.no_virtual:
            for mix, lens in mixes.items():
                rows += measure_virtual(mix, lens, cp, cfg)
                print(f"virtual cp {cp} {mix}: done", file=sys.stderr, flush=True)
        if not a.no_spawn:
            rows += measure_spawn(cp, mixes, cfg, 0 if a.no_step else a.row, _load())
            print(f"gloo cp {cp}: done", file=sys.stderr, flush=True)
    for r in rows:
        r["command"] = command
    with open(os.path.join(a.out, f"placement{a.tag}.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    if a.json:
        for r in rows:
            print(json.dumps(r))
    else:
        _print(rows)
    print(f"# after: {_load()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
