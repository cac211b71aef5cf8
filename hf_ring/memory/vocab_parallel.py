"""The cross-entropy of logits whose vocabulary is split over tensor-parallel ranks.

Why: transformers' tensor parallelism shards the LM head's weight by vocabulary rows and
all-gathers the output, so every TP rank holds the whole ``tokens x vocabulary`` logits (31
GiB in bf16 for Llama-3-8B at tp8 and 128K tokens, docs/parallelism_costs.md). Computed by
chunks on the rank's own rows of the vocabulary instead, no rank ever holds more than one
chunk of its slice: per chunk, the row maximum and the sum of exponentials are reduced over
the TP group, and the label's logit comes from the rank that holds it. The gradient of the
logits is ``softmax - one_hot`` on each rank's slice; the hidden states' gradient is each
rank's partial product with its slice of the weight, summed over the group
(``chunked_loss.ChunkedLinearCrossEntropy`` sums it, once per call).

Must not import the Trainer, TRL, or hf_ring's training layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

# The mesh dimension of tensor parallelism (transformers' and torchtitan's name).
_TP_DIM = "tp"


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of a vocabulary split over a TP group.

    Attributes:
        group: the TP group the vocabulary is split over.
        offset: the first vocabulary id this rank holds.
        rows: how many ids it holds (the last rank may hold fewer).
        vocab: the whole vocabulary.
    """

    group: Optional[dist.ProcessGroup]
    offset: int
    rows: int
    vocab: int

    def __post_init__(self) -> None:
        if not (0 <= self.offset and 0 <= self.rows and self.offset + self.rows <= self.vocab):
            raise ValueError(f"rows [{self.offset}, {self.offset + self.rows}) are not inside a vocabulary of "
                             f"{self.vocab}")


def vocab_shard_of(weight: Any) -> Optional[VocabShard]:
    """The shard ``weight`` (the LM head's, inside its call) holds, or None for a whole one.

    Raises:
        NotImplementedError: a weight distributed otherwise than by vocabulary rows over
            one ``tp`` mesh dimension.
    """
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor):
        return None
    mesh, placements = weight.device_mesh, weight.placements
    names = tuple(mesh.mesh_dim_names or ())
    sharded = [(i, p) for i, p in enumerate(placements) if not p.is_replicate()]
    if len(sharded) != 1 or sharded[0][1] != Shard(0) or (names and names[sharded[0][0]] != _TP_DIM):
        raise NotImplementedError(
            f"chunked loss: the LM head's weight is a DTensor placed {placements} on the mesh {names or mesh.shape}, "
            f"not split by vocabulary rows over a '{_TP_DIM}' dimension; turn the chunked loss off")
    dim = sharded[0][0]
    group = mesh.get_group(dim)
    size, rank = mesh.size(dim), mesh.get_local_rank(dim)
    vocab = weight.shape[0]
    per_rank = -(-vocab // size)  # torch.chunk's split: ceil(vocab / size) rows, the last rank the rest
    offset = min(rank * per_rank, vocab)
    rows = weight.to_local().shape[0]
    if rows != max(0, min(per_rank, vocab - offset)):
        raise NotImplementedError(f"chunked loss: TP rank {rank} holds {rows} vocabulary rows where an even split "
                                  f"of {vocab} over {size} ranks gives it {min(per_rank, vocab - offset)}")
    return VocabShard(group, offset, rows, vocab)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """``sum over rows of CE(full logits, labels)`` from this rank's slice of the logits.

    ``apply(logits, labels, shard)``: logits float32 ``(rows, shard.rows)``, this rank's
    vocabulary slice; labels int64 ``(rows,)``, every one a real id (no -100); returns a
    float32 scalar, the same on every rank of ``shard.group``. Collective: every rank of the
    group calls it with the same rows.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, shard: VocabShard) -> torch.Tensor:
        top = logits.max(dim=-1).values if logits.shape[-1] else logits.new_full(logits.shape[:-1], -torch.inf)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=shard.group)
        exp = (logits - top[:, None]).exp()
        local = labels - shard.offset
        mine = (local >= 0) & (local < shard.rows)
        picked = torch.where(mine, logits.gather(1, local.clamp(0, max(shard.rows - 1, 0))[:, None]).squeeze(1)
                             if shard.rows else torch.zeros_like(top), torch.zeros_like(top))
        sums = torch.stack([exp.sum(-1), picked])  # (2, rows): summed over the group in one call
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=shard.group)
        lse = top + sums[0].log()
        ctx.save_for_backward(exp, sums[0], local, mine)
        return (lse - sums[1]).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        exp, total, local, mine = ctx.saved_tensors
        grad_logits = exp / total[:, None]
        rows = mine.nonzero().squeeze(1)
        grad_logits[rows, local[rows]] -= 1.0
        return grad_logits * grad, None, None


__all__ = ["VocabParallelCrossEntropy", "VocabShard", "vocab_shard_of"]
