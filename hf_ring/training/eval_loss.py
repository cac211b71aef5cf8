"""The eval loss the stock ``Trainer`` reports, computed under context parallelism.

The stock ``evaluation_loop`` takes each batch's own loss (the model's token mean over that
batch), repeats it ``eval_batch_size`` times, gathers that over the processes with
``accelerator.gather_for_metrics`` (which, at the end of the data, keeps only the samples
the dataset really has) and reports the mean: a mean over eval samples of their batch's
token-mean loss. A user compares against that number, so ``RingTrainer`` reports it too:

- a batch's loss is the token mean over the whole batch, whose tokens are spread over the
  CP group: ``(sum of token losses, valid tokens)`` summed over the group
  (:func:`batch_token_mean`); NaN when the batch has no valid token, as the stock model's
  mean is (the stock loop then drops it with ``logging_nan_inf_filter``);
- the repeated losses are gathered over the **data-parallel** ranks only
  (:func:`data_parallel_gather`): the ranks of one CP group hold the same batch and loss,
  and gathering them all would weigh every batch ``cp_size`` times and cut the last
  step's samples at the wrong place. Then the stock truncation of the last step.

Must not import transformers (the Trainer hands its objects in).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from hf_ring.distributed.rows import concat_over_group
from hf_ring.patterns.state import ContextParallelState
from hf_ring.training.loss import all_reduce_sum


def batch_token_mean(token_sum: torch.Tensor, count: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The token-mean loss of a batch whose tokens ``group`` (the CP group) holds between them.

    Args:
        token_sum: float scalar, this rank's sum of token losses.
        count: int scalar, this rank's valid tokens.
        group: the ranks that share the batch (collective over it).

    Returns:
        A float32 scalar, the same on every rank of ``group``; NaN if no rank has a valid token.
    """
    totals = all_reduce_sum(torch.stack([token_sum.double(), count.double()]), group)
    return (totals[0] / totals[1]).float()  # 0 / 0 is NaN, as the stock model's mean


# What a failed gather over the data-parallel ranks names (distributed.collectives.GroupCollectives).
_DP_GROUP = ("the data-parallel group", "the same evaluation step (every data-parallel rank evaluates every "
             "batch of its share, and the stock loop gathers each batch's losses over them)")


def data_parallel_gather(accelerator: Any, state: ContextParallelState) -> Callable[[torch.Tensor], torch.Tensor]:
    """``accelerator.gather_for_metrics`` over the data-parallel ranks of ``state`` only.

    The returned function takes a tensor ``(n, ...)`` (the same shape on every rank), returns
    the data-parallel ranks' tensors concatenated along dim 0 in dp-rank order (what
    ``gather_for_metrics`` returns for the stock Trainer's processes, which are
    dp ranks), cut at the end of the data to the samples the dataset has, as
    ``gather_for_metrics`` cuts it (``gradient_state.remainder``, counted by the data loader
    that the plugin prepared over the dp ranks). Collective over ``state.dp_group``.
    """

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise NotImplementedError(
                f"under context parallelism RingTrainer gathers eval tensors only, got {type(tensor).__name__}; "
                "evaluate with cp_size=1 for other outputs"
            )
        data = concat_over_group(tensor, state.dp_group, state.dp_size, _DP_GROUP)
        gradient_state = accelerator.gradient_state
        if gradient_state.end_of_dataloader and gradient_state.remainder > 0:
            return data[: gradient_state.remainder]
        return data

    return gather
