"""``run_plan``: the one entry point that runs a built plan, whatever its pattern.

Every context-parallel attention call ends here: the public ops (api.py) after their
checks, the Hugging Face integration for every attention layer of a forward, and
``ContextParallel.wrap`` through the public op. Nothing here validates, chooses or builds:
the plan (plan.py, built by build.py) says what runs, and this only hands the tensors to
the pattern's op.

``PlacedPlan``: a packed row whose documents were placed by length
(``hf_ring.sharding.placement``). A rank's local row is its shard of every sharded document
(the same number of tokens on every rank: the front of the row), then the documents it
holds whole. Documents never attend to each other, so the row's attention is exactly the
two parts' side by side: the front through the group's packed plan (any pattern), the back
through a plan of one process, run as the reference runs it (``ring/one_process.py``: the
kernel on each run of equal documents, or one varlen call; no communication, no
accumulators); autograd carries the gradients back through the split.

Must not import transformers, accelerate, or hf_ring's integration or training layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from hf_ring.patterns.allgather import allgather_attention
from hf_ring.patterns.hybrid import hybrid_attention
from hf_ring.patterns.plan import AttentionPlan
from hf_ring.patterns.ring.attention import ring_attention
from hf_ring.patterns.ring.one_process import one_process_attention, one_process_calls
from hf_ring.patterns.ulysses import ulysses_attention


@dataclass(frozen=True, eq=False)
class PlacedPlan:
    """The two plans of one kind of attention call on a row placed by length.

    Attributes:
        sharded: the plan of the sharded documents over the CP group (their local lengths),
            or None when the row has none (then no rank communicates).
        whole: a one-process plan of this rank's whole documents, or None when it holds none.
        sharded_tokens: local tokens of the sharded part (the front of the row).
        whole_tokens: local tokens of the whole part (the rest).
    """

    sharded: Optional[AttentionPlan]
    whole: Optional[AttentionPlan]
    sharded_tokens: int
    whole_tokens: int

    def __post_init__(self) -> None:
        if (self.sharded is None) != (self.sharded_tokens == 0) or (self.whole is None) != (self.whole_tokens == 0):
            raise ValueError(f"a placed plan's parts and token counts disagree: sharded {self.sharded_tokens} tokens "
                             f"({'a' if self.sharded else 'no'} plan), whole {self.whole_tokens} tokens "
                             f"({'a' if self.whole else 'no'} plan)")

    @property
    def need_lse(self) -> bool:
        return all(p.need_lse for p in (self.sharded, self.whole) if p is not None)


def run_placed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PlacedPlan,
               sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Attention of a row placed by length.

    Args:
        q: ``(1, local_seq, n_heads, head_dim)``; k, v ``(1, local_seq, n_kv_heads, head_dim)``,
            ``local_seq == plan.sharded_tokens + plan.whole_tokens``.
        plan: the call's :class:`PlacedPlan`.
        sinks: optional float ``(n_heads,)``, the same in both parts; its gradient is the sum
            of both parts' (autograd adds them).

    Returns:
        ``out`` like q and ``lse`` ``(1, n_heads, local_seq)`` (None where a part returns none).
    """
    if q.shape[1] != plan.sharded_tokens + plan.whole_tokens:
        raise ValueError(f"this rank's row holds {q.shape[1]} tokens but its placement gives it "
                         f"{plan.sharded_tokens} of sharded documents and {plan.whole_tokens} of whole ones")
    cut = plan.sharded_tokens
    parts = [(p, slice(a, b)) for p, a, b in ((plan.sharded, 0, cut), (plan.whole, cut, q.shape[1])) if p is not None]
    results = [run_plan(q[:, s], k[:, s], v[:, s], p, sinks) for p, s in parts]
    if len(results) == 1:
        return results[0]
    (out_a, lse_a), (out_b, lse_b) = results
    lse = torch.cat([lse_a, lse_b], dim=2) if lse_a is not None and lse_b is not None else None
    return torch.cat([out_a, out_b], dim=1), lse


def run_plan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Union[AttentionPlan, PlacedPlan],
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Attention of this rank's shard across the plan's group, by the plan's pattern.

    Args:
        q: ``(batch, local_seq, n_heads, head_dim)``; k, v ``(batch, local_seq, n_kv_heads,
            head_dim)``; one float dtype and device, sharded by ``plan.layout`` (packed
            rows: ``batch`` 1, documents zigzag-sharded one by one). Every rank of the
            group passes the same shapes and an equal plan.
        plan: built by :func:`hf_ring.patterns.build.build_plan` (or by hand, for the ring),
            or a packed row's :class:`PlacedPlan` (documents
            placed by length: its two plans run here, one after the other).
        sinks: optional float ``(n_heads,)``: one extra logit per query head in every row's
            softmax denominator; differentiable.

    Returns:
        ``out`` like q, differentiable in q, k, v and sinks, and ``lse`` ``(batch, n_heads,
        local_seq)`` float32 (float64 for float64 inputs), not differentiable; None for a
        Ulysses or hybrid plan built with ``need_lse=False``.
    """
    if isinstance(plan, PlacedPlan):
        return run_placed(q, k, v, plan, sinks)
    if plan.spans is not None:
        plan.spans.check_batch(q.shape[0])
    if plan.world == 1:
        blocks = one_process_calls(plan, q.shape[1])
        if blocks is not None:
            return one_process_attention(q, k, v, plan, blocks, sinks)
    if plan.world == 1 or plan.pattern == "ring":
        return ring_attention(q, k, v, plan, sinks)
    if plan.pattern == "allgather":
        return allgather_attention(q, k, v, plan, plan.collectives, sinks)
    if plan.pattern == "ulysses":
        return ulysses_attention(q, k, v, plan.inner, plan.collectives, plan.layout, 0, plan.world, sinks,
                                 need_lse=plan.need_lse, local_doc_lens=plan.local_doc_lens)
    return hybrid_attention(q, k, v, plan, sinks)


__all__ = ["PlacedPlan", "run_placed", "run_plan"]
