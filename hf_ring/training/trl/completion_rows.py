"""Per-token log-probabilities of TRL's rollout rows, computed as a ring over the CP group.

TRL's GRPO builds each process's rows as ``[left-padded prompt | right-padded completion]``
(``input_ids`` and ``attention_mask`` ``(rows, P + C)``) and reads the log-probability (and
entropy) of each completion token, ``(rows, C)``. Under context parallelism
(``RingGRPOTrainer``) each rank holds its own slice of the CP group's rollouts, of its own
``P`` and ``C``; the ring needs every rank to hold a shard of the **same** rows, right-padded.

:func:`completion_log_probs`:

1. compacts each local row to its real tokens (the attention mask's window), right-padded
   to the widest row of the CP group, and labels only its completion tokens;
2. all-gathers those rows over the CP group (every rank then holds the group's rollouts,
   in rank order);
3. runs them through :class:`~hf_ring.training.trl.fused_forward.RingFusedForward`: each
   rank computes its shard of every row through the ring with TRL's fused LM head (by
   chunks of positions: never a ``(tokens, vocab)`` logits tensor), and the per-token
   fields come back as whole rows. With ``padding_free`` the forward packs the group's rows
   into one row of documents (:mod:`~hf_ring.sharding.row_packing`): the model never sees
   a row padded to the group's longest, and the fields come back in the same layout;
4. keeps this rank's rows and puts each completion token's value where TRL's layout has it
   (0 where TRL's mask is 0).

Positions: TRL's forward of a left-padded row numbers its tokens from the padding's length,
the ring's from 0; rotary attention depends only on the difference of positions, so both
compute the same function (they agree to float rounding).

Gradients: each rank's loss reads only its own rows. The fields' gather has a
reduce-scatter for backward, which hands each rank the group's summed gradient of the
group's rows at its own shard's positions, so each rank receives its share of the gradient
of the sum of the group's losses, which the wrapper's average over the dp x cp processes
makes the gradient of one process per data-parallel rank, as TRL's own processes average
theirs.

Must not import TRL (it is reached through ``RingFusedForward``'s accessors) or accelerate.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from hf_ring.distributed.rows import concat_over_group
from hf_ring.sharding.labels import IGNORE_INDEX
from hf_ring.hf.randomness.refusals import draws_refused
from hf_ring.training.trl.fused_forward import RingFusedForward

# Why the rollouts' random draws (dropout, LoRA dropout, router noise) cannot be TRL's own.
_COMPACTED = ("the rollout trainers run the CP group's rows compacted (TRL's left padding removed) and "
              "gathered, where TRL's one process runs its own left-padded rows: the dropout masks of their "
              "tokens differ; set the dropout to 0 (e.g. LoraConfig(lora_dropout=0.0)) for GRPO / RLOO under CP")


def _windows(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first real position and real length (int64 ``(rows,)``); raises unless the
    mask's ones are one contiguous window per row (left padding, then right padding)."""
    mask = attention_mask.long()
    lengths = mask.sum(dim=1)
    starts = (mask.cumsum(dim=1) == 0).sum(dim=1)
    cols = torch.arange(mask.shape[1], device=mask.device)
    window = (cols >= starts[:, None]) & (cols < (starts + lengths)[:, None])
    if not torch.equal(window, mask.bool()):
        raise ValueError(
            "under context parallelism each rollout row must be one run of real tokens (a left-padded prompt "
            "followed by its completion); this batch's attention mask has holes (tool or environment masks "
            "are not supported under CP)"
        )
    return starts, lengths


def completion_log_probs(
    forward: RingFusedForward,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    compute_entropy: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """TRL's per-completion-token log-probabilities (and entropies) of this rank's rows.

    Args:
        forward: the model (policy, old policy or reference) as a ring over ``forward.state``'s group.
        input_ids: int64 ``(rows, P + C)``, this rank's rows in TRL's layout; ``rows`` must be
            equal on every rank of the CP group.
        attention_mask: ``(rows, P + C)``, ones on each row's real tokens (one window per row).
        logits_to_keep: ``C``, the completion width of this rank's rows.
        compute_entropy: also return the entropies.

    Returns:
        ``log_probs`` ``(rows, C)`` (the fused head's dtype, float32 by default; differentiable
        when the model is) and ``entropy`` of the same shape or None; 0 where TRL's mask is 0.
        Collective over the CP group.
    """
    state = forward.state
    rows, width = input_ids.shape
    prompt_width = width - logits_to_keep
    device = input_ids.device
    starts, lengths = _windows(attention_mask)
    group_width = torch.tensor([int(lengths.max()) if rows else 1], device=device)
    if state.cp_size > 1:
        dist.all_reduce(group_width, op=dist.ReduceOp.MAX, group=state.cp_group)
    compact_width = max(int(group_width), 2)

    cols = torch.arange(compact_width, device=device)
    real = cols[None, :] < lengths[:, None]  # (rows, compact_width)
    source = (starts[:, None] + cols[None, :]).clamp(max=width - 1)
    ids = torch.where(real, input_ids.gather(1, source), torch.full_like(source, forward.pad_token_id))
    # Only completion tokens are scored: TRL's prompt columns (< prompt_width) move to < prompt_width - start.
    is_completion = (starts[:, None] + cols[None, :]) >= prompt_width
    labels = torch.where(real & is_completion, ids, torch.full_like(ids, IGNORE_INDEX))

    with draws_refused(_COMPACTED):
        out = forward(
            input_ids=concat_over_group(ids, state.cp_group, state.cp_size),
            labels=concat_over_group(labels, state.cp_group, state.cp_size),
            attention_mask=concat_over_group(real.long(), state.cp_group, state.cp_size),
            fused_lm_head=True,
        )
    mine = slice(state.cp_rank * rows, (state.cp_rank + 1) * rows)
    # Completion column j of TRL's row is compact token (prompt_width + j - start), scored at the position before it.
    token = prompt_width + torch.arange(logits_to_keep, device=device)[None, :] - starts[:, None]  # (rows, C)
    valid = (token >= 1) & (token < lengths[:, None])
    index = (token - 1).clamp(min=0, max=compact_width - 2)

    def place(field: torch.Tensor) -> torch.Tensor:
        values = field[mine].gather(1, index)
        return torch.where(valid, values, torch.zeros_like(values))

    if compute_entropy and out.entropy is None:
        raise ValueError("entropies were asked of a model whose fused LM head does not compute them")
    log_probs = place(out.log_probs)
    entropy = place(out.entropy) if compute_entropy else None
    return log_probs, entropy
