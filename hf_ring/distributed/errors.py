"""One rank's refusal raised on every rank.

A check that fails on some ranks only (a collator built for another CP rank, a setting read
from a per-rank file) would leave the others running into the next collective, where they
wait for the timeout or die with the transport's "connection closed by peer", which names
nothing. :func:`raise_together` runs a check on every rank of a group and shares the
outcome (one small object all-gather): the failing ranks raise their own error, the others
an error of the same type that quotes it and names the ranks.

For set-up checks that run once (a trainer's construction), not per batch: the per-forward
checks share their verdicts inside the header they all-gather anyway.

Must not import transformers, accelerate, or hf_ring's layers above distributed/.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist

# Raised again under their own type on the ranks that did not fail; anything else as RuntimeError.
_SHARED_TYPES = (ValueError, NotImplementedError, TypeError, RuntimeError)


def raise_together(check: Callable[[], None], group: Optional[dist.ProcessGroup] = None) -> None:
    """Run ``check()`` on this rank; if it raised here or on any other rank of ``group``
    (default: the whole world), raise on every rank. Collective when a process group is
    initialised: every rank of ``group`` must call it, with its own ``check``.

    Raises:
        the error ``check`` raised, on the ranks where it did; on the others an error of
        the same type (one of ValueError, NotImplementedError, TypeError, RuntimeError;
        RuntimeError for any other) naming the ranks and quoting the first one's message.
    """
    if not (dist.is_available() and dist.is_initialized()):
        check()
        return
    error: Optional[BaseException] = None
    try:
        check()
    except Exception as e:  # noqa: BLE001 - shared, then raised again below
        error = e
    mine = None if error is None else (type(error).__name__, str(error))
    outcomes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, mine, group=group)
    failed = [r for r, outcome in enumerate(outcomes) if outcome is not None]
    if error is not None:
        raise error
    if failed:
        name, message = outcomes[failed[0]]
        kind = next((t for t in _SHARED_TYPES if t.__name__ == name), RuntimeError)
        raise kind(f"rank(s) {failed} refused this set-up (the same check passed here): {name}: {message}")
