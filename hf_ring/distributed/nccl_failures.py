"""A peer that stopped, reported by name on NCCL, where no Python error can be raised.

Why: on gloo a transfer whose peer never comes fails in ``wait()`` with "Timed out" or
"Connection closed by peer", which the ring and the collectives turn into an error naming
the cause (``comm.py``, ``collectives.py``). On NCCL ``wait()`` only makes the compute
stream wait and returns; the stuck transfer is found by NCCL's watchdog thread once the
group's timeout has passed (``setup_context_parallel(timeout=)``, handed to ``new_group``),
and the watchdog then stops the process (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 1 or 3, 3 by
default in PyTorch 2.13) with its own message, which names a sequence number, not the
cause. The process cannot go on anyway: an abandoned transfer leaves its buffers undefined.

What is done:

- every NCCL work of hf_ring's CP traffic (ring transfers, the patterns' collectives, the
  per-forward header) is watched through ``Work.get_future_result()``: the watchdog marks
  that future TIMEOUT or COMM_ERROR before it stops the process (PyTorch 2.13 and earlier
  releases that have the call), and the callback writes the cause and what to do to
  stderr and the log, on every rank of the group whose transfer stalled;
- a ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` of 0 (no handling: the process hangs) or 2 (the
  communicators are aborted and the process goes on, computing on undefined buffers) is
  warned about when NCCL groups are built. Nothing else in the environment is changed:
  the flight recorder's buffer is sized when the first process group is made, before
  hf_ring runs, so ``TORCH_NCCL_TRACE_BUFFER_SIZE`` / ``TORCH_NCCL_DUMP_ON_TIMEOUT`` are
  the launcher's to set.

With ``TORCH_NCCL_BLOCKING_WAIT=1``, ``wait()`` itself blocks and raises on timeout, and the
gloo path's Python error is raised on NCCL too, at the cost of the host's run-ahead.

The callbacks run Python on the watchdog thread, which needs a live interpreter (PyTorch's
warning for its completion hooks): hf_ring's CP works complete long before a normal exit,
and ``destroy_process_group()`` before exit (Accelerate's ``end_training``) rules it out.

Untested on NCCL: this project has had no GPU. The callback and the warning are tested on
the CPU with a stand-in work and backend name.

Must not import transformers, accelerate, or hf_ring's layers above distributed/.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Mapping, Optional

import torch.distributed as dist

logger = logging.getLogger(__name__)

# torch._C._distributed_c10d.WorkResult values (the future holds the int).
_RESULTS = {0: "succeeded", 1: "timed out", 2: "failed with a communicator error", 100: "failed"}


def is_nccl(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether ``group`` (None: the default group) runs on NCCL (alone or for CUDA in a
    ``"cpu:gloo,cuda:nccl"`` group)."""
    return "nccl" in str(dist.get_backend(group)).lower()


def failure_message(result: Any, what: str, rank: int, ranks: list[int]) -> str:
    """The message for a CP work of ``what`` (e.g. "a ring transfer") that ended with the
    ``WorkResult`` ``result`` on global rank ``rank`` of the CP group ``ranks``."""
    outcome = _RESULTS.get(result, f"ended with result {result!r}")
    return (
        f"hf_ring: rank {rank}: {what} of the context-parallel group (global ranks {ranks}) {outcome}: a rank of "
        "this group stopped (its process died, was killed or left the group) or did not run the same forward "
        "and backward. NCCL's watchdog stops this process next: the transfer's buffers are undefined, so it "
        "cannot go on. Look for the first rank that stopped in its own log; every rank of a CP group must run "
        "every forward and backward together. The wait is the group's timeout: "
        "RingAttentionPlugin(timeout=...) (seconds) or hf_ring.setup_context_parallel(timeout=...), 10 minutes by default."
    )


def watch(work: Any, group: Optional[dist.ProcessGroup], what: str) -> None:
    """Report ``work`` (an NCCL ``Work`` of ``group``) by :func:`failure_message` if it does
    not succeed. A no-op for a work without ``get_future_result`` (gloo, older PyTorch)."""
    get = getattr(work, "get_future_result", None)
    if get is None:
        return

    def report(future: Any) -> None:
        # Runs on NCCL's watchdog thread, after every work (so: nothing but a compare on
        # success), and must not raise.
        try:
            result = int(future.value())
        except Exception:  # noqa: BLE001 - a future that holds an error is a failure too
            result = 100
        if result != 0:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            message = failure_message(result, what, dist.get_rank(), ranks)
            print(message, file=sys.stderr, flush=True)
            logger.error(message)

    get().then(report)


def watch_all(works: Any, group: Optional[dist.ProcessGroup], what: str) -> None:
    """:func:`watch` every work of ``works`` (a list, one work, or None) when ``group`` is NCCL."""
    if works is None or not is_nccl(group):
        return
    for work in works if isinstance(works, (list, tuple)) else [works]:
        watch(work, group, what)


def check_error_handling(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """The warning for a ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` that keeps a process whose CP
    transfer failed running (None when it is unset or tears the process down); logged."""
    value = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", env.get("NCCL_ASYNC_ERROR_HANDLING"))
    if value is None or value.strip() not in ("0", "2"):
        return None
    consequence = ("a rank whose peer stopped hangs in its transfer forever" if value.strip() == "0" else
                   "a rank whose CP transfer timed out goes on with the transfer's undefined buffers, training "
                   "on wrong values unless your fault-tolerance layer stops it")
    warning = (f"TORCH_NCCL_ASYNC_ERROR_HANDLING={value.strip()}: {consequence}. Unset it (PyTorch's default, 3, "
               "stops the process with hf_ring's message naming the cause) or set 1.")
    logger.warning(warning)
    return warning


__all__ = ["check_error_handling", "failure_message", "is_nccl", "watch", "watch_all"]
