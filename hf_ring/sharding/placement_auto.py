"""``placement="auto"``: per packed row, the by-length plan or every document sharded, whichever
costs less once the ring's own overhead is counted.

``place_by_length`` (placement.py) balances the ranks' work and keeps what it can whole; it
does not weigh what sharding saves or costs beyond that work, so where keeping one small
document whole unbalances the ranks by more than its ring steps cost, it is slower than
sharding everything (measured: 0.86x on the five-document mix at cp 4,
docs/performance.md). Here each row's by-length plan and sharding every document are
costed as their most loaded rank's work plus ``PlacementCosts.ring_cost`` of each sharded
document (paid on every rank), and the cheaper is taken; a tie goes to sharding every
document. Only those two: a plan the by-length search would not make (one that keeps a long
document whole at a large imbalance because the ring is modelled dear) rests on the
overhead's model alone, which is measured on one machine's ring. A pure function of the
row's lengths, cached per shape, so every rank plans alike with nothing exchanged.

Must not import torch.distributed or any other layer of hf_ring.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

from hf_ring.sharding.placement import (
    SHARDED,
    DocumentPlacement,
    PlacementCosts,
    assign_documents,
    check_row,
    place_by_length,
    places_documents,
    search_by_length,
)

logger = logging.getLogger("hf_ring")


def place_auto(doc_lens: tuple[int, ...], cp_size: int, max_tokens_per_rank: Optional[int] = None,
               costs: PlacementCosts = PlacementCosts()) -> DocumentPlacement:
    """``placement="auto"``'s plan of a packed row (module docstring): the by-length plan or
    every document sharded, whichever costs less with the ring's overhead counted; cached
    per row shape and logged as :func:`place_by_length` logs, with the modelled cost
    against sharding every document.
    Arguments and errors as :func:`place_by_length`'s."""
    return _place_auto(tuple(doc_lens), cp_size, max_tokens_per_rank, costs)


@functools.lru_cache(maxsize=256)
def _place_auto(doc_lens: tuple[int, ...], cp_size: int, max_tokens_per_rank: Optional[int],
                costs: PlacementCosts) -> DocumentPlacement:
    placement, cost, sharded_cost = _cheapest(doc_lens, cp_size, max_tokens_per_rank, costs)
    first = _place_auto.cache_info().currsize == 0
    chosen = "every document sharded" if all(o == SHARDED for o in placement.owner) else "by length"
    logger.log(logging.INFO if first else logging.DEBUG,
               "[hf_ring] placement auto: %s, %s; modelled cost %.3f of sharding every document",
               chosen, placement.describe(), cost / sharded_cost if sharded_cost > 0 else 1.0)
    return placement


def _cheapest(doc_lens: tuple[int, ...], cp_size: int, max_tokens_per_rank: Optional[int],
              costs: PlacementCosts) -> tuple[DocumentPlacement, float, float]:
    """The cheaper of the by-length plan and every document sharded, its modelled cost (its
    most loaded rank's work plus the ring overhead of its sharded documents, which every
    rank pays) and sharding every document's; a tie goes to sharding every document."""
    check_row(doc_lens, cp_size, max_tokens_per_rank)
    work = [costs.work(n) for n in doc_lens]
    order = sorted(range(len(doc_lens)), key=lambda i: (-work[i], i))
    every = DocumentPlacement(doc_lens, cp_size, *assign_documents(order, doc_lens, work, len(doc_lens), cp_size,
                                                                   max_tokens_per_rank))
    by_length = search_by_length(doc_lens, cp_size, max_tokens_per_rank, costs)

    def modelled(p: DocumentPlacement) -> float:
        return max(p.loads) + sum(costs.ring_cost(n, cp_size) for n in p.sharded_lens)

    every_cost, by_length_cost = modelled(every), modelled(by_length)
    if by_length_cost < every_cost:
        return by_length, by_length_cost, every_cost
    return every, every_cost, every_cost


def plan_placement(placement: str, doc_lens: tuple[int, ...], cp_size: int,
                   max_tokens_per_rank: Optional[int] = None) -> Optional[DocumentPlacement]:
    """A packed row's plan under ``placement``: None for ``"sharded"`` (each document
    zigzag-sharded on its own), else :func:`place_by_length`'s or :func:`place_auto`'s."""
    if not places_documents(placement):
        return None
    plan = place_by_length if placement == "by_length" else place_auto
    return plan(doc_lens, cp_size, max_tokens_per_rank)


__all__ = ["place_auto", "plan_placement"]
