"""What the context-parallel token-mixer tests share: how a case's full-sequence tensors are
sharded to the ranks and joined back, and how a CP result is compared with the full
sequence's (relative errors; float64: 1e-9, float32: no further from the float64 truth than
the one-process float32 scan x 4 + 1e-6)."""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import torch

from closeness import max_rel
from hf_ring.sharding import shard_packed, shard_sequence, unshard_packed, unshard_sequence


def case_lengths(layout: str, piece, world: int) -> tuple[Optional[list[int]], int]:
    """``(doc_lens, seq)`` of a case: ``piece`` tokens per piece (``layout`` "packed": a list,
    the tokens per piece of each document, zigzag) -> the documents' global lengths (None:
    dense) and the row's length over ``world`` ranks."""
    if layout == "packed":
        doc_lens = [2 * world * n for n in piece]
        return doc_lens, sum(doc_lens)
    return None, piece * (1 if layout == "contiguous" else 2) * world


def sharders(layout: str, world: int, doc_lens: Optional[Sequence[int]] = None, dim: int = 1
             ) -> tuple[Callable[[torch.Tensor, int], torch.Tensor], Callable[[list], torch.Tensor]]:
    """``(shard(t, rank), join(shards))`` for tensors whose dimension ``dim`` is the sequence:
    a dense row in ``layout``, or (``doc_lens``: the documents' global lengths) a packed row,
    every document zigzag-sharded on its own."""
    if doc_lens:
        cu = torch.tensor([0, *torch.tensor(doc_lens).cumsum(0).tolist()])
        return (lambda t, r: shard_packed(t, cu, world, r, dim=dim)), (lambda ts: unshard_packed(ts, cu, dim=dim))
    return ((lambda t, r: shard_sequence(t, world, r, dim=dim, layout=layout)),
            (lambda ts: unshard_sequence(ts, dim=dim, layout=layout)))


def backward_result(out: torch.Tensor, final: Optional[torch.Tensor], leaves: dict,
                    init_leaf: Optional[torch.Tensor], d_out: torch.Tensor, d_final: Optional[torch.Tensor]) -> dict:
    """Backpropagate ``(out * d_out).sum()`` (``+ (final * d_final).sum()`` when ``d_final`` is
    given) and gather what :func:`errors` compares: ``{"out", "final", "grads", "init_grad"}``."""
    loss = (out * d_out.to(out.dtype)).sum()
    if d_final is not None:
        loss = loss + (final * d_final.to(final.dtype)).sum()
    loss.backward()
    return {"out": out.detach(), "final": None if final is None else final.detach(),
            "grads": {n: t.grad for n, t in leaves.items()},
            "init_grad": None if init_leaf is None else init_leaf.grad}


def errors(got: dict, ref: dict, names: Iterable[str]) -> dict[str, float]:
    """Relative errors of a result ``{"out", "final", "grads": {name: grad}, "init_grad"}``
    against the reference's: the output, the gradients of ``names``, the final state (when
    returned) and the initial state's gradient (when there is one)."""
    errs = {"out": max_rel(got["out"], ref["out"])} | {f"d{n}": max_rel(got["grads"][n], ref["grads"][n]) for n in names}
    if got["final"] is not None:
        errs["final"] = max_rel(got["final"], ref["final"])
    if ref["init_grad"] is not None:
        errs["dinit"] = max_rel(got["init_grad"], ref["init_grad"])
    return errs


def out_of_bounds(errs: dict[str, float], one_process: Optional[dict[str, float]] = None) -> dict:
    """The errors over their bound: 1e-9 (float64, ``one_process`` None), else ``4 x`` the
    one-process float32 scan's own error ``+ 1e-6``; ``{name: (error, bound)}``."""
    bound = {k: 1e-9 if one_process is None else 4 * one_process[k] + 1e-6 for k in errs}
    return {k: (e, bound[k]) for k, e in errs.items() if not e <= bound[k]}
