"""How much of a single device's attention speed the ring keeps, per layout.

Efficiency = time of one causal attention call over the full sequence
             / (cp_size x time of the slowest rank),
so 1.0 means the ring splits the work perfectly and adds nothing; the causal work each
rank gets (layout balance), the speed of the kernel on the smaller ring blocks, and the
per-block merge and gradient accumulation all show up as a loss. Communication does not:

- virtual ring (default): one process runs, rank by rank, exactly the block calls that
  ``hf_ring.patterns.ring.schedule.step_blocks`` gives that rank over all steps, through the ring's
  own per-step code (``forward_blocks``, ``backward_blocks``, ``add_block_dkv``), and times
  each rank. Forward, and forward + backward (given the final out and lse).
- ``--spawn``: the real ``hf_ring.ring_flash_attn_func`` over gloo in ``cp`` spawned
  processes (one thread each), including the transfers.

Layouts: zigzag, stripe, contiguous (reference: one causal call over the sequence), and
packed (a row of documents of mixed lengths, each zigzag-sharded on its own; reference:
one causal call per document, same kernel), under the ring; ``packed_allgather`` is the same
row under the all-gather pattern (every rank's K/V gathered, each local chunk against its
document's prefix: ``hf_ring/patterns/ring/prefix.py``), ``packed_ulysses`` under Ulysses
(heads exchanged, whole documents for ``heads / cp`` heads per rank), timed in the same
process. Ulysses' virtual all-to-all delivers this rank's own values in place of its
peers' (the same shapes and work), so its virtual output is not exact; ``--spawn`` runs
the real one.

Defaults: float32 on CPU (the dtype a CPU user trains in; PyTorch's CPU flash kernel is
faster in float32 than in bfloat16), 8 query heads, 2 KV heads, head_dim 128, batch 1,
median of 3 repeats after a warm-up, ``torch.set_num_threads(min(2, cpu_count))``.
Run ``python benchmarks/ring_efficiency.py --help``; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

import hf_ring
from hf_ring.distributed.collectives import VirtualCollectives
from hf_ring.kernels import AttentionBackend, get_backend
from hf_ring.patterns import AttentionPlan, VirtualRing, run_plan
from hf_ring.patterns.ring.block_runs import group_runs, key_rows, query_rows
from hf_ring.patterns.ring.schedule import Block
from hf_ring.sharding import shard_packed, unshard_packed

LAYOUTS = ("zigzag", "stripe", "contiguous", "packed", "packed_allgather", "packed_ulysses")
PACKED_PATTERNS = {"packed": "ring", "packed_allgather": "allgather", "packed_ulysses": "ulysses"}
DOC_FRACTIONS = (0.4, 0.25, 0.2, 0.1, 0.05)  # packed row: mixed document lengths
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# "process" counts only the CPU time this process got, so other load on the machine does not
# inflate it; valid for one thread (several threads would also count their spin-waits).
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


@dataclass(frozen=True)
class BenchConfig:
    """Attention shape and measurement settings shared by every configuration."""

    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    dtype: str = "float32"
    device: str = "cpu"
    backend: str = "auto"
    repeats: int = 3
    warmup: int = 1
    clock: str = "wall"  # or "process": CPU seconds of this process, for one thread on a shared machine
    docs: int = 0  # packed rows: 0 for the mixed documents of DOC_FRACTIONS, else that many of one length
    uneven: bool = False  # with docs: that many documents of drawn lengths (seeded) instead

    def __post_init__(self) -> None:
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {self.clock!r}")
        if self.clock == "process" and self.device != "cpu":
            raise ValueError("clock='process' measures CPU time: use it with device cpu")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("repeats must be >= 1 and warmup >= 0")
        if self.docs < 0:
            raise ValueError(f"docs must be 0 (mixed lengths) or a number of equal documents, got {self.docs}")
        if self.uneven and not self.docs:
            raise ValueError("uneven documents need their number: pass docs > 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def kernel(self) -> AttentionBackend:
        return get_backend(self.backend, torch.device(self.device), self.torch_dtype)


def packed_doc_lens(total: int, cp: int, docs: int = 0, uneven: bool = False) -> list[int]:
    """Document lengths of a packed row of ``total`` tokens, each a multiple of 2 * cp: the
    mixed lengths of :data:`DOC_FRACTIONS`, ``docs`` documents of one length, or (``uneven``)
    ``docs`` documents of lengths drawn with seed ``docs`` (from 1 to about 5 times the
    shortest, in the drawn order)."""
    mult = 2 * cp
    if docs and uneven:
        units = total // mult
        if total % mult or units < docs:
            raise ValueError(f"{total} tokens do not split into {docs} documents of multiples of {mult} tokens")
        weights = torch.rand(docs, generator=torch.Generator().manual_seed(docs)) + 0.25
        lens = (weights / weights.sum() * units).floor().clamp(min=1).long()
        for i in range(units - int(lens.sum())):  # the units the floor left, one each from the first
            lens[i % docs] += 1
        return [int(n) * mult for n in lens]
    if docs:
        if total % (docs * mult):
            raise ValueError(f"{total} tokens do not split into {docs} documents of a multiple of {mult} tokens")
        return [total // docs] * docs
    lens = [max(mult, round(f * total / mult) * mult) for f in DOC_FRACTIONS[:-1]]
    lens.append(total - sum(lens))
    if lens[-1] < mult:
        raise ValueError(f"{total} tokens are too few for a packed row of {len(DOC_FRACTIONS)} documents at cp={cp}")
    return lens


@dataclass
class Problem:
    """Full-sequence tensors ``(1, S, heads, head_dim)`` and every rank's shard of them."""

    layout: str
    cp: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    shards: list[tuple[torch.Tensor, ...]]  # per rank: q, k, v, dout
    doc_lens: Optional[list[int]] = None  # packed: global document lengths

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """int64 ``(n_docs + 1,)`` document boundaries of the packed row."""
        return cu_seqlens(self.doc_lens)

    @functools.cached_property
    def kv_by_rank(self) -> list[torch.Tensor]:
        """Each rank's K/V as the ring stacks them, ``(2, 1, S / cp, kv_heads, head_dim)``."""
        return [torch.stack([sh[1], sh[2]]) for sh in self.shards]


@dataclass
class RingRun:
    """One rank's ring forward: its q (a leaf, for dq), out and lse."""

    q: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


def cu_seqlens(doc_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(doc_lens).cumsum(0).tolist()])


def make_problem(layout: str, cp: int, seq_per_rank: int, cfg: BenchConfig, seed: int = 0) -> Problem:
    total = cp * seq_per_rank
    g = torch.Generator(device=cfg.device).manual_seed(seed)

    def rand(heads: int) -> torch.Tensor:
        # Drawn on the device itself: at 256k tokens a CPU draw and copy would take seconds.
        return torch.randn(1, total, heads, cfg.head_dim, generator=g, device=cfg.device).to(cfg.torch_dtype)

    q, k, v, dout = rand(cfg.heads), rand(cfg.kv_heads), rand(cfg.kv_heads), rand(cfg.heads)
    doc_lens = packed_doc_lens(total, cp, cfg.docs, cfg.uneven) if _packed(layout) else None
    if doc_lens:
        shard = lambda t, r: shard_packed(t, cu_seqlens(doc_lens), cp, r)  # noqa: E731
    else:
        shard = lambda t, r: hf_ring.shard_sequence(t, cp, r, layout=layout)  # noqa: E731
    shards = [tuple(shard(t, r).contiguous() for t in (q, k, v, dout)) for r in range(cp)]
    return Problem(layout, cp, q, k, v, dout, shards, doc_lens)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@dataclass
class Clock:
    """Wall time of each kernel call, by pass and kind (CPU only: there the calls are
    synchronous): ``fwd_causal``, ``fwd_full``, ``bwd_causal``, ``bwd_full``."""

    enabled: bool
    now: Callable[[], float] = time.perf_counter
    seconds: dict = field(default_factory=dict)

    def reset(self) -> None:
        self.seconds = {f"{p}_{k}": 0.0 for p in ("fwd", "bwd") for k in ("causal", "full")}

    def call(self, fn: Callable, which: str, *args):
        # Every kernel entry point takes ``causal`` as its second-to-last positional argument.
        start = self.now()
        res = fn(*args)
        self.seconds[f"{which}_{'causal' if args[-2] else 'full'}"] += self.now() - start
        return res

    def wrap(self, kernel: AttentionBackend) -> AttentionBackend:
        """``kernel`` with each of its calls timed."""
        if not self.enabled:
            return kernel
        timed = {
            name: (lambda fn, which: lambda *a: self.call(fn, which, *a))(getattr(kernel, name), which)
            for name, which in (("forward", "fwd"), ("backward", "bwd"), ("varlen_forward", "fwd"),
                                ("varlen_backward", "bwd"))
            if getattr(kernel, name) is not None
        }
        return replace(kernel, **timed)


def _packed(layout: str) -> bool:
    return layout.startswith("packed")


def _plan(pb: Problem, rank: int, kernel: AttentionBackend, scale: float) -> AttentionPlan:
    """Rank ``rank``'s ring plan over a :class:`VirtualRing` transport (``packed_allgather``
    and ``packed_ulysses``: that pattern's, over :class:`VirtualCollectives`)."""
    local_docs = tuple(n // pb.cp for n in pb.doc_lens) if pb.doc_lens else None
    if pb.layout == "packed_allgather" and pb.cp > 1:
        return AttentionPlan(group=None, rank=rank, world=pb.cp, layout="zigzag", causal=True, scale=scale,
                             backend=kernel, local_doc_lens=local_docs, pattern="allgather",
                             collectives=VirtualCollectives(rank, pb.kv_by_rank))
    if pb.layout == "packed_ulysses" and pb.cp > 1:
        whole = AttentionPlan(group=None, rank=0, world=1, layout="zigzag", causal=True, scale=scale,
                              backend=kernel, local_doc_lens=tuple(pb.doc_lens))
        return AttentionPlan(group=None, rank=rank, world=pb.cp, layout="zigzag", causal=True, scale=scale,
                             backend=kernel, local_doc_lens=local_docs, pattern="ulysses", inner=whole,
                             need_lse=False, collectives=VirtualCollectives(rank, world=pb.cp))
    return AttentionPlan(
        group=None, rank=rank, world=pb.cp, layout="zigzag" if local_docs else pb.layout, causal=True,
        scale=scale, backend=kernel, local_doc_lens=local_docs,
        transport=VirtualRing(rank, pb.kv_by_rank) if pb.cp > 1 else None,
    )


def rank_forward(pb: Problem, rank: int, kernel: AttentionBackend, scale: float) -> RingRun:
    """Rank ``rank``'s ring forward: ``hf_ring.patterns.ring.attention`` itself, the ring's
    transfers replaced by in-process copies (:class:`hf_ring.patterns.VirtualRing`)."""
    q, k, v = (t.detach().requires_grad_() for t in pb.shards[rank][:3])
    out, lse = run_plan(q, k, v, _plan(pb, rank, kernel, scale))
    return RingRun(q, out, lse)


def rank_backward(pb: Problem, rank: int, run: RingRun) -> None:
    """The ring backward of :func:`rank_forward` (autograd through the ring op)."""
    run.out.backward(pb.shards[rank][3])


def virtual_ring(pb: Problem, kernel: AttentionBackend, scale: float) -> dict[str, torch.Tensor]:
    """Every rank's virtual ring, reassembled in global order: out, lse and dq of the full
    sequence (to check that the benchmark runs exact attention). dK/dV are not returned:
    their accumulators travel through ranks that, one after another in one process, have
    not run yet (the real ring's dK/dV are tested over gloo in tests/test_ring_attention.py)."""
    if pb.layout == "packed_ulysses":
        raise ValueError("packed_ulysses' virtual all-to-all delivers this rank's own values: its output is "
                         "not attention's (time it; check Ulysses over gloo, tests/test_ring_packed.py)")
    outs, lses, dqs = [], [], []
    for r in range(pb.cp):
        run = rank_forward(pb, r, kernel, scale)
        rank_backward(pb, r, run)
        outs.append(run.out.detach())
        lses.append(run.lse)
        dqs.append(run.q.grad)
    if pb.doc_lens:
        join = lambda ts, dim=1: unshard_packed(ts, pb.cu_seqlens, dim=dim)  # noqa: E731
    else:
        join = lambda ts, dim=1: hf_ring.unshard_sequence(ts, dim=dim, layout=pb.layout)  # noqa: E731
    return {"out": join(outs), "lse": join(lses, 2), "dq": join(dqs)}


def full_calls(pb: Problem) -> list[slice]:
    """The sequence's causal calls without CP: the whole row, or one per packed document."""
    if not pb.doc_lens:
        return [slice(0, pb.q.shape[1])]
    bounds = pb.cu_seqlens.tolist()
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


@dataclass
class Unit:
    """One timed thing (a full-sequence reference, or one rank of the virtual ring):
    ``fwd()`` returns what ``bwd`` needs; times are collected over the repeats."""

    name: str
    fwd: Optional[Callable[[], Any]] = None  # None: times measured elsewhere (spawned ranks)
    bwd: Optional[Callable[[Any], None]] = None
    clock: Clock = field(default_factory=lambda: Clock(False))
    fwd_s: list[float] = field(default_factory=list)
    fb_s: list[float] = field(default_factory=list)
    kernel_s: list[dict] = field(default_factory=list)  # per repeat: Clock.seconds


def _kernel_unit(pb: Problem, kernel: AttentionBackend, scale: float) -> Unit:
    """One kernel call per document (one for a dense row); a run of documents of one length
    as one batched call, grouped and viewed as the ring groups its blocks (block_runs.py)."""
    calls = group_runs([Block(c.start, c.stop, c.start, c.stop, True) for c in full_calls(pb)])

    def fwd():
        return [kernel.forward(query_rows(c, pb.q), key_rows(c, pb.k), key_rows(c, pb.v), True, scale) for c in calls]

    def bwd(results):
        for c, (o, l) in zip(calls, results):
            kernel.backward(query_rows(c, pb.dout), query_rows(c, pb.q), key_rows(c, pb.k), key_rows(c, pb.v), o, l,
                            True, scale)

    return Unit("per-document calls" if pb.doc_lens else "one causal call", fwd, bwd)


def _varlen_unit(pb: Problem, kernel: AttentionBackend, scale: float) -> Unit:
    """One varlen kernel call over every document of the packed row."""
    cu = pb.cu_seqlens.to(device=pb.q.device, dtype=torch.int32)
    longest = max(pb.doc_lens)
    q, k, v, dout = (t[0] for t in (pb.q, pb.k, pb.v, pb.dout))

    def fwd():
        return kernel.varlen_forward(q, k, v, cu, cu, longest, longest, True, scale)

    def bwd(result):
        kernel.varlen_backward(dout, q, k, v, *result, cu, cu, longest, longest, True, scale)

    return Unit("one varlen call", fwd, bwd)


def _masked_sdpa_unit(pb: Problem, scale: float) -> Unit:
    """What a user without CP runs on a packed row with plain PyTorch: one SDPA call over
    the whole row with a block-diagonal causal mask, backward through autograd."""
    doc = torch.repeat_interleave(torch.arange(len(pb.doc_lens)), torch.tensor(pb.doc_lens)).to(pb.q.device)
    n = doc.numel()
    mask = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool, device=doc.device).tril()
    group = pb.q.shape[2] // pb.k.shape[2]

    def fwd():
        q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in (pb.q, pb.k, pb.v))
        kr, vr = (t.repeat_interleave(group, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, scale=scale)

    def bwd(out):
        out.backward(pb.dout.transpose(1, 2))

    return Unit("one masked SDPA call", fwd, bwd)


def full_units(pb: Problem, kernel: AttentionBackend, scale: float) -> list[Unit]:
    """The exact ways to compute the whole sequence without CP; the fastest is the
    reference. Dense rows: one causal call. Packed rows: one call per document, one
    masked SDPA call, and one varlen call when the kernel has one."""
    units = [_kernel_unit(pb, kernel, scale)]
    if pb.doc_lens:
        units.append(_masked_sdpa_unit(pb, scale))
        if kernel.varlen_forward is not None:
            units.append(_varlen_unit(pb, kernel, scale))
    return units


def rank_unit(pb: Problem, rank: int, kernel: AttentionBackend, scale: float, cfg: BenchConfig) -> Unit:
    # Per-call timing only where calls are synchronous (CPU); on CUDA it would add syncs.
    clock = Clock(cfg.device == "cpu", CLOCKS[cfg.clock])
    timed = clock.wrap(kernel)
    return Unit(f"{pb.layout} rank {rank}", lambda: rank_forward(pb, rank, timed, scale),
                lambda run: rank_backward(pb, rank, run), clock)


def time_unit(u: Unit, cfg: BenchConfig, keep: bool) -> None:
    """Run ``u`` forward then backward once; record the times if ``keep``."""
    now = CLOCKS[cfg.clock]
    u.clock.reset()
    _sync(cfg.device)
    t0 = now()
    state = u.fwd()
    _sync(cfg.device)
    t1 = now()
    u.bwd(state)
    _sync(cfg.device)
    if keep:
        u.fwd_s.append(t1 - t0)
        u.fb_s.append(now() - t0)
        u.kernel_s.append(dict(u.clock.seconds))


def run_interleaved(units: list[Unit], cfg: BenchConfig, tick: Callable[[], None] = lambda: None) -> None:
    """Time every unit once per round, in turn, so that load from other processes hits the
    reference and the ranks alike; the first ``cfg.warmup`` rounds are not kept."""
    for i in range(cfg.warmup + cfg.repeats):
        for u in units:
            time_unit(u, cfg, keep=i >= cfg.warmup)
            tick()


def group_units(cp: int, layouts: list[str], kernel: AttentionBackend) -> int:
    """How many units :func:`measure_group` times for these layouts (for progress bars)."""
    dense = any(not _packed(lay) for lay in layouts)
    packed = (2 + (kernel.varlen_forward is not None)) if any(map(_packed, layouts)) else 0
    return int(dense) + packed + cp * len(layouts)


def measure_group(cp: int, seq_per_rank: int, layouts: list[str], cfg: BenchConfig,
                  tick: Callable[[], None] = lambda: None) -> list[dict]:
    """Virtual-ring efficiency rows (forward, forward+backward) for every layout at one
    ``cp`` and length. The dense layouts share one reference (same full sequence)."""
    kernel = cfg.kernel()
    scale = 1 / math.sqrt(cfg.head_dim)
    problems = {lay: make_problem(lay, cp, seq_per_rank, cfg) for lay in layouts}
    refs: dict[str, list[Unit]] = {}
    dense = [lay for lay in layouts if not _packed(lay)]
    packed = [lay for lay in layouts if _packed(lay)]
    if dense:
        refs["dense"] = full_units(problems[dense[0]], kernel, scale)
    if packed:  # the packed layouts share one row
        refs["packed"] = full_units(problems[packed[0]], kernel, scale)
    ranks = {lay: [rank_unit(problems[lay], r, kernel, scale, cfg) for r in range(cp)]
             for lay in layouts}
    run_interleaved([*(u for us in refs.values() for u in us), *(u for us in ranks.values() for u in us)], cfg, tick)
    rows = []
    for lay in layouts:
        ref = refs["packed" if _packed(lay) else "dense"]
        rows += efficiency_rows(lay, cp, seq_per_rank, ref, ranks[lay], cfg, kernel.name, problems[lay].doc_lens)
    return rows


def efficiency_rows(layout: str, cp: int, spr: int, refs: list[Unit], ranks: list[Unit], cfg: BenchConfig,
                    backend: str, doc_lens: Optional[list[int]], mode: str = "virtual") -> list[dict]:
    """Efficiency against the fastest reference of ``refs``, per pass."""
    rows = []
    for name, attr in (("forward", "fwd_s"), ("forward+backward", "fb_s")):
        ref = min(refs, key=lambda u: statistics.median(getattr(u, attr)))
        full = statistics.median(getattr(ref, attr))
        per_rank = [statistics.median(getattr(u, attr)) for u in ranks]
        slowest = max(range(len(ranks)), key=lambda r: per_rank[r])
        row = {
            "layout": layout, "cp": cp, "seq_per_rank": spr, "pass": name,
            "efficiency": full / (cp * per_rank[slowest]), "mode": mode, "t_full_s": full,
            "t_slowest_rank_s": per_rank[slowest], "t_ranks_s": per_rank,
            "efficiency_of_minima": min(getattr(ref, attr)) / (cp * max(min(getattr(u, attr)) for u in ranks)),
            "reference": ref.name,
            "t_references_s": {u.name: statistics.median(getattr(u, attr)) for u in refs},
            "backend": backend, "doc_lens": doc_lens, **_shape(cfg), "date": time.strftime("%Y-%m-%d"),
        }
        if ranks[slowest].clock.enabled:
            # The slowest rank's kernel seconds by block kind (median over repeats): what
            # the ring would take if merging and accumulating cost nothing.
            log = ranks[slowest].kernel_s
            passes = ("fwd",) if name == "forward" else ("fwd", "bwd")
            kinds = {k: statistics.median(sum(rep[f"{p}_{k}"] for p in passes) for rep in log)
                     for k in ("causal", "full")}
            row |= {"kernel_causal_s": kinds["causal"], "kernel_full_s": kinds["full"],
                    "kernel_only_efficiency": full / (cp * (kinds["causal"] + kinds["full"]))}
        rows.append(row)
    return rows


def _shape(cfg: BenchConfig) -> dict:
    keys = ("heads", "kv_heads", "head_dim", "dtype", "device", "repeats", "clock")
    return {k: asdict(cfg)[k] for k in keys} | {"threads": torch.get_num_threads()}


# ------------------------------------------------------------------ real ring (--spawn)


def _spawn_worker(rank: int, cp: int, layout: str, spr: int, cfg: BenchConfig, threads: int, tmp: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=cp)
    pb = make_problem(layout, cp, spr, cfg)
    q, k, v = (t.clone().requires_grad_() for t in pb.shards[rank][:3])
    dout = pb.shards[rank][3]

    def fwd():
        if pb.doc_lens:
            pattern = PACKED_PATTERNS[layout]
            out = hf_ring.ring_flash_attn_varlen_func(q[0], k[0], v[0], pb.cu_seqlens, backend=cfg.backend,
                                                      pattern=pattern)
            return out.unsqueeze(0)
        return hf_ring.ring_flash_attn_func(q, k, v, layout=layout, backend=cfg.backend)

    ring = Unit(f"rank {rank}", fwd, lambda out: out.backward(dout))
    # Rank 0 also times the reference, right after each ring round and in the same process
    # conditions (threads, load), while the others wait.
    refs = full_units(pb, cfg.kernel(), 1 / math.sqrt(cfg.head_dim))
    for i in range(cfg.warmup + cfg.repeats):
        dist.barrier()
        time_unit(ring, cfg, keep=i >= cfg.warmup)
        dist.barrier()
        if rank == 0:
            for ref in refs:
                time_unit(ref, cfg, keep=i >= cfg.warmup)
    torch.save((ring.fwd_s, ring.fb_s, [(u.name, u.fwd_s, u.fb_s) for u in refs]), os.path.join(tmp, f"rank{rank}.pt"))
    dist.destroy_process_group()


def measure_spawn(layout: str, cp: int, seq_per_rank: int, cfg: BenchConfig, threads: int) -> list[dict]:
    """Real-ring efficiency rows: ``cp`` gloo processes of ``threads`` threads each; rank 0
    also times the reference on its ``threads`` threads (the same per-rank share)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawn_worker, args=(cp, layout, seq_per_rank, cfg, threads, tmp), nprocs=cp, join=True)
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(cp)]
    ranks = [Unit(f"rank {r}", fwd_s=res[0], fb_s=res[1]) for r, res in enumerate(results)]
    refs = [Unit(name, fwd_s=fwd_s, fb_s=fb_s) for name, fwd_s, fb_s in results[0][2]]
    doc_lens = packed_doc_lens(cp * seq_per_rank, cp, cfg.docs) if _packed(layout) else None
    rows = efficiency_rows(layout, cp, seq_per_rank, refs, ranks, cfg, cfg.kernel().name, doc_lens, mode="spawn")
    return [r | {"threads": threads} for r in rows]


# ------------------------------------------------------------------------------- driver


def _print_table(rows: list[dict]) -> None:
    print(f"{'mode':8} {'layout':16} {'cp':>3} {'seq/rank':>8} {'pass':17} {'eff':>6} {'kernel-only':>11} "
          f"{'t_full s':>9} {'slowest rank s':>14}")
    for r in rows:
        ko = r.get("kernel_only_efficiency")
        print(f"{r['mode']:8} {r['layout']:16} {r['cp']:>3} {r['seq_per_rank']:>8} {r['pass']:17} "
              f"{r['efficiency']:6.3f} {(f'{ko:.3f}' if ko else '-'):>11} {r['t_full_s']:9.4f} "
              f"{r['t_slowest_rank_s']:14.4f}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--seq-per-rank", type=int, nargs="+", default=[2048])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--backend", default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                   help="wall, or process: CPU seconds of each process (one thread each; robust to other "
                        "load; with --spawn it leaves out time spent waiting for transfers)")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--quick", action="store_true", help="cp 2 and 4, 1024 tokens per rank, 2 repeats")
    p.add_argument("--tiny", action="store_true", help="smoke test: cp 2, 64 tokens per rank, small heads")
    p.add_argument("--spawn", action="store_true", help="real ring over gloo, cp=2 (override with --cp)")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p.add_argument("--docs", type=int, default=0,
                   help="packed rows: this many documents of one length instead of the mixed lengths "
                        f"{'/'.join(f'{round(f * 100)}' for f in DOC_FRACTIONS)} %%")
    p.add_argument("--uneven", action="store_true", help="with --docs: documents of drawn (seeded) lengths")
    a = p.parse_args(argv)
    if a.quick:
        a.cp, a.seq_per_rank, a.repeats = [2, 4], [1024], 2
    if a.tiny:
        a.cp, a.seq_per_rank, a.repeats, a.heads, a.kv_heads, a.head_dim = [2], [64], 5, 2, 1, 16
    if a.spawn and a.cp == [2, 4, 8]:
        a.cp = [2]
    per_process = [max(1, a.threads // cp) for cp in a.cp] if a.spawn else [a.threads]
    if a.clock == "process" and set(per_process) != {1}:
        p.error("--clock process measures one thread per process: pass --threads 1 (--spawn: --threads <= cp)")
    torch.set_num_threads(a.threads)
    cfg = BenchConfig(a.heads, a.kv_heads, a.head_dim, a.dtype, a.device, a.backend, a.repeats, a.warmup, a.clock,
                      a.docs, a.uneven)
    if not a.json:
        threads = f"{max(1, a.threads // max(a.cp))} per process" if a.spawn else str(a.threads)
        print(f"# {cfg.kernel().name} backend, {a.dtype}, heads {a.heads}/{a.kv_heads}, head_dim {a.head_dim}, "
              f"batch 1, median of {a.repeats} after {a.warmup} warm-up, torch threads {threads}, {a.clock} clock")
    from tqdm import tqdm  # only the command line needs it (gpu_check.py imports this module)

    rows: list[dict] = []
    groups = [(cp, spr) for cp in a.cp for spr in a.seq_per_rank]
    if a.spawn:
        total = len(groups) * len(a.layouts)
    else:
        total = sum((a.warmup + a.repeats) * group_units(cp, a.layouts, cfg.kernel()) for cp, _ in groups)
    with tqdm(total=total, desc="ring efficiency", file=sys.stderr, disable=a.tiny) as bar:
        for cp, spr in groups:
            if a.spawn:
                new = []
                for layout in a.layouts:
                    new += measure_spawn(layout, cp, spr, cfg, max(1, a.threads // cp))
                    bar.update()
            else:
                new = measure_group(cp, spr, a.layouts, cfg, bar.update)
            rows += new
            if a.json:
                for r in new:
                    print(json.dumps(r), flush=True)
    if not a.json:
        _print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
