"""How a WSGI handler tells that its client went away (gateway and node, under gunicorn or werkzeug)."""
from __future__ import annotations

import select
import socket


class ClientGone(Exception):
    """The client of a request closed its connection; the work done for it is abandoned."""


def client_gone(sock) -> bool:
    """Whether the client's socket (gunicorn's, of a WSGI request) has reached EOF. The client sends
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
