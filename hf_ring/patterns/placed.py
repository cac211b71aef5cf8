"""``PlacedPlan``: attention over a packed row whose documents were placed by length
(``hf_ring.sharding.placement``): the sharded documents across the CP group, the rank's
whole documents on the rank alone.

A rank's local row is its shard of every sharded document (the same number of tokens on
every rank: the front of the row), then the documents it holds whole. Documents never
attend to each other, so the row's attention is exactly the two parts' attention side by
side: the front through the group's packed plan (any pattern), the back through a plan of
one process (the same varlen kernels, no communication). Both are ordinary plans built by
build.py; this only splits the call, runs each part and joins the results, and autograd
carries the gradients back through the split.

Must not import transformers, accelerate, or hf_ring's integration or training layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hf_ring.patterns.plan import AttentionPlan


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


def run_placed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PlacedPlan, run, sinks=None):
    """Attention of a row placed by length.

    Args:
        q: ``(1, local_seq, n_heads, head_dim)``; k, v ``(1, local_seq, n_kv_heads, head_dim)``,
            ``local_seq == plan.sharded_tokens + plan.whole_tokens``.
        plan: the call's :class:`PlacedPlan`.
        run: the entry point that runs one ordinary plan (``run.run_plan``).
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
    results = [run(q[:, s], k[:, s], v[:, s], p, sinks) for p, s in parts]
    if len(results) == 1:
        return results[0]
    (out_a, lse_a), (out_b, lse_b) = results
    lse = torch.cat([lse_a, lse_b], dim=2) if lse_a is not None and lse_b is not None else None
    return torch.cat([out_a, out_b], dim=1), lse


__all__ = ["PlacedPlan", "run_placed"]
