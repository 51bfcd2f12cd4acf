"""Whether the client of a WSGI request (under gunicorn) has gone away: used by the node, and by the
gateway in front of it, to abort work nobody will read."""
from __future__ import annotations

import select
import socket


def client_gone(sock) -> bool:
    """Whether the client's socket has reached EOF (it closed the connection). The client sends
    nothing more while it waits for this response, so a readable socket with no bytes is a close."""
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True
