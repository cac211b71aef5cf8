"""One attention layer's call under context parallelism, by the state's pattern.

Why a file of its own: ``ring_flash`` (attention.py) decides *whether* a layer runs across
the CP group; this decides *how*: the ring on the forward's cached plan (the hot path: no
collective but the ring's transfers, one schedule shared by every layer), or
``hf_ring.context_parallel_attn_func`` for the other patterns (all-gather, Ulysses,
hybrid). The forward's inputs
were validated across the ranks once by the guard, so no call here checks them again
(``check_ranks=False``).

``pattern="auto"`` is resolved per kind of layer (head counts, window, softcap, sinks) in
each forward, from what every rank knows alike (hf_ring/patterns/auto.py), and logged once per
process: one line, what was picked and why.
"""

from __future__ import annotations

from typing import Optional

import torch

from hf_ring.hf.forward_context import ForwardContext
from hf_ring.patterns.api import ring_attention
from hf_ring.patterns.auto import first_that_runs, log_choice_once, pattern_candidates
from hf_ring.patterns.dispatch import context_parallel_attn_func

def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    context: ForwardContext,
    pattern: str,
    ulysses_size: Optional[int],
    sinks: Optional[torch.Tensor],
    window: Optional[int],
    softcap: Optional[float],
) -> torch.Tensor:
    if pattern == "ring":
        out, _ = ring_attention(q, k, v, context.plan(q, scale, window, softcap), sinks)
        return out
    s = context.state
    return context_parallel_attn_func(
        q, k, v, group=s.cp_group, pattern=pattern, causal=True, softmax_scale=scale, layout=s.layout,
        window=window, softcap=softcap, sinks=sinks, ulysses_size=ulysses_size, check_ranks=False,
        comm_stats=context.comm_stats,
    )


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    context: ForwardContext,
    sinks: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Attention of this rank's shard across the CP group (``context.state``, cp_size > 1).

    Args:
        q: ``(batch, seq_local, n_heads, head_dim)``; k, v: ``(batch, seq_local, n_kv_heads,
            head_dim)``; one float dtype, sharded in the state's layout.
        scale: softmax scale.
        context: the forward's validated context (state, plans, auto's choices).
        sinks: ``(n_heads,)`` float, or None; window: tokens, or None (none, or one at least
            the sequence); softcap: logit softcapping, or None.

    Returns:
        ``(batch, seq_local, n_heads, head_dim)`` in q's dtype.
    """
    state = context.state
    if state.pattern != "auto":
        return _attend(q, k, v, scale, context, state.pattern, state.ulysses_size, sinks, window, softcap)
    key = (q.shape[2], k.shape[2], q.shape[1], window, softcap, sinks is not None, q.dtype, q.device)
    choice = context.choices.get(key)
    if choice is not None:
        return _attend(q, k, v, scale, context, choice.pattern, choice.ulysses_size, sinks, window, softcap)
    candidates = pattern_candidates(q.shape[2], k.shape[2], q.shape[1] * state.cp_size, state.cp_size,
                                    state.local_world_size, state.first_rank)
    out, choice = first_that_runs(
        candidates,
        lambda c: _attend(q, k, v, scale, context, c.pattern, c.ulysses_size, sinks, window, softcap),
    )
    context.choices[key] = choice
    features = [f for f, on in (("window", window), ("softcap", softcap), ("sinks", sinks)) if on is not None]
    log_choice_once(choice, (q.shape[2], k.shape[2], *features),
                    f"{q.shape[1] * state.cp_size} tokens over cp={state.cp_size}, {q.shape[2]}/{k.shape[2]} "
                    f"heads{', ' + ', '.join(features) if features else ''}")
    return out


__all__ = ["cp_attention"]
