"""Attention of new tokens against a key/value cache whose entries are spread over the
ranks of a context-parallel group, merged exactly.

Why: after a prefill under context parallelism each rank keeps only its shard of every
layer's K/V (``hf_ring.hf.generation``), and the shards together are what one process's
cache holds. A decode step's queries are a few tokens, the cache is the whole context, so
the queries travel and the cache stays: every rank (all of which hold the same new tokens)
attends its queries to its own entries, and the partial results, ``(out, lse)``, go round
in one all-gather and are merged by log-sum-exp (Meta's pass-Q decode, "Context Parallelism
for Scalable Million-Token Inference", 2024). Every rank merges the same gathered rows in
rank order, so every rank continues with bit-identical hidden states, and the result is one
softmax over all the entries (exact up to the order of float32 additions).

Which entries a query sees is decided from each entry's position in its row and whether it
is a real token of that row (rows of a batch may start at other columns: left padding), so
the entries' order on a rank does not matter: causal (a key at or before the query's
position) and, for a sliding window ``w``, ``query - key < w`` as transformers counts it.

The partial attention is plain math in float32 (float64 for float64 inputs), the kernels'
reference: a decode step reads every cached entry once, so it is bound by that read, not by
the arithmetic a flash kernel saves; the scores it materialises are ``(q_len, n_entries)``
per head.

Must not import: transformers, accelerate, or hf_ring's integration, memory or training
layers.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from hf_ring.distributed.collectives import GroupCollectives
from hf_ring.kernels.reference import REFERENCE
from hf_ring.kernels.value_heads import with_value_head_dim
from hf_ring.patterns.ring.merge import apply_sinks


def visible_entries(
    key_positions: torch.Tensor, valid: torch.Tensor, query_positions: torch.Tensor, window: Optional[int]
) -> torch.Tensor:
    """bool ``(batch, q_len, n_entries)``, True where the query may attend the entry: a real
    entry of its row (``valid``, bool ``(batch, n_entries)``), causal over the positions in
    the row (int64 ``(batch, n_entries)`` and ``(batch, q_len)``) and, with a ``window``,
    ``query - key < window``."""
    distance = query_positions.unsqueeze(-1) - key_positions.unsqueeze(1)  # (batch, q_len, n_entries)
    visible = (distance >= 0) & valid.unsqueeze(1)
    if window is not None:
        visible &= distance < window
    return visible


def _partial(q, k, v, visible, scale, softcap):
    """This rank's attention over its entries: out ``(b, q_len, h, dv)`` and lse ``(b, h,
    q_len)`` in the accumulation dtype; a rank holding no visible entry gives out 0, lse -inf.
    ``v_dim`` may differ from ``head_dim`` (multi-head latent attention)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    b, sq, h, _ = q.shape
    if k.shape[1] == 0:
        return (q.new_zeros((b, sq, h, v.shape[-1]), dtype=acc),
                torch.full((b, h, sq), float("-inf"), dtype=acc, device=q.device))
    backend = REFERENCE
    if v.shape[-1] != q.shape[-1]:  # multi-head latent attention's narrower value heads
        backend = with_value_head_dim(REFERENCE, q.shape[-1], v.shape[-1])
    kwargs = {"softcap": softcap} if softcap is not None else {}
    # (batch, 1, 1, q_len, n_entries): broadcast over the reference's (kv head, group) axes.
    return backend.forward(q.to(acc), k, v, False, scale, visible[:, None, None], **kwargs)


def _merged(out: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``(out, lse)`` gathered in one collective and merged in rank order."""
    coll = GroupCollectives(group)
    gathered = coll.all_gather(torch.cat([out.reshape(-1), lse.reshape(-1)]))  # (world, n)
    outs = gathered[:, : out.numel()].view(coll.world, *out.shape)  # (world, b, q_len, h, dv)
    lses = gathered[:, out.numel():].view(coll.world, *lse.shape)  # (world, b, h, q_len)
    total = torch.logsumexp(lses, dim=0)  # (b, h, q_len)
    weights = torch.exp(lses - total).nan_to_num_(0.0)  # a rank that saw nothing weighs 0
    merged = (outs * weights.transpose(2, 3).unsqueeze(-1)).sum(dim=0)
    return merged, total


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_positions: torch.Tensor,
    valid: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    *,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Attention of new queries against cached entries, this rank's share merged with the
    group's. Collective over ``group`` (one all-gather of ``b * q_len * h * (dv + 1)``
    floats) unless it is None: then the entries given are all there are.

    Args:
        q: ``(batch, q_len, n_heads, head_dim)``, the new tokens' queries, the same on every
            rank of the group.
        k: ``(batch, n_entries, n_kv_heads, head_dim)``, this rank's cached keys (the new
            tokens' own among them where this rank keeps them); ``n_entries`` may differ by
            rank, and be 0.
        v: ``(batch, n_entries, n_kv_heads, v_dim)``, their values.
        key_positions: int64 ``(batch, n_entries)``, each entry's position in its row.
        valid: bool ``(batch, n_entries)``, which entries are real tokens of their row.
        query_positions: int64 ``(batch, q_len)``, each query's position in its row.
        scale: the softmax scale.
        window: sliding window in tokens (transformers' count), or None.
        softcap: logit softcapping, or None.
        sinks: ``(n_heads,)`` attention-sink logits (GPT-OSS), merged once after the group's.
        group: the context-parallel group holding the other entries, or None.

    Returns:
        ``(batch, q_len, n_heads, v_dim)`` in q's dtype.
    """
    device = q.device
    visible = visible_entries(key_positions.to(device), valid.to(device), query_positions.to(device), window)
    out, lse = _partial(q, k, v, visible, scale, softcap)
    if group is not None and dist.get_world_size(group) > 1:
        out, lse = _merged(out, lse, group)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return out.to(q.dtype)
