"""The process's one active context-parallel state, and what ``group=None`` means in every
public op that runs over a CP group.

A user who called ``setup_context_parallel(2)`` in a world of 4 means "my CP group" when
they call ``ring_flash_attn_func(q, k, v)`` with no group: ringing over the default group
would mix two CP groups' sequences and return numbers with no error. So the state lives
here, in the lowest layer that every op over a group can import (the patterns, the token
mixers, ``ContextParallel.wrap``), and :func:`resolve_cp_group` is the one place that
turns ``group=None`` into a group:

- a group passed explicitly is used as it is;
- ``None`` with an active state: that state's CP group (itself ``None`` only where the CP
  axis spans the whole default group, which then *is* the CP group);
- ``None`` with no active state: the default group (one process without torch.distributed).

The state object is the patterns layer's ``ContextParallelState``; this module reads only
its ``cp_group``, ``cp_size`` and ``world_group``, so it stays below that layer. Must not
import transformers, accelerate, or hf_ring's patterns, mixers, integration or training
layers.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch.distributed as dist


class CPStateView(Protocol):
    """What this layer reads of the active state (``hf_ring.patterns.ContextParallelState``)."""

    cp_group: Optional[dist.ProcessGroup]
    cp_size: int
    # The default group the state's groups were built over (None: built without one).
    world_group: Optional[dist.ProcessGroup]


_ACTIVE: Optional[CPStateView] = None


def active_state() -> Optional[CPStateView]:
    """The active state, or None when none was set up (or it was deactivated)."""
    return _ACTIVE


def set_active_state(state: Optional[CPStateView]) -> None:
    """Make ``state`` the active one; None deactivates context parallelism."""
    global _ACTIVE
    _ACTIVE = state


def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


def resolve_cp_group(group: Optional[dist.ProcessGroup], op: str) -> Optional[dist.ProcessGroup]:
    """The group ``op`` runs over when the caller passed ``group`` (module docstring).

    Raises:
        RuntimeError: ``group=None`` with an active state whose groups belong to a default
            group that no longer exists (destroyed, or initialised again since): its CP
            group cannot be used, and the default group is not what the user set up.
    """
    state = _ACTIVE
    if group is not None or state is None:
        return group
    current = dist.group.WORLD if _initialised() else None
    if state.world_group is current:
        return state.cp_group
    if state.world_group is None and (current is None or dist.get_world_size() == 1):
        # A one-process state made without torch.distributed, used in a world of one.
        return None
    raise RuntimeError(
        f"{op}(group=None) means the active context-parallel state's CP group, but that state was set up "
        "over another default process group (before torch.distributed was initialised, or over one destroyed "
        "or initialised again since), so its CP group cannot be used here and the default group is not the "
        "one you set up. Call hf_ring.setup_context_parallel(...) again now, or pass group= explicitly"
    )
