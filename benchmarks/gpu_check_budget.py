"""gpu_check.py's time budget: one total, split over the sections, enforced inside them.

A GPU machine is lent for minutes (one H200, 10 minutes a command), so the check must end
in time by construction, not by hope:

- the total (``--budget``, seconds from the script's start, imports included) is split
  over the sections by weight; a section's share is its weight's part of the time still
  left when it starts, so what one section leaves unused goes to the later ones;
- inside a section, loops stop starting items once its share is spent
  (:meth:`Deadline.spent`), and an item still running then (a first-use compile, a cuDNN
  graph build, a long measurement) is interrupted by a timer signal that raises
  :class:`BudgetSpent` (:meth:`Deadline.hard`), so compile time counts like any other;
- a last guard (:func:`kill_switch`) ends the process ``grace_s`` after the total even if
  it is stuck inside one C call, where no signal handler runs; the report on disk then
  holds every section that finished, and the verdicts once correctness has.

Must not import hf_ring or torch: it is plain timing.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

# Shares of the time left, by section; correctness first and largest: its verdicts are
# the point of the run.
WEIGHTS = {"correctness": 0.38, "throughput": 0.13, "efficiency": 0.18, "patterns": 0.09, "overlap": 0.05,
           "placement": 0.09, "compile": 0.08}
FULL_BUDGET_S, QUICK_BUDGET_S = 420.0, 180.0
# After the total, the kill switch's wait: time for a section's interruption to unwind
# and the report to be written.
GRACE_S = 40.0


class BudgetSpent(BaseException):
    """A section's share of the budget ran out while an item was running. A BaseException,
    so that the per-item ``except Exception`` guards (one failing case must not stop the
    others) let it through to the section."""


@dataclass
class Deadline:
    """One section's end, on ``clock``'s scale."""

    name: str
    end: float
    clock: Callable[[], float] = time.monotonic

    def left(self) -> float:
        return self.end - self.clock()

    def spent(self) -> bool:
        return self.left() <= 0

    @contextlib.contextmanager
    def hard(self) -> Iterator[None]:
        """Raise :class:`BudgetSpent` inside the block when the deadline passes (SIGALRM;
        main thread only). The timer is disarmed and the old handler restored on exit."""
        def ring(signum, frame):
            raise BudgetSpent(f"section {self.name!r}: its share of the time budget ran out")

        old = signal.signal(signal.SIGALRM, ring)
        signal.setitimer(signal.ITIMER_REAL, max(self.left(), 1e-3))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


@dataclass
class Budget:
    """The total budget from ``start`` and its split over ``weights`` (sections in run order)."""

    total_s: float
    start: float
    weights: dict[str, float] = field(default_factory=lambda: dict(WEIGHTS))
    clock: Callable[[], float] = time.monotonic

    def plan(self, setup_s: float = 0.0) -> dict[str, float]:
        """Each section's share in seconds were every section to use all of it, after
        ``setup_s`` of imports and set-up; they add up to the total minus the set-up."""
        left = self.total_s - setup_s
        return {name: left * w / sum(self.weights.values()) for name, w in self.weights.items()}

    def section(self, name: str, skipped: tuple[str, ...] = ()) -> Deadline:
        """The deadline of section ``name`` starting now: its weight's part of the time
        left, among the sections from it on that will run."""
        order = list(self.weights)
        later = [n for n in order[order.index(name):] if n not in skipped]
        left = self.start + self.total_s - self.clock()
        share = max(left, 0.0) * self.weights[name] / sum(self.weights[n] for n in later)
        return Deadline(name, self.clock() + share, self.clock)

    @property
    def hard_limit_s(self) -> float:
        """When the kill switch ends the process, seconds from ``start``."""
        return self.total_s + GRACE_S


def kill_switch(budget: Budget) -> None:
    """End the process (printing every thread's stack) at the budget's hard limit, even if
    the main thread is inside a C call; :func:`disarm` before a normal exit."""
    faulthandler.dump_traceback_later(max(budget.start + budget.hard_limit_s - budget.clock(), 1.0), exit=True,
                                      file=sys.stderr)


def disarm() -> None:
    faulthandler.cancel_dump_traceback_later()
