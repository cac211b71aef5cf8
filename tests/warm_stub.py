"""The interpreter a launcher starts for each worker under the warm launcher (``PYTHON_EXEC``).

torch.distributed.run starts every worker as ``$PYTHON_EXEC -u script args...``. This stub,
run by ``python -S`` (the standard library only, about 20 ms), asks the warm server
(:mod:`warm_server`, socket in ``HF_RING_WARM_SOCKET``) to fork the worker with its own
arguments, environment, working directory and standard streams, then stands in for it: the
launcher's signals are passed on, and its exit status is this process's. If the server's
fork dies without a status (killed), the stub exits with 128 + 9, as a shell reports it.

Imports the standard library and :mod:`warm_protocol` only.
"""

import os
import signal
import socket
import sys

from warm_protocol import read_message, send_request


def main() -> int:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ["HF_RING_WARM_SOCKET"])
    request = {"kind": "worker", "argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}
    send_request(conn, request, [0, 1, 2])
    started = read_message(conn)
    if started is None:
        print("warm stub: the warm server did not start the worker (see its log)", file=sys.stderr)
        return 1
    worker = started["pid"]

    def pass_on(signum, _frame):
        try:
            os.kill(worker, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, pass_on)
    ended = read_message(conn)
    return 128 + signal.SIGKILL if ended is None else int(ended["exit"])


if __name__ == "__main__":
    sys.exit(main())
