"""benchmarks/gpu_check_budget.py: the total split over the sections with unused time
passed on, loops stopping once a share is spent, and an item still running then
interrupted (a first-use compile counts like any other work). A fake clock drives the
split; the interruption uses the real timer on a sleep far longer than the deadline, so
nothing here depends on the machine's speed."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import gpu_check_budget as budgets  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_shares_follow_the_weights_and_unused_time_passes_on():
    clock = Clock()
    budget = budgets.Budget(100.0, 0.0, {"a": 0.5, "b": 0.25, "c": 0.25}, clock)
    assert budget.plan(setup_s=20.0) == {"a": 40.0, "b": 20.0, "c": 20.0}
    clock.now = 20.0  # after imports
    a = budget.section("a")
    assert a.end == 60.0 and not a.spent()
    clock.now = 30.0  # "a" used 10 of its 40 s: "b" and "c" share the 70 s left
    b = budget.section("b")
    assert b.end == 30.0 + 35.0
    clock.now = b.end + 1.0  # "b" overran by one second: "c" gets what is left, no more
    assert b.spent() and budget.section("c").end == 100.0
    clock.now = 120.0
    assert budget.section("c").left() <= 0  # past the total: nothing to start
    assert budget.hard_limit_s == 100.0 + budgets.GRACE_S


def test_a_skipped_section_leaves_its_share_to_the_others():
    clock = Clock()
    budget = budgets.Budget(90.0, 0.0, {"a": 1.0, "b": 1.0, "c": 1.0}, clock)
    assert budget.section("a", skipped=("b",)).end == 45.0


def test_an_item_running_past_the_deadline_is_interrupted():
    deadline = budgets.Deadline("slow", time.monotonic() + 0.2)
    with pytest.raises(budgets.BudgetSpent, match="'slow'"):
        with deadline.hard():
            time.sleep(600)  # a compile that would never end in time
    # The timer is disarmed afterwards: a later wait is not interrupted.
    time.sleep(0.3)


def test_budget_spent_passes_per_item_guards():
    """Per-item ``except Exception`` guards must not swallow the interruption."""
    assert not issubclass(budgets.BudgetSpent, Exception)
