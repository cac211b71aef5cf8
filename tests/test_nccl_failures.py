"""What can be checked on the CPU of hf_ring's NCCL failure reporting (``nccl_failures.py``).

The NCCL path itself is untested: this project has had no GPU. Stand-ins here: the backend
name (``dist.get_backend`` answers "nccl"), the world (rank, size, ``new_group``) and the
NCCL ``Work``, whose ``get_future_result()`` future is completed by the test with the
``WorkResult`` the watchdog would set (PyTorch 2.13: 0 success, 1 timeout, 2 comm error).

- ``setup_context_parallel(timeout=)`` hands its timeout (and the NCCL backend) to every
  ``new_group`` it builds, which is what sets the NCCL watchdog's timeout of those groups;
- ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 0 / 2 are warned about (naming the consequence), an
  unset or tearing-down value is not;
- the ring's transfers, the patterns' collectives and the per-forward check watch their NCCL
  works: a timed-out work writes the message naming the cause; a successful one writes
  nothing; on gloo nothing is watched (gloo raises in ``wait()`` instead).
"""

from __future__ import annotations

import logging
import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import hf_ring
from hf_ring.distributed import nccl_failures
from hf_ring.distributed.collectives import GroupCollectives
from hf_ring.distributed.comm import RingExchange
from hf_ring.patterns.validation import check_agreement

CAUSE = (r"hf_ring: rank 1: {what} of the context-parallel group \(global ranks \[0, 1, 2, 3\]\) timed out: "
         r"a rank of this group stopped.*NCCL's watchdog stops this process.*setup_context_parallel\(timeout=")


class FakeWork:
    """An NCCL work as far as hf_ring uses it: its result future and ``wait``."""

    def __init__(self) -> None:
        self.result: torch.futures.Future = torch.futures.Future()
        self.asked = 0

    def get_future_result(self) -> torch.futures.Future:
        self.asked += 1
        return self.result

    def wait(self) -> bool:
        return True


@pytest.fixture
def world(monkeypatch):
    """Rank 1 of 4 with an NCCL default group (stand-ins); returns the works handed out."""
    works: list[FakeWork] = []

    def new_work(*args, **kwargs):
        works.append(FakeWork())
        return works[-1]

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "P2POp", lambda *args: args)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [new_work()])
    monkeypatch.setattr(dist, "all_to_all_single", new_work)

    def all_gather(gathered, mine, **kwargs):
        for g in gathered:
            g.copy_(mine)  # every rank agrees
        return new_work()

    monkeypatch.setattr(dist, "all_gather", all_gather)
    return works


def test_a_timed_out_ring_transfer_is_reported_by_cause(world, capsys):
    exchange = RingExchange(None)
    exchange.start(torch.zeros(2), torch.zeros(2))
    exchange.wait()
    assert world[0].asked == 1
    world[0].result.set_result(0)  # success: nothing said
    assert capsys.readouterr().err == ""
    exchange.start(torch.zeros(2), torch.zeros(2))
    world[1].result.set_result(1)  # what the watchdog sets at the group's timeout
    err = capsys.readouterr().err
    assert re.search(CAUSE.format(what="a ring transfer"), err), err


def test_the_patterns_collectives_and_the_forward_check_are_watched(world, capsys):
    GroupCollectives(None).all_to_all(torch.zeros(4, 2))
    world[-1].result.set_result(2)
    assert "a collective of the context-parallel group (global ranks [0, 1, 2, 3]) failed with a communicator " \
           "error" in capsys.readouterr().err
    assert check_agreement(None, [("batch", 1)], torch.device("cpu"), "inputs", "hint") == [[1]] * 4
    world[-1].result.set_result(1)
    err = capsys.readouterr().err
    assert re.search(CAUSE.format(what="the check of a forward's inputs"), err), err


def test_gloo_works_are_not_watched(world, monkeypatch, capsys):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    RingExchange(None).start(torch.zeros(2), torch.zeros(2))
    assert world[0].asked == 0


def test_setup_hands_the_timeout_to_every_nccl_group(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kwargs: calls.append((ranks, kwargs)) or object())
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    timeout = timedelta(seconds=42)
    with caplog.at_level(logging.WARNING, logger=nccl_failures.__name__):
        state = hf_ring.setup_context_parallel(2, timeout=timeout, dist_backend="nccl", activate=False)
    assert state.timeout == timeout and (state.cp_rank, state.dp_rank) == (1, 0)
    assert [ranks for ranks, _ in calls] == [[0, 1], [2, 3], [0, 2], [1, 3]]
    assert all(kwargs == {"backend": "nccl", "timeout": timeout} for _, kwargs in calls), calls
    assert not caplog.records  # unset: PyTorch's default tears the process down


@pytest.mark.parametrize("value,warned", [("0", "hangs in its transfer forever"), ("2", "undefined buffers"),
                                          ("1", None), ("3", None)])
def test_error_handling_that_keeps_a_failed_process_running_is_warned_about(value, warned, caplog):
    with caplog.at_level(logging.WARNING, logger=nccl_failures.__name__):
        got = nccl_failures.check_error_handling({"TORCH_NCCL_ASYNC_ERROR_HANDLING": value})
    if warned is None:
        assert got is None and not caplog.records
    else:
        assert warned in got and "Unset it" in got and caplog.records[0].getMessage() == got
