"""Packed rows under every pattern (ring, all-gather, Ulysses, hybrid): documents of uneven lengths,
each zigzag-sharded on its own, against float64 attention computed document by document.

Each document is padded at its end to a multiple of 2 * cp_size (as the collator does).
Padding sits after the document's real tokens, so under the causal mask no real query
sees it, and the padding rows get a zero output gradient (their labels are ignored), so
real tokens' out, lse and gradients must match the reference on the unpadded documents.
Tolerance 1e-5 relative for float32 inputs, as for dense rows; 1e-12 for the float64
plain-math kernel (the same sums as the reference, in another order).

The second set of documents has runs of one length (four of 8 tokens, two of 24 at
cp_size 4), which the ring batches into one kernel call per run (ring/block_runs.py); a
run's end next to a document of another length is covered too.
"""

from __future__ import annotations

import weakref

import pytest
import torch

import hf_ring
from distributed import run_world
from hf_ring.sharding import shard_packed, unshard_packed
from closeness import rel_err
from reference_attention import full_attention

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

REAL_LENS = (13, 3, 22, 7)  # includes one document shorter than 2 * cp_size
RUN_LENS = (13, 8, 8, 8, 3, 22, 22, 7)  # padded at cp 4: 16, 8, 8, 8, 8, 24, 24, 8
HQ, HK, D = 8, 2, 64


def _layout(world: int, lens=REAL_LENS):
    """Padded global boundaries, and the positions of real tokens in the padded row."""
    multiple = 2 * world
    padded = [-(-n // multiple) * multiple for n in lens]
    cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    real = torch.cat([torch.arange(n) + int(cu[i]) for i, n in enumerate(lens)])
    return cu, real


def _inputs(world: int, lens=REAL_LENS):
    cu, real = _layout(world, lens)
    total = int(cu[-1])
    g = torch.Generator().manual_seed(7)
    q = torch.randn(total, HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(total, HK, D, generator=g, dtype=torch.float64)
    v = torch.randn(total, HK, D, generator=g, dtype=torch.float64)
    dout = torch.zeros(total, HQ, D, dtype=torch.float64)
    dout[real] = torch.randn(real.numel(), HQ, D, generator=g, dtype=torch.float64)
    return cu, real, q, k, v, dout


def _rank_results(rank: int, world: int, lens=REAL_LENS, backend: str = "auto", pattern: str = "ring") -> dict:
    cu, _, q, k, v, dout = _inputs(world, lens)
    shard = lambda t: shard_packed(t, cu, world, rank, dim=0)
    dtype = torch.float64 if backend == "reference" else torch.float32
    ql, kl, vl = (shard(t).to(dtype).requires_grad_() for t in (q, k, v))
    pattern, _, ulysses = pattern.partition("/")  # "hybrid/2": Ulysses groups of 2
    out, lse = hf_ring.ring_flash_attn_varlen_func(ql, kl, vl, cu, return_lse=True, backend=backend, pattern=pattern,
                                                   ulysses_size=int(ulysses) if ulysses else None)
    out.backward(shard(dout).to(dtype))
    return {"out": out, "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}


def _per_document_reference(q, k, v, dout, cu, lens):
    """Float64 attention on each unpadded document separately, scattered back."""
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for i, n in enumerate(lens):
        idx = torch.arange(n) + int(cu[i])
        qd, kd, vd = (t[idx].unsqueeze(0).clone().requires_grad_() for t in (q, k, v))
        o, l = full_attention(qd, kd, vd, causal=True)
        o.backward(dout[idx].unsqueeze(0))
        out[idx], lse[:, idx] = o.detach()[0], l[0]
        for g, t in zip(grads, (qd, kd, vd)):
            g[idx] = t.grad[0]
    return {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}


@pytest.mark.parametrize("world, lens, backend, pattern", [
    # RUN_LENS has documents of uneven lengths too: cp 4 runs on it alone.
    (1, REAL_LENS, "auto", "ring"), (2, REAL_LENS, "auto", "ring"),
    (1, RUN_LENS, "auto", "ring"), (4, RUN_LENS, "auto", "ring"), (1, RUN_LENS, "reference", "ring"),
    # The all-gather pattern: every rank's K/V gathered, each chunk against its document's prefix.
    (3, REAL_LENS, "reference", "allgather"), (4, RUN_LENS, "auto", "allgather"),
    # Ulysses: the row put back in order for this rank's heads, each document alone (K/V heads
    # repeated at cp 4: 2 K/V heads over 4 ranks).
    (2, REAL_LENS, "reference", "ulysses"), (4, RUN_LENS, "auto", "ulysses"),
    # Hybrid: Ulysses inside groups of 2, the ring's packed schedule across the 2 groups (each
    # group holds chunks g and 3 - g of every document in the ring's zigzag over the groups).
    (4, REAL_LENS, "reference", "hybrid/2"), (4, RUN_LENS, "auto", "hybrid/2"),
])
def test_packed_ring_matches_per_document_attention(world, lens, backend, pattern):
    cu, real, q, k, v, dout = _inputs(world, lens)
    ref = _per_document_reference(q, k, v, dout, cu, lens)
    if world == 1:
        per_rank = [_rank_results(0, 1, lens, backend, pattern)]
    else:
        per_rank = run_world(world, _rank_results, lens, backend, pattern)
    tol = 1e-12 if backend == "reference" else 1e-5
    for name in ref:
        dim = 1 if name == "lse" else 0
        full = unshard_packed([r[name] for r in per_rank], cu, dim=dim)
        got, want = full.index_select(dim, real), ref[name].index_select(dim, real)
        assert rel_err(got, want) <= tol, (name, rel_err(got, want))


def test_equal_documents_run_as_one_call_per_step():
    """At cp 4 the run of four 8-token documents (2 local tokens each) is one call per step,
    and so are the two 24-token ones: 8 documents, 5 calls per step."""
    from hf_ring.kernels import get_backend
    from hf_ring.patterns.plan import AttentionPlan
    from hf_ring.patterns.ring.block_runs import BlockRun

    cu, _ = _layout(4, RUN_LENS)
    local = tuple(int(n) // 4 for n in (cu[1:] - cu[:-1]))
    kernel = get_backend("torch_cpu_flash", torch.device("cpu"), torch.float32)
    plan = AttentionPlan(None, 1, 4, "zigzag", True, 0.1, kernel, local_doc_lens=local)
    for step in range(4):
        blocks = plan.blocks(step, sum(local))
        calls = plan.kernel_calls(blocks)
        assert [c.count if isinstance(c, BlockRun) else 1 for c in calls] == [1, 4, 2, 1]
        assert [b for c in calls for b in (c.members if isinstance(c, BlockRun) else [c])] == blocks


def test_varlen_input_errors():
    q = torch.randn(8, 4, 16)
    with pytest.raises(ValueError, match="total_local, n_heads, head_dim"):
        hf_ring.ring_flash_attn_varlen_func(q.unsqueeze(0), q.unsqueeze(0), q.unsqueeze(0), torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="q holds 8 local tokens"):
        hf_ring.ring_flash_attn_varlen_func(q, q, q, torch.tensor([0, 6]))


def test_allgather_on_packed_rows_runs_a_few_large_calls_per_run_of_documents():
    """After the all-gather each local chunk of each document sees its document's prefix
    (ring/prefix.py): per run of equal documents one call for the diagonals and one per
    chunk's prefix (none for rank 0's first chunk), whatever the number of documents; the
    forward, counted through the kernel, equals per-document attention (float64, 1e-12)."""
    import dataclasses

    from hf_ring.distributed.collectives import VirtualCollectives
    from hf_ring.kernels import get_backend
    from hf_ring.patterns.plan import AttentionPlan
    from hf_ring.patterns.ring.prefix import prefix_forward

    world, lens = 4, RUN_LENS  # padded at cp 4: 16, 8, 8, 8, 8, 24, 24, 8: four runs
    cu, real, q, k, v, _ = _inputs(world, lens)
    reference = _per_document_reference(q, k, v, torch.zeros_like(q), cu, lens)
    local = tuple(int(n) // world for n in (cu[1:] - cu[:-1]))
    calls = []
    kernel = get_backend("reference", torch.device("cpu"), torch.float64)

    def counted(*args, **kwargs):
        calls.append(args[3])  # the causal flag
        return kernel.forward(*args, **kwargs)

    counting = dataclasses.replace(kernel, forward=counted)
    shard = lambda t, r: shard_packed(t, cu, world, r, dim=0)[None]  # noqa: E731
    every = [torch.stack([shard(k, r), shard(v, r)]) for r in range(world)]
    outs = []
    for rank in range(world):
        calls.clear()
        plan = AttentionPlan(None, rank, world, "zigzag", True, D ** -0.5, counting, local_doc_lens=local,
                             pattern="allgather")
        out, _ = prefix_forward(plan, VirtualCollectives(rank, every), shard(q, rank), every[rank])
        outs.append(out[0])
        runs = 4
        assert calls.count(True) == runs and calls.count(False) == (runs if rank == 0 else 2 * runs), (rank, calls)
    got = unshard_packed(outs, cu, dim=0).index_select(0, real)
    assert rel_err(got, reference["out"].index_select(0, real)) <= 1e-12


class _GatherWatch:
    """Every rank's K/V delivered in one process (VirtualCollectives), noting how many
    kernel calls had run when an all-gather was started and when it was first waited for, and keeping a weak
    reference to each gathered buffer it delivered."""

    def __init__(self, rank: int, every: list, calls: list) -> None:
        from hf_ring.distributed.collectives import VirtualCollectives

        self.inner, self.calls = VirtualCollectives(rank, every), calls
        self.calls_at_start, self.calls_before_wait = [], []
        self.rank, self.world = rank, len(every)
        self.delivered = []

    def gathered_alive(self) -> bool:
        return any(ref() is not None for ref in self.delivered)

    def start_all_gather(self, x):
        watch = self
        self.calls_at_start.append(len(self.calls))

        class Pending:
            waited = False

            def wait(self):
                if not self.waited:
                    watch.calls_before_wait.append(len(watch.calls))
                    self.waited = True
                    self.gathered = watch.inner.all_gather(x)
                    watch.delivered.append(weakref.ref(self.gathered))
                return self.gathered

        return Pending()

    def reduce_scatter(self, x):
        return self.inner.reduce_scatter(x)


@pytest.mark.parametrize("packed", [True, False])
def test_allgather_runs_the_local_blocks_while_the_gather_travels(packed: bool):
    """The all-gather is started before any kernel call and waited for only once the calls
    on this rank's own K/V have run: a packed row's diagonals (one per run of equal
    documents, forward and backward), a one-document row's ring step 0; every later call
    after the wait. On packed rows the gathered buffer is freed once put in the row's order,
    before the first prefix call. (Exactness over gloo: test_packed_ring_matches_per_document_attention's
    all-gather cases, and tests/test_cp_patterns.py.)"""
    import dataclasses

    from hf_ring.kernels import get_backend
    from hf_ring.patterns.allgather import allgather_backward, allgather_forward
    from hf_ring.patterns.plan import AttentionPlan

    world = 4
    cu, _, q, k, v, dout = _inputs(world, RUN_LENS)
    local = tuple(int(n) // world for n in (cu[1:] - cu[:-1])) if packed else None
    if packed:
        shard = lambda t, r: shard_packed(t, cu, world, r, dim=0)[None]  # noqa: E731
    else:
        shard = lambda t, r: hf_ring.shard_sequence(t[None], world, r, layout="zigzag")  # noqa: E731
    kernel = get_backend("reference", torch.device("cpu"), torch.float64)
    calls, gathered_alive_at_call = [], []

    def counted(name):
        def call(*args, **kwargs):
            calls.append(name)
            gathered_alive_at_call.append(coll.gathered_alive())
            return getattr(kernel, name)(*args, **kwargs)
        return call

    counting = dataclasses.replace(kernel, forward=counted("forward"), backward=counted("backward"))
    every = [torch.stack([shard(k, r), shard(v, r)]) for r in range(world)]
    for rank in range(world):
        plan = AttentionPlan(None, rank, world, "zigzag", True, D ** -0.5, counting, local_doc_lens=local,
                             pattern="allgather")
        coll = _GatherWatch(rank, every, calls)
        ql, dl = shard(q, rank), shard(dout, rank)
        calls.clear()
        gathered_alive_at_call.clear()
        out, lse = allgather_forward(plan, coll, ql, every[rank])
        n_fwd = len(calls)
        allgather_backward(plan, coll, dl, ql, every[rank], out, lse)
        local_calls = 4 if packed else len(plan.blocks(0, ql.shape[1]))  # four runs of equal documents
        assert coll.calls_at_start == [0, n_fwd], (rank, coll.calls_at_start)
        assert coll.calls_before_wait == [local_calls, n_fwd + local_calls], (rank, coll.calls_before_wait)
        assert 0 < local_calls < n_fwd, (rank, local_calls, n_fwd)
        if packed:  # the dense row's steps read the gathered buffer itself
            assert not any(gathered_alive_at_call), (rank, gathered_alive_at_call)
