"""The warm launcher's messages on its Unix socket: ``<4-byte length><JSON>``.

A request (client or stub to server) carries the caller's stdin, stdout and stderr as
SCM_RIGHTS descriptors on its first bytes; the server answers ``{"pid": ...}`` when the
fork is running and ``{"exit": code}`` when it ends. One request per connection.

Standard library only: :mod:`warm_stub` imports it under ``python -S``.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Optional


def _recv_exactly(conn: socket.socket, size: int) -> Optional[bytes]:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def send_request(conn: socket.socket, request: dict, streams: list[int]) -> None:
    """``request`` with the three descriptors ``streams`` (stdin, stdout, stderr)."""
    body = json.dumps(request).encode()
    socket.send_fds(conn, [struct.pack("!I", len(body))], streams)
    conn.sendall(body)


def recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The request and its descriptors; ``ConnectionError`` if the caller closed early."""
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    body = _recv_exactly(conn, struct.unpack("!I", head)[0]) if len(head) == 4 else None
    if body is None or len(fds) != 3:
        raise ConnectionError("the caller closed before its whole request")
    return json.loads(body), list(fds)


def send_message(conn: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    conn.sendall(struct.pack("!I", len(data)) + data)


def read_message(conn: socket.socket) -> Optional[dict]:
    """The next message, or None if the other side closed first."""
    head = _recv_exactly(conn, 4)
    body = None if head is None else _recv_exactly(conn, struct.unpack("!I", head)[0])
    return None if body is None else json.loads(body)
