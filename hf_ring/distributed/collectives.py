"""The collectives the all-gather, Ulysses and hybrid patterns use, behind one interface.

A :class:`Collectives` gathers, reduce-scatters and all-to-alls tensors whose first
dimension indexes the ranks of one group; its all-gather can also be started and waited
for later (:meth:`Collectives.start_all_gather`), so that work which does not need the
gathered tensor runs while it travels:

- :class:`GroupCollectives`: the real ones over a process group (NCCL on GPUs, gloo in
  the tests), the time blocked in them added to an optional ``CommWaitStats`` sink.
- :class:`VirtualCollectives`: every rank of a group run one after another in one
  process (benchmarks): the all-gather delivers every rank's tensor as the real one would;
  the reduce-scatter and the all-to-all, whose results depend on ranks not yet run, move
  the same number of bytes but deliver this rank's own values.

:func:`all_to_all` is the differentiable all-to-all Ulysses is built from;
:func:`all_gather` the differentiable all-gather the token mixers exchange their pieces'
summaries with (its backward sums, on each rank, every rank's gradient of its tensor);
:func:`summed_over` the differentiable all-reduce of statistics summed over a group.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NoReturn, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from hf_ring.distributed.comm import CommWaitStats, peer_failed
from hf_ring.distributed.nccl_failures import is_nccl, watch_all

# torch 2.13 renamed the tensor collectives; older releases (>= 2.5) have only the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class PendingGather(Protocol):
    """An all-gather under way."""

    def wait(self) -> torch.Tensor:
        """Block until it has arrived -> ``(world, *x.shape)``, in rank order (at once after
        the first wait)."""
        ...


class Gathered:
    """A :class:`PendingGather` whose tensor is already here (collectives run in one process)."""

    def __init__(self, gathered: torch.Tensor) -> None:
        self.gathered = gathered

    def wait(self) -> torch.Tensor:
        return self.gathered


class Collectives(Protocol):
    """Collectives over the ``world`` ranks of one group, this process being ``rank``."""

    rank: int
    world: int

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (any shape) from every rank -> ``(world, *x.shape)``, in rank order."""
        ...

    def start_all_gather(self, x: torch.Tensor) -> PendingGather:
        """:meth:`all_gather`, returned before it arrives; ``x`` must not change until then."""
        ...

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(world, *shape)`` -> ``shape``: the sum over the ranks of their ``x[rank]``."""
        ...

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(world, *shape)``; ``x[j]`` goes to rank j -> ``(world, *shape)``, entry j
        from rank j."""
        ...


# Whom a failed collective's message names, and what its ranks must all have run.
CP_GROUP = ("the context-parallel group", "the same attention call (a rank that skipped a backward, ran an extra "
            "forward alone, or stopped). Every rank of a CP group must run every forward and backward together")


class GroupCollectives:
    """The collectives of ``group`` (None: the default group). ``names``: ``(the group, what
    every rank of it must run)``, for the message when a peer never takes part."""

    def __init__(self, group: Optional[dist.ProcessGroup], stats: Optional[CommWaitStats] = None,
                 names: tuple[str, str] = CP_GROUP) -> None:
        self.group, self.stats, self.names = group, stats, names
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._nccl = is_nccl(group)

    def _raise(self, e: RuntimeError) -> NoReturn:
        """Raise ``e``, or for a peer that never took part, an error that names what every
        rank must run."""
        if not peer_failed(e):
            raise e
        group, duty = self.names
        raise RuntimeError(f"a collective of {group} did not complete: another rank did not run {duty}. ({e})") from e

    def _start(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (issues one collective with ``async_op=True``) -> its work."""
        try:
            work = fn()
            if self._nccl:  # a stalled collective is reported from NCCL's watchdog (nccl_failures.py)
                watch_all(work, self.group, "a collective")
        except RuntimeError as e:
            self._raise(e)
        return work

    def _wait(self, work: Any) -> None:
        """Block on ``work``; the time blocked goes to the stats (not the time it travelled
        while other work ran)."""
        start = time.perf_counter()
        try:
            work.wait()
        except RuntimeError as e:
            self._raise(e)
        if self.stats is not None:
            self.stats.seconds += time.perf_counter() - start
            self.stats.waits += 1

    def _run(self, fn: Callable[[], Any]) -> None:
        self._wait(self._start(fn))

    def start_all_gather(self, x: torch.Tensor) -> PendingGather:
        x = x.contiguous()
        out = x.new_empty((self.world * x.shape[0], *x.shape[1:])) if x.dim() else x.new_empty(self.world)
        work = self._start(lambda: _ALL_GATHER(out, x, group=self.group, async_op=True))
        return _GroupGather(self, work, x, out.view(self.world, *x.shape))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.start_all_gather(x).wait()

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[1:])
        # The collective takes the ranks' pieces concatenated along the first dimension.
        flat = x.contiguous().view(x.shape[0] * x.shape[1], *x.shape[2:])
        self._run(lambda: _REDUCE_SCATTER(out, flat, group=self.group, async_op=True))
        return out

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        self._run(lambda: dist.all_to_all_single(out, x.contiguous(), group=self.group, async_op=True))
        return out


class _GroupGather:
    """A :class:`GroupCollectives` all-gather under way: its work, its input (held until it
    has arrived, whatever the backend keeps) and the tensor it fills."""

    def __init__(self, coll: GroupCollectives, work: Any, x: torch.Tensor, out: torch.Tensor) -> None:
        self.coll, self.work, self.x, self.out = coll, work, x, out

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.coll._wait(self.work)
            self.work = self.x = None
        return self.out


class VirtualCollectives:
    """The collectives of rank ``rank`` of a group run in one process (see module docstring).

    Args:
        rank: the simulated rank.
        gathered: every rank's tensor for the all-gather, in rank order (the values the
            real all-gather would deliver), or None when the pattern does not all-gather.
        world: the group's size (defaults to ``len(gathered)``).
    """

    def __init__(self, rank: int, gathered: Optional[Sequence[torch.Tensor]] = None,
                 world: Optional[int] = None, stats: Optional[CommWaitStats] = None) -> None:
        self.rank, self.gathered, self.stats = rank, gathered, stats
        self.world = world if world is not None else len(gathered or ())

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.gathered is None:
            raise ValueError("VirtualCollectives(gathered=None) cannot all-gather: give every rank's tensor")
        return torch.stack(list(self.gathered))

    def start_all_gather(self, x: torch.Tensor) -> PendingGather:
        return Gathered(self.all_gather(x))

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.rank].clone()

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


class _AllToAll(torch.autograd.Function):
    """All-to-all whose backward is the all-to-all back (it is its own inverse)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, coll: Collectives) -> torch.Tensor:
        ctx.coll = coll
        return coll.all_to_all(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.coll.all_to_all(grad), None


def all_to_all(x: torch.Tensor, coll: Collectives) -> torch.Tensor:
    """Differentiable all-to-all: ``x`` ``(world, *shape)``, ``x[j]`` sent to rank j ->
    ``(world, *shape)``, entry j received from rank j; any dtype."""
    return _AllToAll.apply(x, coll)


class _AllGather(torch.autograd.Function):
    """All-gather whose backward reduce-scatters: each rank's tensor was read by every
    rank, so its gradient is the sum of theirs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, coll: Collectives) -> torch.Tensor:
        ctx.coll = coll
        return coll.all_gather(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.coll.reduce_scatter(grad.contiguous()), None


def all_gather(x: torch.Tensor, coll: Collectives) -> torch.Tensor:
    """Differentiable all-gather: ``x`` (any shape, one per rank) -> ``(world, *x.shape)``
    in rank order; the gradient of ``x`` is the sum over the ranks of their gradient of
    entry ``rank`` (every rank must run the backward). Floating dtypes."""
    return _AllGather.apply(x, coll)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces too: every rank read every rank's term,
    so each term's gradient is the sum of every rank's gradient of the total."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def summed_over(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Differentiable sum of ``x`` (any shape, floating, the same on every rank) over
    ``group`` (None: the default group); ``x`` itself without torch.distributed. Every rank
    must run the backward."""
    if not (dist.is_available() and dist.is_initialized()):
        return x
    return _SumOverGroup.apply(x, group)


__all__ = ["Collectives", "Gathered", "GroupCollectives", "PendingGather", "VirtualCollectives", "all_gather",
           "all_to_all", "summed_over"]
