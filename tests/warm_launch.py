"""Run a test's launch command with every interpreter forked from a warm server.

``run(cmd, env, cwd, timeout)`` is ``subprocess.run(cmd, capture_output=True, text=True)``
for a command ``[sys.executable, ...]`` (Accelerate's or torch's launcher, or a script),
except that the command and each worker its launcher starts are forks of
:mod:`warm_server`, which imported the libraries once: a launch no longer pays 5-7 s per
process to import them, which was most of each Trainer test's time. The launchers, the
scripts and their arguments are the real ones; docs/testing.md says what differs from a cold
interpreter and why it does not matter.

The server is started on the first launch of a pytest process and ended with it.
``HF_RING_COLD_LAUNCH=1`` runs every command as a plain subprocess instead, to rule the
server out while chasing a failure.

Imports nothing from hf_ring.
"""

from __future__ import annotations

import atexit
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Optional

from warm_protocol import read_message, send_request

HERE = os.path.dirname(os.path.abspath(__file__))
COLD = os.environ.get("HF_RING_COLD_LAUNCH") == "1"
_START_TIMEOUT_S = 600  # the server's imports, on a loaded 2-core machine


class _Server:
    """The warm server of this pytest process: its socket, its stub, its live jobs."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="hf_ring_warm_")
        self.socket = os.path.join(self.dir, "socket")
        self.stub = os.path.join(self.dir, "python")
        with open(self.stub, "w") as f:
            f.write(f'#!/bin/sh\nexec "{sys.executable}" -S "{os.path.join(HERE, "warm_stub.py")}" "$@"\n')
        os.chmod(self.stub, 0o755)
        self.log = os.path.join(self.dir, "server.log")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "warm_server.py"), self.socket],
                                         env=env, cwd=os.path.dirname(HERE), stdout=subprocess.PIPE, stderr=log,
                                         text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], _START_TIMEOUT_S)
        if not ready or self.proc.stdout.readline().strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the warm launcher's server did not start:\n{self._log_tail()}")
        self.jobs: set[int] = set()

    def _log_tail(self) -> str:
        with open(self.log) as f:
            return f.read()[-4000:]

    def request(self, argv: list[str], env: dict, cwd: str, streams: list[int]) -> tuple[socket.socket, int]:
        """Ask for a job; return the connection its status will come on, and its pid (= process group)."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"the warm launcher's server has exited:\n{self._log_tail()}")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.socket)
        send_request(conn, {"kind": "job", "argv": argv, "env": env, "cwd": cwd}, streams)
        started = read_message(conn)
        if started is None:
            raise RuntimeError(f"the warm launcher's server did not start {argv!r}:\n{self._log_tail()}")
        self.jobs.add(started["pid"])
        return conn, started["pid"]

    def close(self) -> None:
        for pgid in self.jobs:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_SERVER: Optional[_Server] = None


def _server() -> _Server:
    global _SERVER
    if _SERVER is None:
        _SERVER = _Server()
        atexit.register(_SERVER.close)
    return _SERVER


class Launch:
    """One command, started; :meth:`wait` gives its ``CompletedProcess`` (output as text)."""

    def __init__(self, cmd: list[str], env: dict, cwd: str) -> None:
        if cmd[0] != sys.executable:
            raise ValueError(f"the warm launcher runs this interpreter's commands, not {cmd[0]!r}")
        self.cmd = cmd
        self.files = []
        for stream in ("stdout", "stderr"):
            f = tempfile.NamedTemporaryFile(prefix=f"hf_ring_launch_{stream}_", suffix=".log", delete=False)
            f.close()
            self.files.append(f.name)
        streams = [os.open(os.devnull, os.O_RDONLY), *(os.open(f, os.O_WRONLY | os.O_APPEND) for f in self.files)]
        try:
            if COLD:
                self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=streams[0], stdout=streams[1],
                                             stderr=streams[2])
            else:
                server = _server()
                env = dict(env, HF_RING_WARM_SOCKET=server.socket, PYTHON_EXEC=server.stub)
                self.conn, self.pgid = server.request(cmd[1:], env, cwd, streams)
        finally:
            for fd in streams:
                os.close(fd)

    def _outputs(self) -> tuple[str, str]:
        texts = []
        for name in self.files:
            with open(name, errors="replace") as f:
                texts.append(f.read())
            os.unlink(name)
        return texts[0], texts[1]

    def ended(self) -> bool:
        """Whether the command has ended (its status can be read without waiting)."""
        if COLD:
            return self.proc.poll() is not None
        return bool(select.select([self.conn], [], [], 0)[0])

    def kill(self) -> None:
        if COLD:
            self.proc.kill()
        else:
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        if COLD:
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                out, err = self._outputs()
                raise subprocess.TimeoutExpired(self.cmd, timeout, output=out, stderr=err) from None
        else:
            self.conn.settimeout(timeout)
            try:
                ended = read_message(self.conn)
            except socket.timeout:
                self.kill()
                out, err = self._outputs()
                raise subprocess.TimeoutExpired(self.cmd, timeout, output=out, stderr=err) from None
            finally:
                self.conn.close()
                _server().jobs.discard(self.pgid)
            # A job killed outright (no status) reads as a shell reports it.
            code = 128 + signal.SIGKILL if ended is None else int(ended["exit"])
        out, err = self._outputs()
        return subprocess.CompletedProcess(self.cmd, code, stdout=out, stderr=err)


def run(cmd: list[str], env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)``, warm."""
    return Launch(cmd, env, cwd).wait(timeout)
