"""``pattern="auto"``: which context-parallel pattern to run, from what every rank knows alike.

Why a rule and not a measurement: a timed choice could differ between ranks, and ranks
that run different patterns deadlock. The inputs here are the same on every rank of a CP
group (head counts and features come from the model or the call, the sequence length and
the group's size and placement were agreed on), so every rank picks the same pattern.

The rule, per attention call (a model whose layers differ, e.g. Gemma's sliding and full
layers, may get one pattern per kind of layer):

1. One rank: ``"ring"`` (it is then plain local attention).
2. The group inside one node and the query heads divisible by its size: ``"ulysses"``.
   Per token and layer a rank moves ``(2 * n_heads + 2 * n_kv_heads) * (cp - 1) / cp``
   head vectors (q, k, v there, out back) against the ring's ``2 * n_kv_heads * (cp - 1)``,
   in two all-to-alls that fast intra-node links serve well, and each rank then runs one
   full-sequence kernel with no per-step merge (the public 64K-token measurement the issue
   cites: Ulysses 0-8% below cp=1, the ring about 30%).
3. The group across nodes: ``"hybrid"`` with the largest Ulysses group that fits inside a
   node and divides the query heads (all-to-all on the fast links, the ring across them).
4. Otherwise (heads not divisible), by the length a rank holds: below
   :data:`ALLGATHER_BELOW` tokens, ``"allgather"`` (the ring's per-step blocks are too
   short to hide a transfer behind; one all-gather moves the same K/V bytes at one
   latency); from it on, ``"ring"`` (its transfers hide behind compute, and it never holds
   more than two K/V blocks where all-gather holds the whole sequence's).

A pattern that refuses the call (a feature it or its kernel does not compute: a window,
logit softcapping, sinks, or head counts it cannot split) is skipped for the next one; the
refusal comes before any transfer and alike on every rank (same inputs, same code), so
the ranks skip together. The choice and its reason are logged once per process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

T = TypeVar("T")

# Tokens per rank below which the ring's blocks are too short to hide a transfer behind
# (on an H100-class GPU a 1K x 1K block of 128-dim heads is ~10 us of compute, about a
# transfer's latency).
ALLGATHER_BELOW = 1024

logger = logging.getLogger("hf_ring")
_LOGGED: set[tuple] = set()  # decisions already logged by this process


@dataclass(frozen=True)
class PatternChoice:
    """What ``auto`` picked: the pattern, its Ulysses group size (hybrid only) and why."""

    pattern: str
    ulysses_size: Optional[int]
    reason: str

    def describe(self) -> str:
        size = f" (ulysses_size={self.ulysses_size})" if self.ulysses_size else ""
        return f"pattern 'auto' picked {self.pattern!r}{size}: {self.reason}"


def _nodes(ranks: range, local_world_size: int) -> int:
    """Nodes spanned by the global ``ranks``, placed node by node (as torchrun and
    accelerate launch place them)."""
    return len({r // local_world_size for r in ranks})


def hybrid_sizes(cp_size: int, local_world_size: int, first_rank: int = 0, rank_stride: int = 1) -> list[int]:
    """The Ulysses group sizes ``auto`` may pick for a CP group spanning nodes, largest first:
    ``u`` consecutive ranks of the group (``u`` divides ``cp_size``), every group inside a
    node. Empty for a group inside one node (``auto`` then picks Ulysses itself). Read once by
    ``setup_context_parallel``, which builds these subgroups up front."""
    ranks = range(first_rank, first_rank + cp_size * rank_stride, rank_stride)
    if cp_size == 1 or _nodes(ranks, local_world_size) == 1:
        return []
    return [u for u in range(min(local_world_size, cp_size), 1, -1)
            if cp_size % u == 0 and all(_nodes(ranks[g:g + u], local_world_size) == 1 for g in range(0, cp_size, u))]


def pattern_candidates(
    n_heads: int,
    n_kv_heads: int,
    seq_len: int,
    cp_size: int,
    local_world_size: int,
    first_rank: int = 0,
    rank_stride: int = 1,
) -> list[PatternChoice]:
    """The patterns ``auto`` tries for one attention call, best first.

    Args:
        n_heads, n_kv_heads: the call's query and K/V head counts.
        seq_len: the full sequence's length in tokens.
        cp_size: the context-parallel group's size.
        local_world_size: processes per node (``LOCAL_WORLD_SIZE``), ranks placed node by node.
        first_rank: the global rank of the CP group's first rank.
        rank_stride: how far apart the group's global ranks are (the TP size: TP is the
            innermost mesh axis, ``hf_ring.distributed.mesh``).
    """
    heads = f"{n_heads} query / {n_kv_heads} K/V heads"
    ranks = range(first_rank, first_rank + cp_size * rank_stride, rank_stride)
    nodes = _nodes(ranks, local_world_size)
    where = "one node" if nodes == 1 else f"{nodes} nodes"
    candidates: list[PatternChoice] = []
    if cp_size == 1:
        return [PatternChoice("ring", None, "one rank: local attention")]
    if nodes == 1 and n_heads % cp_size == 0:
        candidates.append(PatternChoice("ulysses", None, f"cp={cp_size} inside {where} and {heads} divide over "
                                                         "it: two all-to-alls on intra-node links, one full-sequence kernel"))
    if nodes > 1:
        sizes = [u for u in hybrid_sizes(cp_size, local_world_size, first_rank, rank_stride) if n_heads % u == 0]
        if sizes:
            candidates.append(PatternChoice("hybrid", sizes[0], f"cp={cp_size} spans {where}: Ulysses over {sizes[0]} "
                                                                f"ranks inside a node ({heads}), the ring across nodes"))
    local = seq_len // cp_size
    short = PatternChoice("allgather", None, f"{local} tokens per rank, below {ALLGATHER_BELOW}: too short for the "
                                             "ring to hide its transfers; one all-gather of K/V instead")
    long = PatternChoice("ring", None, f"{local} tokens per rank: the ring hides its transfers behind compute and "
                                       "holds two K/V blocks")
    return candidates + ([short, long] if local < ALLGATHER_BELOW else [long, short])


@dataclass(frozen=True)
class PackedCost:
    """Seconds per unit of each of a pattern's terms (:func:`packed_terms`) for one rank's
    forward+backward of one attention layer on a packed row, fitted on one kind of device
    to the pattern's measured times (``benchmarks/packed_pattern_cost.py``; the fit and its
    error: docs/performance.md). Each pattern has its own coefficients: its kernel calls
    differ in shape (the ring's small blocks, the all-gather's chunk against a prefix), so a
    product or a call does not cost both the same."""

    per_pattern: dict[str, dict[str, float]]  # pattern -> term -> seconds per unit
    source: str  # the measured figures it was fitted to


# A device without figures gets the ring, saying so: a guess could pick the slower pattern
# silently. tests/test_pattern_auto.py fits the committed figures again and checks these.
PACKED_COSTS: dict[str, PackedCost] = {
    "cpu": PackedCost({"ring": {"work": 8.212e-11, "call": 9.25e-05, "merge": 5.098e-09},
                       "allgather": {"work": 8.4e-11, "call": 2.121e-04, "gathered": 7.686e-09}},
                      "fitted to benchmarks/results/packed_pattern_cost.jsonl, 2 threads, 2026-12-06"),
}


def _runs(local_doc_lens: tuple[int, ...]) -> int:
    """How many runs of consecutive documents of one length (one kernel call each)."""
    return sum(1 for i, n in enumerate(local_doc_lens) if i == 0 or local_doc_lens[i - 1] != n)


def packed_terms(local_doc_lens: tuple[int, ...], world: int, n_heads: int, n_kv_heads: int,
                 head_dim: int) -> dict[str, dict[str, float]]:
    """Per pattern (``"ring"``, ``"allgather"``), the amounts :class:`PackedCost` prices, for
    one rank's forward+backward of one layer on a packed row of documents of
    ``local_doc_lens`` local tokens each over ``world`` ranks.

    - ``work``: the row's causal products ``sum(n**2) / 2 * heads * dim``, a rank's share;
    - ``call``: the ring makes ``2 * world + 1`` block calls per run of equal documents
      (three blocks at its own step, two at each other), the all-gather three (the
      diagonals, each chunk's prefix; ``ring/prefix.py``);
    - ``merge``: the ring merges a rank's output at each of its ``world - 1`` later steps;
    - ``gathered``: the all-gather puts the whole row's K/V in order and its dK/dV shares back.
    """
    runs = _runs(local_doc_lens)
    local = sum(local_doc_lens)
    work = sum((n * world) ** 2 for n in local_doc_lens) / 2 * n_heads * head_dim / world
    return {
        "ring": {"work": work, "call": runs * (2 * world + 1), "merge": (world - 1) * local * n_heads * head_dim},
        "allgather": {"work": work, "call": runs * 3, "gathered": world * local * 2 * n_kv_heads * head_dim},
    }


def packed_seconds(cost: PackedCost, pattern: str, terms: dict[str, float]) -> float:
    """Predicted seconds of ``pattern``'s ``terms`` (:func:`packed_terms`) at ``cost``."""
    return sum(cost.per_pattern[pattern][name] * amount for name, amount in terms.items())


def packed_candidates(local_doc_lens: tuple[int, ...], world: int, n_heads: int, n_kv_heads: int, head_dim: int,
                      device_type: str) -> list[PatternChoice]:
    """The patterns ``auto`` tries for a packed row, best first: the ring and the all-gather,
    ordered by :data:`PACKED_COSTS`' prediction for ``device_type``; the ring first where no
    figures were measured."""
    docs = f"packed rows ({len(local_doc_lens)} documents, {_runs(local_doc_lens)} runs of one length)"
    cost = PACKED_COSTS.get(device_type)
    if cost is None:
        return [PatternChoice("ring", None, f"{docs}: no figures measured on {device_type} to choose by; the ring"),
                PatternChoice("allgather", None, f"{docs}: the ring refused")]
    terms = packed_terms(local_doc_lens, world, n_heads, n_kv_heads, head_dim)
    seconds = {p: packed_seconds(cost, p, t) for p, t in terms.items()}
    said = ", ".join(f"{p} {s * 1e3:.2f} ms" for p, s in seconds.items())
    order = sorted(seconds, key=seconds.get)
    return [PatternChoice(p, None, f"{docs}: predicted per layer, forward+backward, {said} ({cost.source})")
            for p in order]


def first_that_runs(candidates: list[PatternChoice], attempt: Callable[[PatternChoice], T]) -> tuple[T, PatternChoice]:
    """``attempt`` the candidates in order; the first that does not raise NotImplementedError
    (a pattern or its kernel refusing the call's features, before any transfer, alike on
    every rank) wins. Its reason then names the ones skipped and why.

    Raises:
        NotImplementedError: every candidate refused; the message lists each refusal.
    """
    skipped = []
    for choice in candidates:
        try:
            result = attempt(choice)
        except NotImplementedError as e:
            skipped.append(f"{choice.pattern} refused: {e}")
            continue
        if skipped:
            choice = PatternChoice(choice.pattern, choice.ulysses_size, f"{choice.reason} ({'; '.join(skipped)})")
        return result, choice
    raise NotImplementedError("pattern 'auto': no context-parallel pattern computes this call: " + "; ".join(skipped))


def log_choice_once(choice: PatternChoice, kind: tuple, what: str) -> None:
    """Log (INFO, logger ``"hf_ring"``) one line saying what ``auto`` picked for a call
    described by ``what`` and why: once per process for each kind of call (``kind``: heads
    and features, not the length, which varies from batch to batch) and pattern, so again
    only when a length moves the choice."""
    key = (kind, choice.pattern, choice.ulysses_size)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info(f"[hf_ring] {what}: {choice.describe()}")


__all__ = ["ALLGATHER_BELOW", "PACKED_COSTS", "PackedCost", "PatternChoice", "first_that_runs", "hybrid_sizes", "log_choice_once",
           "packed_candidates", "packed_seconds", "packed_terms", "pattern_candidates"]
