"""gunicorn's gthread worker, reading each HTTP/1 request whole in its event loop before a thread takes it.

The stock worker hands a connection to a thread as soon as its first bytes arrive, and the thread then
reads the request's head and body with blocking reads: a client sending a byte every few seconds holds
the thread for as long as it likes, and as many such clients as the worker has threads take a gateway
(or a node) down for everyone. Here the event loop reads a request into memory, without blocking,
until its head and its body (Content-Length or chunked) are complete, and only then gives it to a
thread, whose parser finds the bytes already there. A request not complete within
REQUEST_READ_TIMEOUT_S is answered 408 and closed; slow clients cost a socket and a buffer, not a
thread, and gunicorn's worker_connections bounds how many a worker holds.

Bodies above MAX_BUFFERED_BODY_BYTES, heads above MAX_HEAD_BYTES and what does not parse go to a thread
as they are (the application's size limit or gunicorn's parser answers them), as do TLS and HTTP/2
connections, which gunicorn reads itself. What gunicorn answers itself (a bad request line, headers too
large, ...) is in OpenAI's error shape, as every other error of the gateway and the node, not HTML.
"""
from __future__ import annotations

import json
import selectors
import time
from functools import partial

from gunicorn import util
from gunicorn.http2 import negotiation
from gunicorn.workers.gthread import STOP_KEEPALIVE_LINGER, ThreadWorker

from engine.protocol import error_body

REQUEST_READ_TIMEOUT_S = 30.0
MAX_HEAD_BYTES = 64 << 10
MAX_BUFFERED_BODY_BYTES = 16 << 20
RECV_BYTES = 64 << 10
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _chunked_body_complete(buf: bytes, start: int) -> bool:
    """Whether the chunked body from `start` ends in buf (its last chunk, trailers, empty line), or is
    malformed or past MAX_BUFFERED_BODY_BYTES (then the parser or the application answers it)."""
    p = start
    while True:
        eol = buf.find(b"\r\n", p)
        if eol < 0:
            return len(buf) - start > MAX_BUFFERED_BODY_BYTES
        try:
            size = int(buf[p:eol].split(b";", 1)[0].strip(), 16)
        except ValueError:
            return True
        if size == 0:   # trailer fields, each ending a line, then an empty line
            q = eol + 2
            while (e := buf.find(b"\r\n", q)) > q:
                q = e + 2
            return e == q
        p = eol + 2 + size + 2
        if p - start > MAX_BUFFERED_BODY_BYTES:
            return True
        if p > len(buf):
            return False


def request_complete(buf: bytes) -> tuple[bool, bool]:
    """(whether a thread can take the request at the start of buf now, whether its head asks for
    100-continue). Complete: the head and the whole body are in buf, or the request goes to a thread as
    it is (too large, malformed)."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return len(buf) > MAX_HEAD_BYTES, False
    length, chunked, expect = None, False, False
    for line in buf[:end].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            if length is not None:   # two lengths: the parser refuses the request, at once
                return True, expect
            length = value
        elif name == b"transfer-encoding":
            chunked = value.endswith(b"chunked")
        elif name == b"expect":
            expect = value == b"100-continue"
    body = end + 4
    if chunked:
        return _chunked_body_complete(buf, body), expect
    if length is None:
        return True, expect
    if not length.isdigit() or int(length) > MAX_BUFFERED_BODY_BYTES:
        return True, expect
    return len(buf) - body >= int(length), expect


def error_response(status_int: int, reason: str, message: str) -> bytes:
    """A whole HTTP answer that closes the connection, its body in OpenAI's error shape."""
    kind = "invalid_request_error" if status_int < 500 else "server_error"
    body = json.dumps(error_body(message or reason, type=kind, code=reason.lower().replace(" ", "_"))).encode()
    head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body


def write_error(sock, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn's answer to a request it could not read (its util.write_error, in JSON)."""
    util.write_nonblock(sock, error_response(status_int, reason, mesg))


class _Reading:
    __slots__ = ("buf", "deadline", "continued")

    def __init__(self, buf: bytes, deadline: float):
        self.buf = bytearray(buf)
        self.deadline = deadline
        self.continued = False


class SettledConfig:
    """gunicorn's Config as a worker reads it: each setting resolved once, then a plain attribute. Config
    resolves every read through its settings table, and a request reads some forty (its parse, its WSGI
    environ, its response). A worker's settings never change: the master applies new ones by starting new
    workers."""

    def __init__(self, cfg) -> None:
        self._cfg = cfg

    def __getattr__(self, name):
        value = getattr(self._cfg, name)
        self.__dict__[name] = value
        return value


class BufferedThreadWorker(ThreadWorker):
    """ThreadWorker whose connections reach a thread with their whole request read (module docstring)."""

    def init_process(self):
        self.cfg = SettledConfig(self.cfg)
        self._reading: dict = {}   # conn -> _Reading, in the order reading began (so by deadline)
        util.write_error = write_error   # gunicorn's workers answer what they cannot parse through it
        super().init_process()

    def enqueue_req(self, conn):
        """On the event loop: read the connection's next request before a thread takes it."""
        if self.cfg.is_ssl or conn.is_http2 or negotiation.prior_knowledge_allowed(self.cfg, conn.client):
            return super().enqueue_req(conn)
        # a kept-alive connection may hold the start of its next request already (read ahead)
        held = conn.parser.unreader.take_buffered() if conn.parser is not None else b""
        reading = _Reading(held, time.monotonic() + REQUEST_READ_TIMEOUT_S)
        conn.sock.setblocking(False)
        # a kept-alive connection comes here once its next request arrived: often whole, and then it
        # goes to a thread without another turn of the event loop
        if (held and self._ready(conn, reading)) or self._read(conn, reading) is not False:
            return
        self._reading[conn] = reading
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_readable, conn))

    def _on_readable(self, conn, sock):
        if self._read(conn, self._reading[conn]):
            del self._reading[conn]
            self.poller.unregister(sock)

    def _read(self, conn, reading: _Reading) -> bool | None:
        """Read what the socket holds: True once the request went to a thread, False while more is
        needed, None when the client went away first (the connection is closed)."""
        try:
            data = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return None
        reading.buf += data
        return self._ready(conn, reading)

    def _ready(self, conn, reading: _Reading) -> bool:
        """Give the connection to a thread if its request is whole; whether it was."""
        complete, expect = request_complete(reading.buf)
        if expect and not reading.continued and not complete:
            # the client waits for this before it sends the body (gunicorn sends another one later: clients
            # read any number of 1xx answers before the final one)
            reading.continued = True
            try:
                conn.sock.send(_CONTINUE)
            except OSError:
                pass
        if not complete:
            return False
        conn.buffered_request = bytes(reading.buf)
        super().enqueue_req(conn)
        return True

    def handle(self, conn):
        """In a thread: the request read on the event loop goes to the parser before anything else."""
        buffered = getattr(conn, "buffered_request", None)
        if buffered is not None:
            conn.buffered_request = None
            conn.data_ready = True
            conn.sock.setblocking(True)
            conn.init()
            conn.parser.unreader.unread(buffered)
        return super().handle(conn)

    def murder_pending(self):
        """Besides the stock pending connections: requests not whole by their deadline (sooner once the
        worker stops) get a 408 and are closed."""
        super().murder_pending()
        now = time.monotonic()
        stopping = now + STOP_KEEPALIVE_LINGER if not self.alive else None
        for conn, reading in list(self._reading.items()):
            deadline = min(reading.deadline, stopping) if stopping is not None else reading.deadline
            if deadline > now:
                if stopping is None:
                    break
                reading.deadline = deadline   # the worker stops: a request has the linger to arrive
                continue
            if reading.buf:
                try:
                    conn.sock.send(error_response(408, "Request Timeout", f"the request did not arrive whole "
                                                                          f"within {REQUEST_READ_TIMEOUT_S:g} s"))
                except OSError:
                    pass
            self._drop(conn)

    def _drop(self, conn):
        self._reading.pop(conn, None)
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        self.nr_conns -= 1
        conn.close()
