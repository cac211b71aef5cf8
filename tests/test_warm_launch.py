"""The warm launcher (tests/warm_launch.py) reports what a cold launch would: a failing rank
fails the launch, exit statuses are an interpreter's, each fork seeds its own generators, and
a timeout leaves no worker behind. Each launch is a fork of the warm server (about a second)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import warm_launch
from distributed import free_port
from subprocess_limits import HANG_GUARD_S

pytestmark = pytest.mark.skipif(warm_launch.COLD, reason="HF_RING_COLD_LAUNCH=1: the server is not used")

RANKS = """
import os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}"), "w") as f:
    f.write(f"{os.getpid()} {torch.initial_seed()}")
if sys.argv[2] == "raise" and dist.get_rank() == 1:
    raise RuntimeError("rank 1 refuses")
if sys.argv[2] == "hang":
    time.sleep(600)
dist.barrier()
sys.stdout.write(f"rank {dist.get_rank()} done\\n")  # one write: the ranks share the output
"""


def _torchrun_command(tmp_path, mode: str) -> list[str]:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), str(script), str(tmp_path), mode]


def _torchrun(tmp_path, mode: str) -> subprocess.CompletedProcess:
    return warm_launch.run(_torchrun_command(tmp_path, mode), dict(os.environ), str(tmp_path), HANG_GUARD_S)


def _written(tmp_path) -> list[tuple[int, int]]:
    return [tuple(map(int, (tmp_path / f"rank{r}").read_text().split())) for r in range(2)]


def test_ranks_run_and_draw_their_own_seeds(tmp_path):
    proc = _torchrun(tmp_path, "ok")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout
    (pid0, seed0), (pid1, seed1) = _written(tmp_path)
    assert pid0 != pid1 and seed0 != seed1


def test_a_failing_rank_fails_the_launch(tmp_path):
    proc = _torchrun(tmp_path, "raise")
    assert proc.returncode != 0
    assert "rank 1 refuses" in proc.stderr


def test_a_timeout_leaves_no_worker_behind(tmp_path):
    launch = warm_launch.Launch(_torchrun_command(tmp_path, "hang"), dict(os.environ), str(tmp_path))
    deadline = time.monotonic() + HANG_GUARD_S  # both ranks hanging, however slow the start
    while time.monotonic() < deadline and not all((tmp_path / f"rank{r}").exists() for r in range(2)):
        assert not launch.ended(), launch.wait(0).stderr[-3000:]  # it ended before both ranks started
        time.sleep(0.2)
    with pytest.raises(subprocess.TimeoutExpired):
        launch.wait(timeout=1)
    pids = [pid for pid, _ in _written(tmp_path)]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.2)
    assert [p for p in pids if _running(p)] == []


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("code, status", [("sys.exit(3)", 3), ("sys.exit(256)", 0), ("sys.exit('no')", 1),
                                          ("raise ValueError('bad')", 1), ("pass", 0)])
def test_exit_statuses_are_an_interpreters(tmp_path, code, status):
    script = tmp_path / "exits.py"
    script.write_text(f"import sys\n{code}\n")
    proc = warm_launch.run([sys.executable, str(script)], dict(os.environ), str(tmp_path), HANG_GUARD_S)
    assert proc.returncode == status, (code, proc.returncode, proc.stderr)
