"""Rollouts of a CP group: each group's prompts generated once, without CP, as one process would.

Under context parallelism ``RingGRPOTrainer`` gives each rank of a CP group its own slice of
the group's prompts (rank ``r`` of ``cp_size`` the ``r``-th contiguous part), so that TRL's
bookkeeping, whose gathers run over every process (rewards, advantages, completion lengths,
token counts, metrics), sees each rollout exactly once, in the group's order. Generation
must not run as a ring (a KV cache of a shard is no cache), and its samples must be those of
a run without CP:

- :func:`generate_for_group`: the group's first rank gathers every rank's prompts (in rank
  order: the group's batch as one process holds it), generates them all in **one** call
  with CP suspended (the same batch, left padding and RNG stream as one process generating
  that batch), and broadcasts the completions; each rank keeps its slice. The others wait
  meanwhile: generating the same batch on every rank would repeat the work ``cp_size``
  times for nothing, and splitting it across the ranks would draw other samples than one
  process does (the sampling RNG runs over the batch), so the run could not be compared
  with one process. The first rank's generators, which sampling advanced, go along with
  the completions: every rank of the group then holds what one process holds after
  generating, as the training forward's dropout needs (hf_ring/hf/randomness: every rank
  of a CP group draws from the same generator state).
- ``generate_for_group(..., under_cp=True)``: every rank of the group generates the group's
  prompts together under CP instead, the prompt's K/V sharded over the group (its length is
  then capped by the group, not by one device); every rank samples the same tokens, since
  every rank of a group holds the same generator state, and keeps its slice.
- :func:`group_shuffle`: TRL shuffles a process's generation batch with ``torch.randperm``
  of its length; under CP each rank draws the permutation of the **group's** batch instead
  (so the first rank's RNG, which samples the next rollouts, advances as one process's
  does) and keeps its own rows in that order.

Must not import TRL (the caller passes TRL's generation as a function), transformers or accelerate.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from hf_ring.patterns.state import ContextParallelState, context_parallel_suspended

# What TRL's generation returns: completion token ids per prompt, and per-token sampling
# log-probabilities (None on the transformers path).
Generated = tuple[list[list[int]], Optional[list]]


def _generator_states() -> tuple[torch.Tensor, Optional[list[torch.Tensor]]]:
    """The CPU generator's state and every CUDA device's (None without CUDA)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_generator_states(states: tuple[torch.Tensor, Optional[list[torch.Tensor]]]) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _slice(state: ContextParallelState, counts: Sequence[int], rows: Optional[list]) -> Optional[list]:
    if rows is None:
        return None
    start = sum(counts[: state.cp_rank])
    return rows[start : start + counts[state.cp_rank]]


def generate_for_group(
    state: ContextParallelState, prompt_ids: list[list[int]], generate: Callable[[list[list[int]]], Generated],
    under_cp: bool = False,
) -> Generated:
    """This rank's completions of ``prompt_ids`` (its slice of the group's prompts, token ids),
    generated for the whole group in one ``generate`` call: by the CP group's first rank
    without CP, or, ``under_cp``, by every rank of the group together under CP (the prompts
    prefilled by the ring into a sharded cache, hf_ring.hf.generation; each rank samples the
    same tokens from its own generator, which every rank of a group holds alike). Collective
    over the CP group; see the module docstring.

    Raises:
        RuntimeError: on every rank of the group when the generation failed on the first rank
            (the others would otherwise wait in the broadcast until the timeout).
    """
    group = state.cp_group
    parts: list = [None] * state.cp_size
    dist.all_gather_object(parts, list(prompt_ids), group=group)
    counts = [len(p) for p in parts]
    if under_cp:
        completions, logprobs = generate([row for part in parts for row in part])
        return _slice(state, counts, completions), _slice(state, counts, logprobs)
    payload: list[Any] = [None]
    error: Optional[BaseException] = None
    if state.cp_rank == 0:
        try:
            with context_parallel_suspended():
                payload[0] = ("ok", generate([row for part in parts for row in part]), _generator_states())
        except Exception as e:  # noqa: BLE001 - shared with the group, then raised here below
            payload[0] = ("error", f"{type(e).__name__}: {e}")
            error = e
    dist.broadcast_object_list(payload, src=state.first_rank, group=group)
    status, result = payload[0][:2]
    if status != "ok":
        if error is not None:
            raise error
        raise RuntimeError(f"generation failed on the CP group's first rank (global rank {state.first_rank}): {result}")
    _set_generator_states(payload[0][2])
    completions, logprobs = result
    if len(completions) != sum(counts):
        raise RuntimeError(f"generation returned {len(completions)} completions for {sum(counts)} prompts")
    return _slice(state, counts, completions), _slice(state, counts, logprobs)


def group_shuffle(state: ContextParallelState) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A replacement for TRL's ``shuffle_sequence_dict`` under CP: the permutation of the CP
    group's batch (``cp_size`` equal slices, this rank's the ``cp_rank``-th), this rank's rows
    kept in its order. Values: tensors ``(rows, ...)`` or lists of ``rows`` items (permuted),
    0-d tensors and None (kept)."""

    def shuffle(seq_dict: dict[str, Any]) -> dict[str, Any]:
        rows = len(next(v for v in seq_dict.values() if v is not None))
        permutation = torch.randperm(rows * state.cp_size)
        start = state.cp_rank * rows
        own = permutation[(permutation >= start) & (permutation < start + rows)] - start

        def permute(v: Any) -> Any:
            if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
                return v
            if isinstance(v, torch.Tensor):
                return v[own.to(v.device)]
            return [v[i] for i in own.tolist()]

        return {key: permute(value) for key, value in seq_dict.items()}

    return shuffle
