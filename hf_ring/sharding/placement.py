"""Placement of a packed row's documents by length: short ones whole on one rank, long ones
sharded over the context-parallel group, the ranks' work balanced.

Why: with ``placement="sharded"`` every document of a packed row, 40 tokens or 40,000, is
cut into ``2 * cp_size`` pieces and rides the ring, paying per-step blocks, merges and
transfers that a short document cannot amortise (docs/performance.md). A short document
needs no context parallelism at all: kept whole on one rank it is attended there with no
communication. Only the documents too long to place whole without unbalancing the ranks
are sharded (zigzag, over the whole group, so their causal work is equal on every rank).

The plan is a pure function of the row's (padded) document lengths, the CP size and the
settings, so every rank of a CP group computes the same one from the same batch: the
collator to cut the row, the model's guard to know which global token each local one is,
the attention to split each layer's call; nothing is exchanged to agree on it.

A rank's local row is laid out as: first its zigzag shard of every sharded document (in
document order; every rank holds the same number of these tokens, which the ring needs),
then the documents it holds whole (in document order). Local lengths differ across ranks.

Work model (``PlacementCosts``): a document of ``n`` tokens costs ``n`` (the per-token
layers: projections, MLP, norms, loss) plus ``n * n / (2 * crossover)`` (causal attention,
quadratic), in units of one token's per-token work; ``crossover`` is the length at which a
token's attention costs as much as its per-token layers (measured: benchmarks/placement.py).
A sharded document adds ``1 / cp_size`` of its work to every rank.

The search: the documents in decreasing work; for ``k = 0, 1, ...`` the ``k`` heaviest are
sharded and the rest placed whole, heaviest first, each on the least-loaded rank that still
has room under ``max_tokens_per_rank`` (ties: the lowest rank); the first ``k`` whose most
loaded rank is within ``tolerance`` of the mean wins. Sharding every document (``k = n``) is
today's layout, always balanced, so a plan always exists unless the tokens alone exceed
``max_tokens_per_rank``. Sub-groups (a document over 2 of 4 ranks) are not planned yet.

``placement="auto"`` (``placement_auto.py``) weighs what sharding costs beyond the work itself:
each sharded document adds, on every rank, ``cp_size * ring_doc_step`` (a ring step's
kernel call, merge and transfer latency for its block, per step) and ``ring_token`` per
token of its K/V the rank receives (``(cp_size - 1) * n / cp_size``); both measured
(``benchmarks/ring_overhead.py``). Of the by-length plan and sharding every document it
takes the one whose most loaded rank costs less, so it never models a plan dearer than
either; logged like the by-length plan.

Must not import torch.distributed or any other layer of hf_ring.
"""

from __future__ import annotations

import functools
import heapq
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from hf_ring.sharding.layouts import shard_indices

PLACEMENTS = ("sharded", "by_length", "auto")
# Whole on no rank: sharded over the group.
SHARDED = -1
# PlacementCosts' ring overhead defaults (see there): benchmarks/ring_overhead.py on this project's
# 2-core CPU over gloo, 2026-12-07, load average 4-5 from other work: per document and ring step
# fitted to 0 (the per-token term explains the rows), per token 0.99 of a token's per-token work,
# most of it the ranks waiting on each other at every ring step (by_length's whole documents
# never wait): a quieter machine, or NVLink, would give less.
RING_DOC_STEP = 0.0
RING_TOKEN = 1.0
logger = logging.getLogger("hf_ring")


def check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose one of {', '.join(PLACEMENTS)}")


def check_placement_settings(placement: str, max_tokens_per_rank: Optional[int], layout: str = "zigzag") -> None:
    """A placement, its token bound and the layout it shards in, checked (ValueError)."""
    check_placement(placement)
    if places_documents(placement) and layout != "zigzag":
        raise ValueError(f"placement={placement!r} shards the long documents of packed rows in the zigzag layout, "
                         f"got layout={layout!r}; use layout='zigzag'")
    if max_tokens_per_rank is not None:
        if isinstance(max_tokens_per_rank, bool) or not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank must be a positive int or None, got {max_tokens_per_rank!r}")
        if not places_documents(placement):
            raise ValueError(f"max_tokens_per_rank bounds a placed row only, got placement={placement!r}; pass "
                             "placement='by_length' or 'auto'")


def places_documents(placement: str) -> bool:
    """Whether ``placement`` plans each packed row (``"by_length"``, ``"auto"``): the ranks'
    rows then follow a :class:`DocumentPlacement`, not the per-document zigzag of ``"sharded"``."""
    check_placement(placement)
    return placement != "sharded"


@dataclass(frozen=True)
class PlacementCosts:
    """The work model of the plan (module docstring), validated on creation.

    Attributes:
        crossover: tokens at which one token's causal attention costs as much as its
            per-token layers. Measured for the example's default model on a 2-core CPU by
            ``benchmarks/placement.py`` (docs/performance.md); larger models have a larger
            one (more per-token work per attention flop).
        tolerance: the most loaded rank may carry at most ``1 + tolerance`` times the mean.
        ring_doc_step: ``placement="auto"``: what one sharded document's block costs a rank
            per ring step beyond its attention (kernel call, merge, transfer latency), in
            tokens of per-token work.
        ring_token: ``placement="auto"``: what a rank pays per token of a sharded document's
            K/V it receives (and sends back as dK/dV), in tokens of per-token work.
    """

    # Measured, not guessed: benchmarks/placement.py fits t(n) = c + a n + b n^2 to the example's
    # default model (hidden 128, 2 layers) on one document of 256-8192 tokens, forward + backward,
    # one thread of this project's 2-core CPU: a / (2 b) = 590 tokens (2026-12-07,
    # benchmarks/results/placement_costs.json; 747 in a run under heavier load). The guess it
    # replaces, 2048, weighed a long document's attention 3.5x too lightly. A larger model on a GPU
    # has a larger one (Llama-3-8B on H100s: about 13,000 by the same arithmetic, modelled in
    # docs/performance.md); place_by_length(..., costs=PlacementCosts(crossover=...)) takes it.
    crossover: float = 600.0
    tolerance: float = 0.10
    # Measured by benchmarks/ring_overhead.py (benchmarks/results/ring_overhead.json): the
    # example's default model, a whole training step over gloo, rows of equal documents of
    # 64-1024 tokens at cp 2 and 4, sharded against each document whole.
    ring_doc_step: float = RING_DOC_STEP
    ring_token: float = RING_TOKEN

    def __post_init__(self) -> None:
        if not self.crossover > 0:
            raise ValueError(f"crossover must be a positive number of tokens, got {self.crossover!r}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance!r}")
        for name in ("ring_doc_step", "ring_token"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be a non-negative number of tokens, got {getattr(self, name)!r}")

    def work(self, n: int) -> float:
        """The work of one whole document of ``n`` tokens."""
        return n + n * n / (2.0 * self.crossover)

    def ring_cost(self, n: int, cp_size: int) -> float:
        """What sharding a document of ``n`` tokens over ``cp_size`` ranks adds on each rank
        beyond ``work(n) / cp_size`` (the module docstring)."""
        return cp_size * self.ring_doc_step + (cp_size - 1) * n / cp_size * self.ring_token


@dataclass(frozen=True)
class DocumentPlacement:
    """Where each document of one packed row goes.

    Attributes:
        doc_lens: the row's global document lengths (padded: each a multiple of ``2 * cp_size``).
        cp_size: ranks in the CP group.
        owner: per document, the CP rank holding it whole, or ``SHARDED`` (-1).
        loads: each rank's work under the plan's cost model.
    """

    doc_lens: tuple[int, ...]
    cp_size: int
    owner: tuple[int, ...]
    loads: tuple[float, ...]

    @property
    def sharded_lens(self) -> tuple[int, ...]:
        """Global lengths of the sharded documents, in row order."""
        return tuple(n for n, o in zip(self.doc_lens, self.owner) if o == SHARDED)

    def whole_lens(self, rank: int) -> tuple[int, ...]:
        """Lengths of the documents ``rank`` holds whole, in row order."""
        return tuple(n for n, o in zip(self.doc_lens, self.owner) if o == rank)

    @property
    def sharded_local_len(self) -> int:
        """Tokens of the sharded documents on every rank (the front of each local row)."""
        return sum(self.sharded_lens) // self.cp_size

    def local_len(self, rank: int) -> int:
        return self.sharded_local_len + sum(self.whole_lens(rank))

    def local_indices(self, rank: int) -> torch.Tensor:
        """int64 ``(local_len(rank),)``: the global row index of each of ``rank``'s local
        tokens, in local order (sharded documents' zigzag shards, then whole documents)."""
        return _local_indices(self, rank)

    @property
    def imbalance(self) -> float:
        """The most loaded rank's work over the mean, minus 1."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean - 1.0 if mean > 0 else 0.0

    def describe(self) -> str:
        sharded = self.sharded_lens
        return (f"{len(self.doc_lens)} documents ({sum(self.doc_lens)} tokens) over {self.cp_size} ranks: "
                f"{len(sharded)} sharded ({sum(sharded)} tokens), "
                f"{len(self.doc_lens) - len(sharded)} whole; tokens per rank "
                f"{[self.local_len(r) for r in range(self.cp_size)]}, work per rank within "
                f"{100 * self.imbalance:.1f} % of the mean")


@functools.lru_cache(maxsize=64)
def _local_indices(placement: DocumentPlacement, rank: int) -> torch.Tensor:
    starts = [0]
    for n in placement.doc_lens:
        starts.append(starts[-1] + n)
    sharded = [starts[i] + shard_indices(n, placement.cp_size, rank, "zigzag")
               for i, (n, o) in enumerate(zip(placement.doc_lens, placement.owner)) if o == SHARDED]
    whole = [torch.arange(starts[i], starts[i] + n)
             for i, (n, o) in enumerate(zip(placement.doc_lens, placement.owner)) if o == rank]
    parts = sharded + whole
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def assign_documents(order: list[int], doc_lens: Sequence[int], work: list[float], k: int, cp_size: int,
            max_tokens: Optional[int]) -> Optional[tuple[tuple[int, ...], tuple[float, ...]]]:
    """The ``k`` heaviest documents of ``order`` sharded, the rest whole, heaviest first on
    the least-loaded rank with room; None when one does not fit under ``max_tokens``."""
    owner = [SHARDED] * len(doc_lens)
    base_work = sum(work[i] for i in order[:k]) / cp_size
    base_tokens = sum(doc_lens[i] for i in order[:k]) // cp_size
    loads = [base_work] * cp_size
    tokens = [base_tokens] * cp_size
    heap = [(base_work, r) for r in range(cp_size)]
    for i in order[k:]:
        skipped = []
        while heap and max_tokens is not None and tokens[heap[0][1]] + doc_lens[i] > max_tokens:
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        _, r = heapq.heappop(heap)
        owner[i] = r
        loads[r] += work[i]
        tokens[r] += doc_lens[i]
        heapq.heappush(heap, (loads[r], r))
        for item in skipped:
            heapq.heappush(heap, item)
    return tuple(owner), tuple(loads)


def place_by_length(doc_lens: tuple[int, ...], cp_size: int, max_tokens_per_rank: Optional[int] = None,
                    costs: PlacementCosts = PlacementCosts()) -> DocumentPlacement:
    """The placement of a packed row's documents (module docstring); cached per row shape,
    and logged (logger ``hf_ring``) the first time a process plans that shape: the process's
    first plan at INFO, later ones at DEBUG.

    Args:
        doc_lens: global document lengths, each a positive multiple of ``2 * cp_size``.
        cp_size: ranks in the CP group.
        max_tokens_per_rank: the most tokens one rank may hold (None: no bound).
        costs: the work model.

    Raises:
        ValueError: lengths that cannot be sharded, or a row whose tokens exceed
            ``cp_size * max_tokens_per_rank`` even when every document is sharded.
    """
    return _place(tuple(doc_lens), cp_size, max_tokens_per_rank, costs)


@functools.lru_cache(maxsize=256)
def _place(doc_lens: tuple[int, ...], cp_size: int, max_tokens_per_rank: Optional[int],
           costs: PlacementCosts) -> DocumentPlacement:
    placement = search_by_length(doc_lens, cp_size, max_tokens_per_rank, costs)
    # The first plan of a process at INFO (what the run does), every new row shape after it at DEBUG.
    first = _place.cache_info().currsize == 0
    logger.log(logging.INFO if first else logging.DEBUG, "[hf_ring] placement by length: %s", placement.describe())
    return placement


def check_row(doc_lens: tuple[int, ...], cp_size: int, max_tokens_per_rank: Optional[int]) -> None:
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    for i, n in enumerate(doc_lens):
        if not isinstance(n, int) or n <= 0 or n % (2 * cp_size):
            raise ValueError(f"document {i} has length {n!r}: by-length placement takes lengths that are positive "
                             f"multiples of 2 * cp_size = {2 * cp_size} (RingDataCollator pads them so)")
    if max_tokens_per_rank is not None and sum(doc_lens) > cp_size * max_tokens_per_rank:
        raise ValueError(f"the packed row holds {sum(doc_lens)} tokens, more than cp_size x max_tokens_per_rank = "
                         f"{cp_size} x {max_tokens_per_rank}: raise max_tokens_per_rank or put fewer documents in a "
                         "batch")


def search_by_length(doc_lens: tuple[int, ...], cp_size: int, max_tokens_per_rank: Optional[int],
                     costs: PlacementCosts) -> DocumentPlacement:
    """:func:`place_by_length`'s search itself (module docstring), neither cached nor logged."""
    check_row(doc_lens, cp_size, max_tokens_per_rank)
    work = [costs.work(n) for n in doc_lens]
    order = sorted(range(len(doc_lens)), key=lambda i: (-work[i], i))
    mean = sum(work) / cp_size
    # A document heavier than the most one rank may carry cannot stay whole.
    k = sum(1 for w in work if w > (1 + costs.tolerance) * mean)
    while k < len(doc_lens):
        found = assign_documents(order, doc_lens, work, k, cp_size, max_tokens_per_rank)
        if found is not None and max(found[1]) <= (1 + costs.tolerance) * mean:
            return DocumentPlacement(doc_lens, cp_size, *found)
        k += 1
    owner, loads = assign_documents(order, doc_lens, work, len(doc_lens), cp_size, max_tokens_per_rank)
    return DocumentPlacement(doc_lens, cp_size, owner, loads)


def shard_placed(x: torch.Tensor, placement: DocumentPlacement, rank: int, dim: int = 1) -> torch.Tensor:
    """``rank``'s local row of a packed sequence ``x`` (sequence along ``dim``) under ``placement``."""
    dim = dim % x.dim()
    if x.shape[dim] != sum(placement.doc_lens):
        raise ValueError(f"x has {x.shape[dim]} tokens along dim {dim} but the placement's documents cover "
                         f"{sum(placement.doc_lens)}; they must describe the same packed row")
    return x.index_select(dim, placement.local_indices(rank).to(x.device))


__all__ = ["PLACEMENTS", "SHARDED", "DocumentPlacement", "PlacementCosts", "assign_documents", "check_placement",
           "check_placement_settings", "check_row", "place_by_length", "places_documents", "search_by_length",
           "shard_placed"]
