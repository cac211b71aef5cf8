"""Packed rows after an all-gather: each local chunk of each document against its prefix.

Why: a packed row's documents are zigzag-sharded one by one (rank ``r`` of ``N`` holds
chunks ``r`` and ``2N-1-r`` of every document, each ``c`` tokens of a document of ``2Nc``).
The ring computes them as one block per document per step, ``N`` steps of small blocks;
with every rank's K/V gathered (Llama 3's context parallelism) each local chunk ``j`` of a
document simply sees its document's keys ``[start, start + (j+1)c)``: the keys of the
chunks before it, all visible, and its own, causal. So a rank computes, per run of
consecutive documents of one length (one kernel call each, the run as the batch):

- the diagonals: every local chunk against its own keys, which are this rank's own K/V
  rows (causal, ``c x c``), both chunks of every document of the run in one call;
- the prefix of the first chunk (``j = r``): ``c x rc`` keys, all visible (none on rank 0);
- the prefix of the second chunk (``j = 2N-1-r``): ``c x (2N-1-r)c`` keys, all visible.

Three calls per run (two on rank 0) where the ring makes ``N`` steps of per-document
blocks, and large ones: 64 documents of 128 tokens at ``N = 4`` are 3 calls per layer per
rank. The prefixes read the gathered K/V in the row's global order (one copy, made once
per layer: ``global_kv``); the diagonals read the local K/V, and run while the all-gather
travels.

Backward: the K/V gathered again (never kept from the forward), dq local, the prefixes'
dK/dV in global order put back as every rank's share and reduce-scattered, the
diagonals' added to this rank's own rows.

Exact: each query row sees the keys one process shows it, split into two blocks merged by
their log-sum-exp. Windows, spans and chunked attention are not scheduled here (the
all-gather pattern runs the ring's blocks for them).

Must not import transformers, accelerate, or hf_ring's integration or training layers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from hf_ring.distributed.collectives import Collectives
from hf_ring.patterns.ring.merge import merge_block_
from hf_ring.patterns.plan import AttentionPlan
from hf_ring.patterns.ring.attention import accum_dtype, unpack_kv
from hf_ring.patterns.ring.block_runs import Rows


@dataclass(frozen=True)
class PrefixCall:
    """One kernel call: local query rows against key rows, of the local K/V (``local``) or of
    the gathered K/V in global order; causal on a diagonal."""

    q: Rows
    k: Rows
    causal: bool
    local: bool


@dataclass(frozen=True)
class PrefixSchedule:
    """A rank's calls for one packed row, and where the row's global rows are gathered from.

    Attributes:
        diagonals: the calls on the local K/V (together they cover every local row once).
        prefixes: the calls on the gathered K/V.
        source_rank, source_row: for each global row, the rank that holds it and its row there.
    """

    diagonals: tuple[PrefixCall, ...]
    prefixes: tuple[PrefixCall, ...]
    source_rank: torch.Tensor
    source_row: torch.Tensor


def _runs(local_doc_lens: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``(first document, count, local length)`` of each run of consecutive equal documents."""
    runs: list[list[int]] = []
    for i, n in enumerate(local_doc_lens):
        if runs and local_doc_lens[runs[-1][0]] == n:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return [(first, count, local_doc_lens[first]) for first, count in runs]


@functools.lru_cache(maxsize=64)
def prefix_schedule(local_doc_lens: tuple[int, ...], rank: int, world: int) -> PrefixSchedule:
    """The calls of rank ``rank`` of ``world`` for documents of these local lengths (each
    ``2c``, zigzag-sharded per document), and the global row order."""
    local_starts = [0]
    for n in local_doc_lens:
        local_starts.append(local_starts[-1] + n)
    diagonals, prefixes = [], []
    for first, count, n in _runs(local_doc_lens):
        c, o, g = n // 2, local_starts[first], local_starts[first] * world
        diagonals.append(PrefixCall(Rows(o, c, 2 * count, c), Rows(o, c, 2 * count, c), True, True))
        for chunk, q_start in ((rank, o), (2 * world - 1 - rank, o + c)):
            if chunk:
                prefixes.append(PrefixCall(Rows(q_start, c, count, n), Rows(g, chunk * c, count, n * world),
                                           False, False))
    ranks, rows = [], []
    for o, n in zip(local_starts, local_doc_lens):
        c = n // 2
        for chunk in range(2 * world):
            src, second = (chunk, 0) if chunk < world else (2 * world - 1 - chunk, 1)
            ranks.append(torch.full((c,), src))
            rows.append(torch.arange(o + second * c, o + (second + 1) * c))
    return PrefixSchedule(tuple(diagonals), tuple(prefixes), torch.cat(ranks), torch.cat(rows))


def _rows_of(buffers: torch.Tensor) -> torch.Tensor:
    """Buffers of one batch row, ``(n, *kv)`` -> ``(n * parts * s, hk * d)``: every token row
    of every part (K and V when stacked) as one matrix (a view)."""
    return buffers.reshape(-1, buffers.shape[-2] * buffers.shape[-1])


# Device tensors: a few shapes (a step's layers and passes share one), not every batch's.
@functools.lru_cache(maxsize=4)
def _flat_sources(local_doc_lens: tuple[int, ...], rank: int, world: int, parts: int, s: int,
                  device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per part of a rank's buffer of ``s`` rows (K and V when stacked, ``parts = 2``, else
    the one side-by-side buffer): each global row's row in :func:`_rows_of` of the gathered
    ``(world, *kv)``, int64 on ``device`` (made there once per shape)."""
    schedule = prefix_schedule(local_doc_lens, rank, world)
    base = (schedule.source_rank * (parts * s) + schedule.source_row).to(device)
    return tuple(base + p * s for p in range(parts))


def _sources_of(plan: AttentionPlan, kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    parts, s = (2, kv.shape[2]) if kv.dim() == 5 else (1, kv.shape[1])
    return _flat_sources(plan.local_doc_lens, plan.rank, plan.world, parts, s, kv.device)


def global_kv(every: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """Every rank's K/V ``every`` ``(world, *kv)`` (a stacked ``(2, 1, s, hk, d)`` or side by
    side ``(1, s, hk, dk + dv)`` buffer per rank) -> the row in global order, shaped like
    ``kv`` with ``world * s`` rows (one row gather per part)."""
    world, kv = every.shape[0], every[0]
    shape = list(kv.shape)
    shape[-3] *= world
    glob = every.new_empty(shape)
    rows, glob_rows = _rows_of(every), _rows_of(glob[None])
    index = _sources_of(plan, kv)
    n = index[0].numel()
    for part, src in enumerate(index):
        torch.index_select(rows, 0, src, out=glob_rows[part * n:(part + 1) * n])
    return glob


def prefix_forward(
    plan: AttentionPlan, coll: Collectives, q: torch.Tensor, kv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(1, s, hq, d)``, this rank's K/V buffer ``kv`` -> out ``(1, s, hq, dv)`` and lse
    ``(1, hq, s)``, both float32 (float64 for float64 inputs), before any sink."""
    schedule = prefix_schedule(plan.local_doc_lens, plan.rank, plan.world)
    gathering = coll.start_all_gather(kv)  # travels while the diagonals run on the local K/V
    k, v = unpack_kv(kv, q.shape[-1])
    dtype = accum_dtype(q.dtype)
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=dtype, device=q.device)

    def run(calls: tuple[PrefixCall, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        for call in calls:
            block_out, block_lse = plan.backend.forward(call.q.of(q), call.k.of(k), call.k.of(v), call.causal,
                                                        plan.scale, **plan.kernel_kwargs)
            if call.local:  # the diagonals write every row once
                call.q.of(out).copy_(block_out)
                call.q.of(lse, seq_dim=2).copy_(block_lse)
            else:
                merge_block_(call.q.of(out), call.q.of(lse, seq_dim=2), block_out, block_lse)

    run(schedule.diagonals, k, v)
    glob = global_kv(gathering.wait(), plan)
    del gathering  # the gathered buffers are dropped once reordered
    run(schedule.prefixes, *unpack_kv(glob, q.shape[-1]))
    return out, lse


def prefix_backward(
    plan: AttentionPlan, coll: Collectives, dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq ``(1, s, hq, d)``, dk and dv ``(1, s, hk, d)`` (the input dtype) of this rank's
    rows, from ``dout``, ``q``, its ``kv`` buffer and the forward's final ``out`` and ``lse``."""
    schedule = prefix_schedule(plan.local_doc_lens, plan.rank, plan.world)
    gathering = coll.start_all_gather(kv)  # travels while the diagonals run on the local K/V
    dtype = accum_dtype(q.dtype)
    # The diagonals write every local row once: no zeros for dq and the local dK/dV.
    dq = torch.empty(q.shape, dtype=dtype, device=q.device)
    d_local = torch.empty(kv.shape, dtype=dtype, device=q.device)

    def run(calls: tuple[PrefixCall, ...], buffer: torch.Tensor, d_buffer: torch.Tensor) -> None:
        (k, v), (dk, dv) = unpack_kv(buffer, q.shape[-1]), unpack_kv(d_buffer, q.shape[-1])
        for call in calls:
            dq_c, dk_c, dv_c = plan.backend.backward(call.q.of(dout), call.q.of(q), call.k.of(k), call.k.of(v),
                                                     call.q.of(out), call.q.of(lse, seq_dim=2), call.causal,
                                                     plan.scale, **plan.kernel_kwargs)
            if call.local:  # the diagonals write every local row once
                call.q.of(dq).copy_(dq_c)
                call.k.of(dk).copy_(dk_c)
                call.k.of(dv).copy_(dv_c)
            else:
                call.q.of(dq).add_(dq_c)
                call.k.of(dk).add_(dk_c)
                call.k.of(dv).add_(dv_c)

    run(schedule.diagonals, kv, d_local)
    glob = global_kv(gathering.wait(), plan)
    del gathering  # the gathered buffers are dropped once reordered
    d_glob = torch.zeros(glob.shape, dtype=dtype, device=q.device)
    run(schedule.prefixes, glob, d_glob)
    del glob
    mine = reduce_scatter_global(coll, plan, d_glob, kv).add_(d_local)
    dk, dv = unpack_kv(mine, q.shape[-1])
    return dq.to(q.dtype), dk.to(kv.dtype), dv.to(kv.dtype)


def reduce_scatter_global(coll: Collectives, plan: AttentionPlan, d_glob: torch.Tensor,
                          kv: torch.Tensor) -> torch.Tensor:
    """This rank's gradient of its K/V buffer (``kv``'s shape, ``d_glob``'s dtype): every
    rank's ``d_glob`` (gradients of the row's K/V in global order, shaped like
    :func:`global_kv`'s result) put back in the rows the ranks hold and summed onto them
    (one reduce-scatter)."""
    shares = torch.empty((coll.world, *kv.shape), dtype=d_glob.dtype, device=d_glob.device)
    rows, glob_rows = _rows_of(shares), _rows_of(d_glob[None])
    index = _sources_of(plan, kv)
    n = index[0].numel()
    for part, dst in enumerate(index):
        rows.index_copy_(0, dst, glob_rows[part * n:(part + 1) * n])
    return coll.reduce_scatter(shares)


def prefix_runs_here(plan: AttentionPlan) -> bool:
    """Whether ``plan`` (all-gather) runs the prefix schedule: causal packed rows of one
    batch row, without a window, spans or chunks (the ring's blocks compute those), on a
    kernel without a varlen call (which batches the ring's per-step blocks instead) that
    takes strided batch views (``batched_views``: the prefix calls batch a run's documents)."""
    return (plan.local_doc_lens is not None and plan.causal and plan.window is None and plan.spans is None
            and plan.chunk is None and not plan.varlen and plan.backend.batched_views)


__all__ = ["PrefixCall", "PrefixSchedule", "global_kv", "prefix_backward", "prefix_forward",
           "prefix_runs_here", "prefix_schedule", "reduce_scatter_global"]
