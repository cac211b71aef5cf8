"""Weights that no data-parallel wrapper holds: their gradients averaged over a group in the
backward, and their values checked alike over it.

Why: transformers shards a model with FSDP2 as it loads it (``DistributedConfig(fsdp_size=
...)``, beside tensor parallelism); weights added afterwards, a PEFT adapter's, are in no
FSDP2 group, so nothing reduces their gradients over the data-parallel and context-parallel
ranks, and each CP rank would step on the gradient of its own tokens only. A hook on each
such weight averages every gradient that reaches it over the group, as FSDP2 averages the
weights it holds, so the loss multiplier that makes FSDP2's gradients exact makes these
exact too. Each incoming gradient is averaged, not the accumulated ``.grad``, so gradient
accumulation stays exact.

Their values must agree over the group before training, and nothing here broadcasts them
(PEFT initialises an adapter from each process's generator): :func:`check_alike_over`
refuses replicas that differ.

Must not import transformers or accelerate.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

_AVERAGED_OVER = "_hf_ring_grad_averaged_over"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself otherwise)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def average_gradients_over(params: Iterable[torch.nn.Parameter], group: Optional[dist.ProcessGroup]) -> int:
    """Average every gradient that reaches each of ``params`` (plain or DTensor, floating)
    over ``group`` (every rank of it must run the same backwards). Returns how many were
    hooked; a parameter hooked before is left as it is."""
    size = dist.get_world_size(group)
    hooked = 0
    for param in params:
        if getattr(param, _AVERAGED_OVER, None) is not None:
            continue

        def averaged(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone(memory_format=torch.contiguous_format)
            local = _local(grad)
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)  # gloo has no AVG
            local.div_(size)
            return grad

        param.register_hook(averaged)
        setattr(param, _AVERAGED_OVER, size)
        hooked += 1
    return hooked


def averaged_over(param: torch.Tensor) -> Optional[int]:
    """The size of the group :func:`average_gradients_over` averages ``param``'s gradients
    over, or None when it does not."""
    return getattr(param, _AVERAGED_OVER, None)


def check_alike_over(named: dict[str, torch.Tensor], group: Optional[dist.ProcessGroup], what: str) -> None:
    """Refuse ``named`` tensors (plain or DTensor shards) that are not the same on every rank
    of ``group``, on every rank alike; ``what`` names the group in the message."""
    if not named or dist.get_world_size(group) == 1:
        return
    digests = torch.stack([torch.stack([_local(t).double().sum(), _local(t).double().square().sum()])
                           for t in named.values()]).detach().cpu()
    low, high = digests.clone(), digests.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    differ = [name for name, lo, hi in zip(named, low, high) if not torch.equal(lo, hi)]
    if differ:
        raise ValueError(
            f"{len(differ)} weights differ between the ranks of {what} ({', '.join(differ[:3])}"
            f"{' ...' if len(differ) > 3 else ''}), and nothing makes them alike: seed every process the same way "
            "(transformers.set_seed) before creating them (PEFT initialises an adapter from the global generator)")


__all__ = ["average_gradients_over", "averaged_over", "check_alike_over"]
