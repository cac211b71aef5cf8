"""The causal-LM loss under context parallelism: a token mean over the whole dp x cp world.

A rank holds a shard of every sequence, so a per-rank mean is meaningless (a rank whose
shard holds no answer token has no mean at all). The loss is instead

    sum of token losses on every rank / number of valid tokens on every rank,

split into per-rank *shares* ``local_sum / global_count``: the shares add up to the true
mean, each share is differentiable in this rank's logits only, and a rank without a valid
token contributes an exact 0 (never NaN).

Gradients: DDP averages gradients over all ``world_size = dp_size * cp_size`` processes,
whereas the true gradient is the *sum* of the shares' gradients. The share is therefore
multiplied by ``world_size`` before ``backward`` (:func:`scale_for_ddp`); the parameters
then receive exactly the gradient a run without context parallelism computes. FSDP2 and
HSDP average over their whole mesh, which must be the world too:
:func:`hf_ring.training.weight_sharding.gradient_reduction` reads the group from the wrapped model
and gives the multiplier (refusing a group that misses a rank).

Which mean: the stock ``transformers.Trainer`` trains on one of two, by what the model
declares (:func:`resolve_loss_mean`):

- ``"tokens"``: a model whose forward takes the loss kwargs (``accepts_loss_kwargs = True``,
  or a ``**kwargs`` forward): the token mean over the whole optimizer step and every
  process, every token weighing the same (``num_items_in_batch``); the shares above;
- ``"micro_batches"``: a model that sets ``accepts_loss_kwargs = False`` (Qwen2.5-VL,
  Qwen3-VL and other image-text models): each micro-batch's own mean over its tokens, then
  the average over the step's micro-batches and the data-parallel processes. Under context
  parallelism a micro-batch's own mean is over its tokens on every rank of its CP group
  (the batch one process of a cp=1 run holds), so a share is ``local_sum / the
  micro-batch's count over the CP group``, divided by the number of means averaged.

The two agree when one micro-batch on one data-parallel rank makes the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_ring.sharding.labels import IGNORE_INDEX


def token_loss_sum(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropy of every valid token of this rank's shard.

    Args:
        logits: ``(..., vocab)``, any float dtype; computed in float32.
        shift_labels: int64 ``(...)`` matching ``logits.shape[:-1]``; ``-100`` is ignored.

    Returns:
        A float32 scalar, differentiable in ``logits``; exactly 0 when no label is valid.
    """
    if logits.shape[:-1] != shift_labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and shift_labels {tuple(shift_labels.shape)} disagree; "
            "shift_labels must have one entry per logits row (the collator's 'shift_labels')"
        )
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        shift_labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def count_valid_tokens(shift_labels: torch.Tensor) -> torch.Tensor:
    """Number of labels that are not ``-100``, as an int64 scalar on the labels' device."""
    return shift_labels.ne(IGNORE_INDEX).sum()


def all_reduce_sum(value: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Sum of ``value`` over ``group`` (the default group when None); a copy, not differentiable.

    With torch.distributed not initialised it is the value itself (a single process).
    """
    out = value.detach().clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def loss_share(token_sum: torch.Tensor, global_count: torch.Tensor | int) -> torch.Tensor:
    """This rank's share of the world's token-mean loss: ``token_sum / global_count``.

    ``global_count`` is the number of valid tokens over the whole dp x cp world (for the whole
    optimizer step under gradient accumulation). A count of 0 (nothing to learn anywhere)
    gives a share of exactly 0.
    """
    count = torch.as_tensor(global_count, device=token_sum.device).to(torch.float32)
    return token_sum / count.clamp(min=1.0)


def scale_for_ddp(share: torch.Tensor, world_size: int) -> torch.Tensor:
    """The value to call ``backward`` on when DDP averages gradients over ``world_size``
    processes: the share times ``world_size``, so the average equals the sum of shares."""
    return share * world_size


@dataclass
class LossTotals:
    """Running ``(token loss sum, valid token count)`` of one rank, e.g. over an evaluation."""

    token_sum: float = 0.0
    count: int = 0

    def add(self, token_sum: torch.Tensor, count: torch.Tensor) -> None:
        self.token_sum += float(token_sum.detach().double())
        self.count += int(count)

    def global_mean(self, device: torch.device, group: Optional[dist.ProcessGroup] = None) -> float:
        """Token mean over every rank of ``group`` (collective: every rank must call it).

        NaN only if no rank saw a single valid token.
        """
        both = torch.tensor([self.token_sum, float(self.count)], dtype=torch.float64, device=device)
        total_sum, total_count = all_reduce_sum(both, group).tolist()
        return total_sum / total_count if total_count > 0 else float("nan")


LOSS_MEANS = ("auto", "tokens", "micro_batches")


def check_loss_mean(requested: str) -> None:
    """Raise ValueError unless ``requested`` is one of :data:`LOSS_MEANS`."""
    if requested not in LOSS_MEANS:
        raise ValueError(f"loss_mean={requested!r} is not one of {LOSS_MEANS}: 'auto' follows the stock "
                         "Trainer's rule for the model, 'tokens' is the token mean of the optimizer step, "
                         "'micro_batches' the mean of each micro-batch's own mean")


def resolve_loss_mean(requested: str, stock_accepts_loss_kwargs: bool) -> str:
    """The mean to train on: ``requested`` (checked by :func:`check_loss_mean`), or for
    ``"auto"`` the stock Trainer's for a model with ``stock_accepts_loss_kwargs`` (what the
    stock Trainer read from it)."""
    check_loss_mean(requested)
    if requested != "auto":
        return requested
    return "tokens" if stock_accepts_loss_kwargs else "micro_batches"


_MEANS_SAID = {"tokens": "the token mean of the whole step", "micro_batches": "the mean of the micro-batches' own means"}


def departure_from_stock(mean: str, stock_accepts_loss_kwargs: bool, model_name: str,
                         accumulation_steps: int, dp_size: int) -> Optional[str]:
    """A warning when training on ``mean`` gives other gradients than the stock Trainer's
    rule would (several micro-batches or data-parallel ranks per step), else None."""
    stock = resolve_loss_mean("auto", stock_accepts_loss_kwargs)
    if mean == stock or (accumulation_steps == 1 and dp_size == 1):
        return None
    declared = "takes" if stock_accepts_loss_kwargs else "does not take (accepts_loss_kwargs=False)"
    return (f"hf_ring: {model_name} {declared} the loss kwargs, so the stock Trainer trains it on "
            f"{_MEANS_SAID[stock]}; loss_mean={mean!r} trains on {_MEANS_SAID[mean]} instead, which differs with "
            f"gradient_accumulation_steps={accumulation_steps} over {dp_size} data-parallel rank(s): the losses and "
            "gradients will not match a stock run. Pass loss_mean='auto' to follow the stock rule")
