"""The warm launcher's server: a process that imported torch, transformers, Accelerate, TRL
and hf_ring once and forks a ready interpreter for every command a test launches.

A launch test runs a real command line (``python -m accelerate.commands.launch ...``,
``python -m torch.distributed.run ...``, ``python script.py ...``), and each of its
processes spends 5-7 s importing the same libraries before a second of training: on the
suite's 2 cores that was most of its time. Here every process of such a command is a fork
of this server instead of a new interpreter:

- a **job** (the test's command) is forked with the test's environment, working directory
  and output file, and runs the command's module or script as ``python`` would run it:
  the launcher is Accelerate's or torch's own, unchanged;
- the launcher starts its workers with ``PYTHON_EXEC`` (torch.distributed.run's documented
  override) pointing at :mod:`warm_stub`, which hands this server its arguments,
  environment and standard streams: each **worker** is forked likewise, in the job's process
  group (named in its environment, ``HF_RING_WARM_GROUP``), and its exit status goes back
  through the stub to the launcher. Killing the job's group ends the launcher and every worker.

What differs from a cold interpreter, and why it does not change what the tests prove:
- the libraries were imported under the server's environment (the suite's, plus no GPU),
  not the run's: none of them reads a run's variables (ranks, ports, Accelerate's flags) at
  import, only when the run asks;
- OpenMP read its thread count when torch loaded: a run's ``OMP_NUM_THREADS`` (torchrun
  sets 1 per worker) is applied with ``torch.set_num_threads`` before the run starts;
- torch's and NumPy's generators are reseeded in every fork, as every interpreter seeds
  its own (Python's reseeds itself); the string hash seed alone is the server's in every fork
  (``HF_RING_COLD_LAUNCH=1`` rules that out);
- a worker that ends by a signal, or by ``os._exit`` without a status, reads as 137 (killed):
  towards failing, never towards passing.

Messages: :mod:`warm_protocol`, one request per connection. The forked process watches its
connection: if the caller goes away, it kills itself rather than live on.

Imports only :mod:`warm_protocol` from the tests; started by :mod:`warm_launch`.
"""

from __future__ import annotations

import atexit
import importlib
import os
import runpy
import signal
import socket
import sys
import threading
import traceback

from warm_protocol import recv_request, send_message

# Imported once here, so that every fork finds them loaded. A library missing on one leg
# (the oldest transformers' environment has no TRL, say) is skipped: the run imports what
# it needs and fails there, as it would in a cold interpreter.
PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.run", "numpy", "transformers",
    "transformers.trainer", "transformers.models.llama.modeling_llama", "accelerate",
    "accelerate.commands.launch", "datasets", "safetensors.torch", "peft", "trl", "hf_ring",
    "hf_ring.trl",
)


HERE = os.path.dirname(os.path.abspath(__file__))
# Set in a job's environment to its process group; the workers its launcher starts join it.
GROUP_VARIABLE = "HF_RING_WARM_GROUP"


def _reseed() -> None:
    import torch

    torch.seed()
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed()


def _preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _watch_caller(conn: socket.socket, job: bool) -> None:
    """When the caller goes away, kill this process: a job (its caller the test) with its
    whole process group, a worker (its caller a launcher's stub) alone."""
    def watch() -> None:
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        if job:
            os.killpg(0, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="warm-caller-watch", daemon=True).start()


def _run_python(argv: list[str], cwd: str) -> int:
    """Run ``python <argv>`` in this process as the interpreter would; return its exit status.

    ``argv``: the interpreter's arguments: options ``-u`` (and other single flags, which
    change nothing here), then ``-m module args...`` or ``script args...``.
    """
    args = list(argv)
    while args and args[0].startswith("-") and args[0] != "-m":
        args.pop(0)  # -u: the streams are line-buffered below anyway
    if not args:
        raise ValueError(f"the warm launcher runs a script or -m module, not {argv!r}")
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path.insert(0, cwd)
            # Run as `python -m` runs it: the module as __main__ only (preloaded, runpy would
            # warn that it is already imported, and keep both).
            sys.modules.pop(args[1], None)
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(os.path.join(cwd, args[0]))
            sys.argv = [args[0], *args[1:]]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code & 0xFF  # what the process's parent reads, as from an interpreter
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    # What the interpreter does at exit: wait for non-daemon threads, then atexit's functions.
    threading._shutdown()
    atexit._run_exitfuncs()
    return code


def _serve_one(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: become the requested process, run it, report its status."""
    # The server ignores SIGCHLD to have its forks reaped; a launcher must wait for its own
    # children (ignored, their exit status would read as 0), and exec keeps an ignored signal.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    env = dict(request["env"])
    if request["kind"] == "job":
        # The job's process group, which its workers join (the launcher starts their stubs in
        # sessions of their own): killing it ends the launcher and every worker.
        os.setpgid(0, 0)
        env[GROUP_VARIABLE] = str(os.getpid())
    else:
        os.setpgid(0, int(env[GROUP_VARIABLE]))  # fails, so this fork ends, if the job is gone
    # A cold `python script.py` has the script's folder on its path, not this server's (tests/).
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
    # Each process draws its own seeds, as an interpreter does (Python's random reseeds itself
    # after a fork; torch's and NumPy's generators would otherwise be the server's on every rank).
    _reseed()
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    if "OMP_NUM_THREADS" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    send_message(conn, {"pid": os.getpid()})
    _watch_caller(conn, request["kind"] == "job")
    code = _run_python(request["argv"], request["cwd"])
    sys.stdout.flush()
    sys.stderr.flush()
    send_message(conn, {"exit": code})
    os._exit(code)


def serve(path: str) -> None:
    """Preload, listen on ``path``, tell the client (one line on stdout), fork per request."""
    _preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the forks
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        try:
            request, fds = recv_request(conn)
        except (ConnectionError, OSError, ValueError) as err:
            print(f"warm server: a request was dropped: {err}", file=sys.stderr, flush=True)
            conn.close()
            continue
        if os.fork() == 0:
            listener.close()
            try:
                _serve_one(conn, request, fds)
            finally:
                os._exit(70)
        conn.close()
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    serve(sys.argv[1])
