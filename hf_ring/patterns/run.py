"""``run_plan``: the one entry point that runs a built plan, whatever its pattern.

Every context-parallel attention call ends here: the public ops (api.py) after their
checks, the Hugging Face integration for every attention layer of a forward, and
``ContextParallel.wrap`` through the public op. Nothing here validates, chooses or builds:
the plan (plan.py, built by build.py) says what runs, and this only hands the tensors to
the pattern's op.

Must not import transformers, accelerate, or hf_ring's integration or training layers.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from hf_ring.patterns.allgather import allgather_attention
from hf_ring.patterns.hybrid import hybrid_attention
from hf_ring.patterns.placed import PlacedPlan, run_placed
from hf_ring.patterns.plan import AttentionPlan
from hf_ring.patterns.ring.attention import ring_attention
from hf_ring.patterns.ulysses import ulysses_attention


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
            or a packed row's :class:`~hf_ring.patterns.placed.PlacedPlan` (documents
            placed by length: its two plans run here, one after the other).
        sinks: optional float ``(n_heads,)``: one extra logit per query head in every row's
            softmax denominator; differentiable.

    Returns:
        ``out`` like q, differentiable in q, k, v and sinks, and ``lse`` ``(batch, n_heads,
        local_seq)`` float32 (float64 for float64 inputs), not differentiable; None for a
        Ulysses or hybrid plan built with ``need_lse=False``.
    """
    if isinstance(plan, PlacedPlan):
        return run_placed(q, k, v, plan, run_plan, sinks)
    if plan.spans is not None:
        plan.spans.check_batch(q.shape[0])
    if plan.world == 1 or plan.pattern == "ring":
        return ring_attention(q, k, v, plan, sinks)
    if plan.pattern == "allgather":
        return allgather_attention(q, k, v, plan, plan.collectives, sinks)
    if plan.pattern == "ulysses":
        return ulysses_attention(q, k, v, plan.inner, plan.collectives, plan.layout, 0, plan.world, sinks,
                                 need_lse=plan.need_lse, local_doc_lens=plan.local_doc_lens)
    return hybrid_attention(q, k, v, plan, sinks)


__all__ = ["run_plan"]
