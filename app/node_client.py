"""Forwarding a request to engine nodes, with failover before the first token.

`send` writes the request to the router's best node and `NodeStream.accept` reads its answer,
walking the ranked nodes until one accepts the request (HTTP 200: the node has queued it): on a
connection error, a 503, a 429 `org_queue_full` (the org holds its share of that node's queue), a node
that cannot serve the model or refuses the gateway's credentials, it tries the next one; when every node
it tried refused it for the org's share, the client gets that 429. A node's 400 (bad input, prompt over
the context) is the client's error and is passed back as is. The accepted stream (`NodeStream`) still fails over
while no token has come: a node that breaks or answers an error event before its first token hands
the request to the next node, unseen by the client. Once a token has come the request belongs to
that node: a later failure becomes an error event for the client (app/api.py).
"""
from __future__ import annotations

import http.client
import json
import logging
import select
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator
from urllib.parse import urlsplit

from app.catalog import ResolvedModel
from app.errors import model_not_found
from app.inference import InferenceRequest
from app.node_faults import NodeFaults
from app.router import TRANSPORT_ERRORS, NodePool
from app.tracing import end_node_span, start_node_span, traced_rank
from engine.client_socket import ClientGone
from engine.protocol import (ORG_QUEUE_FULL, PROMPT_TOKENS_HEADER, REQUEST_ID_HEADER, SECRET_HEADER, STATE_FIELD,
                             STATE_HEADER, APIError, NodeState)

if TYPE_CHECKING:
    from engine.tracing import Tracing

log = logging.getLogger("zen.gateway")

CLIENT_CHECK_S = 0.2   # how often a request that collects a JSON answer checks that its client is still there


class NodeStreamError(Exception):
    """The node's stream failed (broken connection or an error event); `refused`: the node's error event
    says the request itself is at fault (invalid_request_error), which another node would refuse too."""

    def __init__(self, message: str, code: str | None = None, refused: bool = False,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.refused = refused
        self.param = param   # of a refusal: the request's field at fault, as the node names it


class NodeStream:
    """The request's stream from the node that accepted it; before its first token, from the next
    node when that one fails. `node` and `attempts` say where it is now."""

    def __init__(self, client: "NodeClient", req: InferenceRequest, candidates: list[str],
                 needs_load: frozenset[str] = frozenset()) -> None:
        self._client = client
        self._req = req
        self._candidates = iter(candidates[: client.config.max_attempts])
        self._needs_load = needs_load     # the candidates that do not hold the model: their answer settles a load
        self._body = json.dumps(req.generate_request(stream=True).to_json()).encode()
        self._headers = {SECRET_HEADER: client.config.secret, REQUEST_ID_HEADER: req.node_request_id,
                         "Accept": "text/event-stream", "Content-Type": "application/json"}
        # the node_request span while tracing is on: its traceparent goes to every node tried
        self.span = None if client.tracing is None else start_node_span(client.tracing, req, self._headers)
        self._retry_after = 1
        self._org_queue_full = 0          # nodes that refused it for the org's share of their queue
        self._last = "no node answered"   # why the last node did not: for the client, so no node address
        self.node = ""
        self.attempts = 0
        self.response: http.client.HTTPResponse | None = None
        self._conn: http.client.HTTPConnection | None = None
        self._lines: Iterator[bytes] | None = None
        self.started = False     # a token (or the done event) was read: no failover from here on
        self.tokens_read = 0     # token events read: what a request cut short has cost
        self.prompt_tokens: int | None = None   # the prompt's tokens, as the node that took it counted them
        self.finished = False    # the node's "done" event was read
        self.abandoned = False   # no one reads it any more (a closed PromptBatch): no failover
        self._closing = False
        self._lock = threading.Lock()   # abandon() (another thread) against close(): no shutdown once given back
        self._faulted: list[str] = []   # nodes that failed it (a 5xx, broken before its first token)
        self._pending: tuple[str, http.client.HTTPConnection, bool] | None = None   # sent, answer not read

    def open_next(self) -> None:
        """Send the request to the next candidate until one accepts it; APIError when none does."""
        self.send()
        self.accept()

    def send(self) -> None:
        """Write the request to the next candidate that takes it; APIError when none is left. `accept`
        reads the node's answer: what runs in between overlaps the node's reading of the request."""
        while True:
            url = next(self._candidates, None)
            if url is None:
                if self._org_queue_full and self._org_queue_full == self.attempts:   # each node said so
                    raise APIError(429, "Too many of this organization's requests are waiting on the engine "
                                        "nodes; retry after some finish.", code=ORG_QUEUE_FULL,
                                   headers={"Retry-After": str(self._retry_after)})
                raise APIError(503, f"No engine node could serve this request ({self._last}); retry "
                                    f"shortly.", code="no_node_available",
                               headers={"Retry-After": str(self._retry_after)})
            self.attempts += 1
            try:
                self._pending = (url, *self._client.send_request(url, self._body, self._headers))
            except TRANSPORT_ERRORS as exc:
                self._unreachable(url, exc)
                continue
            return

    def accept(self) -> None:
        """Wait for the answer to `send`; a node that refuses the request, or cannot be reached, hands it
        to the next candidate (`send` again), until one accepts it; APIError when none does."""
        try:
            self._accept()
        except BaseException as exc:
            self.end_span(exc)
            raise

    def _accept(self) -> None:
        while True:
            url, conn, kept_alive = self._pending
            self._pending = None
            try:
                conn, resp = self._client.read_answer(url, conn, kept_alive, self._body, self._headers)
            except TRANSPORT_ERRORS as exc:
                self._unreachable(url, exc)
                self.send()
                continue
            if url in self._needs_load or resp.status != 200:
                # the node's state now: what a load changed, or why it refused (a stream that starts on a
                # node holding the model reports its state in its last event, read once there)
                state = self._client.observe(url, resp.headers.get(STATE_HEADER))
                if url in self._needs_load:
                    self._client.pool.load_result(self._req.model.key, url, state, served=resp.status == 200)
            if resp.status == 200:
                self.prompt_tokens = _count(resp.headers.get(PROMPT_TOKENS_HEADER))
                with self._lock:
                    self.node, self.response, self._conn, self._lines = url, resp, conn, _lines(resp)
                    if self.abandoned:   # while it failed over: its first read ends at once
                        _shut_down(conn)
                return
            self._refused(url, conn, resp)
            self.send()

    def _unreachable(self, url: str, exc: BaseException) -> None:
        self._last = "a node could not be reached"
        self._client.pool.mark_down(url, f"{url}: {exc.__class__.__name__}")
        if url in self._needs_load:
            self._client.pool.load_result(self._req.model.key, url, None)
        self._failover(url, "connect_error")

    def _refused(self, url: str, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        """A node's answer other than 200: note it and go on, or raise the client's own error."""
        status = resp.status
        err = _node_error(resp)
        self._client.release(url, conn, resp)
        org_queue_full = status == 429 and err.get("code") == ORG_QUEUE_FULL
        if status == 503 or org_queue_full:   # another node may have room
            try:
                self._retry_after = max(self._retry_after, int(float(resp.headers.get("Retry-After", 1))))
            except ValueError:
                pass
            self._last = f"busy ({err.get('message')})"
            self._org_queue_full += org_queue_full
            self._failover(url, ORG_QUEUE_FULL if org_queue_full else "busy")
        elif status == 404 or status >= 500:
            self._last = f"{status} {err.get('message')}"
            if status >= 500:
                self._faulted.append(url)
            self._failover(url, f"http_{status}")
        elif status == 401:
            log.error("engine node refused the node secret", extra={
                "event": "node_auth_failed", "node": url, "request_id": self._req.request_id})
            self._last = "a node refused the gateway's credentials"
            self._failover(url, "auth")
        else:   # the node says the request itself is bad: the client's error
            raise APIError(status if 400 <= status < 500 else 400,
                           str(err.get("message") or "invalid request"),
                           param=err.get("param"), code=err.get("code"))

    def _failover(self, url: str, reason: str) -> None:
        if self.span is not None:
            self.span.add_event("failover", {"zen.node": url, "zen.failover_reason": reason,
                                             "zen.attempt": self.attempts})
        log.warning("node attempt failed; trying the next node", extra={
            "event": "failover", "node": url, "reason": reason, "request_id": self._req.request_id,
            "org": self._req.org})
        if self._client.on_failover is not None:
            self._client.on_failover(url, reason)

    def events(self) -> Iterator[dict]:
        """Every event as it arrives, PING included (the node's heartbeat while it has no token).

        Before the first token a broken stream moves to the next node (APIError when none is left or
        the next one refuses the request); after it, a broken stream or an error event raises
        NodeStreamError.
        """
        while True:
            try:
                for event in _read_events(self._lines, self.node):
                    if event is not PING and event.get("type") in ("token", "done"):
                        if not self.started:
                            self._client.faults.served(self.node, self._faulted)
                        self.started = True
                        self.tokens_read += event["type"] == "token"
                        self.finished = event["type"] == "done"
                        if self.finished and STATE_FIELD in event:
                            self._client.observe(self.node, event[STATE_FIELD])
                    yield event
                return
            except NodeStreamError as exc:
                if self.abandoned:   # its client left: no failover, and no fault of the node's
                    self.end_span()
                    raise
                if self.started or exc.refused:   # no failover: the tokens are out, or the request is bad
                    self.end_span(exc)
                    raise
                self._client.release(self.node, self._conn, self.response, reuse=False)
                self.response = self._conn = None
                self._last = "a stream broke before its first token"
                self._faulted.append(self.node)
                self._failover(self.node, "broken_before_first_token")
                try:
                    self.open_next()
                except BaseException as exc:   # no node left to take it: the span says so
                    self.end_span(exc)
                    raise

    def abandon(self) -> None:
        """From a thread other than the one reading it: no failover from here on, and a read in progress
        ends at once (the socket shut down; the reader then closes the stream, and the node aborts it)."""
        with self._lock:
            self.abandoned = True
            if not self._closing and self._conn is not None:
                _shut_down(self._conn)

    def close(self) -> None:
        """Close the upstream stream. A finished one is read to its end first (a few bytes: the
        [DONE] line and the end of the chunked body), which gives its connection back to the pool
        for the next request; one closed early drops the connection, and the node aborts the sequence."""
        with self._lock:
            self._closing = True
        self.end_span()
        if self._pending is not None:   # sent, its answer never read: the node aborts it
            url, conn, _ = self._pending
            self._pending = None
            conn.close()
        if self.response is None:
            return
        try:
            if self.finished and self._lines is not None and self._conn.sock is not None:
                self._conn.sock.settimeout(_TRAILER_TIMEOUT_S)   # reset when the connection is reused
                for _ in zip(range(_TRAILER_LINES), self._lines):
                    pass   # the body's end makes the connection reusable
        except Exception:
            pass   # not drained: closed below rather than reused
        self._client.release(self.node, self._conn, self.response)
        self.response = None

    def end_span(self, error: BaseException | None = None) -> None:
        """End the node_request span (once), with the node that has the request and the nodes tried."""
        span, self.span = self.span, None
        if span is not None:
            end_node_span(span, self.node, self.attempts, error)


def _shut_down(conn: http.client.HTTPConnection) -> None:
    """End the connection's reads and writes in whichever thread waits on them (closing alone would not)."""
    if conn.sock is not None:
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


# What may follow the done event: blank lines and [DONE], at once. A node that sends more, or
# stalls, loses the connection instead of holding up the request's bookkeeping.
_TRAILER_LINES = 8
_TRAILER_TIMEOUT_S = 0.5


PING = {"type": "ping"}


def _lines(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    """The body's lines as they arrive (the node sends each event as one chunk: read1 returns it)."""
    pending = b""
    while chunk := resp.read1(65536):
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            yield line.rstrip(b"\r")
    resp.read()   # a body with a Content-Length is marked read only so (chunked ones already are)
    if pending:
        yield pending


def _read_events(lines: Iterator[bytes], node: str) -> Iterator[dict]:
    """The node's events; its SSE comments (heartbeats while a request waits) come as PING."""
    try:
        for raw in lines:
            if raw.startswith(b":"):
                yield PING
                continue
            if not raw.startswith(b"data:"):
                continue
            data = raw[5:].strip()
            if data == b"[DONE]":
                return
            try:
                event = json.loads(data)
            except ValueError:
                raise NodeStreamError(f"node {node} sent an unreadable event") from None
            if not isinstance(event, dict):
                continue
            if event.get("type") == "error":
                err = event.get("error") if isinstance(event.get("error"), dict) else {}
                param = err.get("param")
                raise NodeStreamError(str(err.get("message") or "engine error"), err.get("code"),
                                      refused=err.get("type") == "invalid_request_error",
                                      param=param if isinstance(param, str) else None)
            yield event
            if event.get("type") == "done":
                return
    except TRANSPORT_ERRORS as exc:
        raise NodeStreamError(f"connection to the engine node broke: {exc.__class__.__name__}") from None
    raise NodeStreamError("the engine node closed the stream before it finished")


def _count(value: str | None) -> int | None:
    """A node header's count; None where it is missing or no count."""
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


def _node_error(resp: http.client.HTTPResponse) -> dict:
    try:
        body = json.loads(resp.read(65536))
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            return err
    except (ValueError, *TRANSPORT_ERRORS):
        pass
    return {"message": f"engine node answered {resp.status}"}


class _NamedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to a node's address, its certificate checked against `server_name` (for a node found by
    DNS, the name it was found under, not the address)."""

    def __init__(self, host: str, port: int | None, server_name: str, tls: ssl.SSLContext,
                 timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=tls)
        self.server_name, self.tls = server_name, tls

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self.tls.wrap_socket(self.sock, server_hostname=self.server_name)


class NodeConnections:
    """Kept-alive HTTP connections to one node, the most recently used first.

    http.client itself, not urllib3's pool: this is the gateway's hot path, and urllib3's layers cost
    it CPU time. What urllib3 added that the gateway needs is here: reuse, timeouts, and a connection
    the node closed while it was idle is not used again.
    """

    def __init__(self, url: str, size: int, connect_timeout_s: float, read_timeout_s: float,
                 server_name: str | None = None) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.server_name = server_name or self.host   # what the node's TLS certificate must name
        self.base = parts.path
        self.path = self.base + "/v1/generate"
        self._tls = ssl.create_default_context() if parts.scheme == "https" else None
        self.size = size
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self._idle: list[http.client.HTTPConnection] = []
        self._closed = False
        self._lock = threading.Lock()

    def take(self) -> tuple[http.client.HTTPConnection, bool]:
        """(a connection, whether it was kept alive from an earlier request)."""
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self.connect(), False
            if _still_open(conn.sock):
                conn.sock.settimeout(self.read_timeout_s)
                return conn, True
            conn.close()

    def connect(self) -> http.client.HTTPConnection:
        """A new connection: connect_timeout_s to open it, read_timeout_s for each read after."""
        if self._tls is not None:
            conn = _NamedHTTPSConnection(self.host, self.port, self.server_name, self._tls,
                                         self.connect_timeout_s)
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout_s)
        conn.connect()
        conn.sock.settimeout(self.read_timeout_s)
        return conn

    def give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.size:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections, and those of requests still running as they end."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _still_open(sock: socket.socket | None) -> bool:
    """An idle kept-alive connection has nothing to read: anything readable (most often the end of
    the stream, the node having closed it) means it cannot carry another request."""
    if sock is None:
        return False
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return not poller.poll(0)


class NodeClient:
    """HTTP to engine nodes: in each worker process, kept-alive connections to each node."""

    def __init__(self, pool: NodePool, pool_size: int = 32) -> None:
        self.pool = pool
        self.config = pool.config
        self._pool_size = pool_size
        self._connections = {url: self._new_connections(url) for url in pool.discovery.known()}
        self._connections_lock = threading.Lock()
        self.on_failover: Callable[[str, str], None] | None = None   # (node, reason): the gateway's metric
        self.faults = NodeFaults()
        pool.on_dropped += [self._forget, self.faults.forget]
        self.tracing: Tracing | None = None   # set by create_app when tracing is on

    def post_generate(self, url: str, body: bytes, headers: dict,
                      path: str | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """POST {url}/v1/generate (or {url}{path}): (the connection, its response with the body left
        unread). Hand both back with `release`."""
        conn, kept_alive = self.send_request(url, body, headers, path)
        return self.read_answer(url, conn, kept_alive, body, headers, path)

    def send_request(self, url: str, body: bytes, headers: dict,
                     path: str | None = None) -> tuple[http.client.HTTPConnection, bool]:
        """Write the POST on a connection to the node: (the connection, whether it was kept alive from
        an earlier request); `read_answer` reads the answer."""
        conn, kept_alive = self._connections_of(url).take()
        try:
            conn.request("POST", self._target(url, path), body=body, headers=headers)
            return conn, kept_alive
        except BaseException as exc:
            conn.close()
            if not _closed_while_idle(kept_alive, exc):
                raise
        return self._send_fresh(url, body, headers, path), False

    def read_answer(self, url: str, conn: http.client.HTTPConnection, kept_alive: bool, body: bytes,
                    headers: dict, path: str | None = None
                    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """The node's answer to what send_request wrote: (the connection, a fresh one if it had to be
        sent again; the response with its body left unread)."""
        try:
            return conn, conn.getresponse()
        except BaseException as exc:
            conn.close()
            if not _closed_while_idle(kept_alive, exc):
                raise
        conn = self._send_fresh(url, body, headers, path)
        try:
            return conn, conn.getresponse()
        except BaseException:
            conn.close()
            raise

    def _send_fresh(self, url: str, body: bytes, headers: dict, path: str | None) -> http.client.HTTPConnection:
        """The request again on a new connection: the node closed the kept-alive one (its idle timeout)
        just as it was reused, so the request never reached it; the node is up and must not be marked
        down for it. A fresh connection tells that from a node that is down (it is refused). Should the
        node have read the first copy after all, the second meets its request id and is answered 409
        duplicate_request_id: an error, never a second run."""
        conn = self._connections_of(url).connect()
        try:
            conn.request("POST", self._target(url, path), body=body, headers=headers)
        except BaseException:
            conn.close()
            raise
        return conn

    def _target(self, url: str, path: str | None) -> str:
        connections = self._connections_of(url)
        return connections.path if path is None else connections.base + path

    def observe(self, url: str, brief: str | dict | None) -> NodeState | None:
        """The node's state from the brief its answer carried (a header's text, or the dict of a stream's
        last event), given to the router at once; None without one (or with a bad one)."""
        if brief is None:
            return None
        base = self.pool.state_of(url)
        try:
            state = (NodeState.from_header(brief, base) if isinstance(brief, str)
                     else NodeState.from_brief(brief, base))
        except ValueError:
            log.warning("a node sent a state brief the gateway cannot read", extra={
                "event": "bad_state_brief", "node": url})
            return None
        self.pool.observe(url, state)
        return state

    def release(self, url: str, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse,
                reuse: bool = True) -> None:
        """Done with a request: its connection goes back for reuse when its response was read to the
        end, and is closed otherwise (the node then aborts what it was doing for it)."""
        connections = self._connections.get(url)     # None: a node discovery dropped meanwhile
        if reuse and connections is not None and resp.isclosed() and not resp.will_close:
            resp.close()
            connections.give_back(conn)
            return
        try:
            resp.close()
        finally:
            conn.close()

    def close(self) -> None:
        for connections in list(self._connections.values()):
            connections.close()

    def _new_connections(self, url: str) -> NodeConnections:
        return NodeConnections(url, self._pool_size, self.config.connect_timeout_s, self.config.read_timeout_s,
                               self.pool.discovery.server_name(url))

    def _connections_of(self, url: str) -> NodeConnections:
        """The node's connections; a node found by discovery gets them on its first request. A node
        discovery dropped while this request ranked it gets one-off connections, so nothing is kept
        for it (release closes a connection its node has no entry for)."""
        connections = self._connections.get(url)
        if connections is not None:
            return connections
        with self._connections_lock:
            if url not in self.pool.discovery.known():
                return self._new_connections(url)
            return self._connections.setdefault(url, self._new_connections(url))

    def _forget(self, url: str) -> None:
        """Discovery dropped the node: its idle connections close now, its streams go on."""
        with self._connections_lock:
            connections = self._connections.pop(url, None)
        if connections is not None:
            connections.close()

    def send(self, req: InferenceRequest) -> NodeStream:
        """`req` written to the best node that takes it; APIError when none does. `NodeStream.accept`
        reads the node's answer (failing over to the next node when that one refuses): what the caller
        does in between overlaps the node's reading of the request.

        The node always streams: a JSON answer is collected from the stream (collect_result), so the
        gateway can watch its client the whole time and close the node's stream — which aborts the
        sequence — when nobody is left to read it."""
        def rank() -> list:   # the nodes passed over for their faults are left out before the ranking's
            # claims, prefix records and sent counts, which go to the first node tried
            return self.pool.rank(req.model, req.inputs.estimated_tokens, req.params.max_tokens,
                                  req.latency_class, req.inputs, keep=self.faults.usable)
        ranked = rank() if self.tracing is None else traced_rank(self.tracing, rank, req)
        if not ranked:
            if self.pool.lists_nowhere(req.model.model):
                raise model_not_found(req.model.alias)
            raise APIError(503, "No engine node is available to serve this request; retry shortly.",
                           code="no_node_available", headers={"Retry-After": "1"})
        stream = NodeStream(self, req, [score.url for score in ranked],
                            frozenset(score.url for score in ranked if score.needs_load))
        try:
            stream.send()
        except BaseException as exc:
            stream.end_span(exc)
            raise
        return stream


def call_node(client: NodeClient, model: ResolvedModel, path: str, payload: dict, request_id: str) -> dict:
    """POST a small JSON request (/tokenize, /detokenize) to the best node for `model`, failing over as
    send and accept do; the node's JSON answer, or APIError (the node's 4xx as is, 503 when none answers).
    The node loads the model for it, so a load the ranking claimed is settled by the answer as a
    generation's is."""
    ranked = client.pool.rank(model, 1, 1, keep=client.faults.usable, generation=False)
    if not ranked and client.pool.lists_nowhere(model.model):
        raise model_not_found(model.alias)
    body = json.dumps(payload).encode()
    headers = {SECRET_HEADER: client.config.secret, REQUEST_ID_HEADER: request_id,
               "Content-Type": "application/json"}
    last = "no node is available"
    for score in ranked[: client.config.max_attempts]:
        url = score.url
        try:
            conn, resp = client.post_generate(url, body, headers, path=path)
            status, data = resp.status, resp.read()
        except TRANSPORT_ERRORS as exc:
            last = f"{url}: {exc.__class__.__name__}"
            client.pool.mark_down(url, last)
            if score.needs_load:
                client.pool.load_result(model.key, url, None)
            continue
        state = client.observe(url, resp.headers.get(STATE_HEADER))
        if score.needs_load:
            client.pool.load_result(model.key, url, state, served=status == 200)
        client.release(url, conn, resp)
        try:
            answer = json.loads(data)
        except ValueError:
            answer = {}
        if status == 200 and isinstance(answer, dict):
            return answer
        err = answer.get("error") if isinstance(answer, dict) and isinstance(answer.get("error"), dict) else {}
        if status in (401, 404, 503) or status >= 500:
            last = f"{url}: {status} {err.get('message')}"
            continue
        raise APIError(status if 400 <= status < 500 else 502, str(err.get("message") or "invalid request"),
                       param=err.get("param"), code=err.get("code"))
    raise APIError(503, f"No engine node could serve this request ({last}); retry shortly.",
                   code="no_node_available", headers={"Retry-After": "1"})


def _closed_while_idle(kept_alive: bool, exc: BaseException) -> bool:
    """A kept-alive connection the node had closed (its idle timeout): send again on a fresh one."""
    return kept_alive and isinstance(exc, (ConnectionResetError, BrokenPipeError))


def collect_result(stream: NodeStream, client_gone: Callable[[], bool]) -> dict:
    """A node stream gathered into the node's JSON answer: {"choices": [{"index", "text", "token_ids",
    "finish_reason", "logprobs"}], "usage", "timings", "first_token_at"}. ClientGone (upstream closed) when the client
    leaves; NodeStreamError when the node fails."""
    choices: dict[int, dict] = {}
    done: dict = {}
    first_token_at = None   # perf_counter, as the gateway times its requests: its own time to first token
    checked = time.monotonic()
    try:
        for event in stream.events():
            now = time.monotonic()
            if event is PING or now - checked >= CLIENT_CHECK_S:
                checked = now
                if client_gone():
                    raise ClientGone()
            kind = event.get("type")
            if kind == "token":
                first_token_at = first_token_at or time.perf_counter()
                c = choices.setdefault(int(event.get("index", 0)), {"text": [], "token_ids": [], "logprobs": None})
                if event.get("token_id") is not None:
                    c["token_ids"].append(event["token_id"])
                c["text"].append(event.get("text") or "")
                if event.get("logprobs") is not None:
                    c["logprobs"] = c["logprobs"] or []
                    c["logprobs"].append(event["logprobs"])
            elif kind == "done":
                done = event
    finally:
        stream.close()
    return {
        "choices": [{"index": d["index"], "finish_reason": d.get("finish_reason"),
                     "text": "".join(choices.get(d["index"], {}).get("text", [])),
                     "token_ids": choices.get(d["index"], {}).get("token_ids", []),
                     "logprobs": choices.get(d["index"], {}).get("logprobs")}
                    for d in done.get("choices", [])],
        "usage": done.get("usage") or {}, "timings": done.get("timings") or {},
        "first_token_at": first_token_at,
    }
