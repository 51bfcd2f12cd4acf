"""Forwarding a request to engine nodes, with failover before the first token.

`dispatch` walks the router's ranked nodes: on a connection error, a 503, a node that
cannot serve the model, or a stream that breaks before its first token, it tries the next
one. Once a token has come back the request belongs to that node: a later failure becomes
an error event for the client (app/api.py) and the stream ends cleanly. A node's 400 (bad
input, prompt over the context) is the client's error and is passed back as is.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Iterator

import requests
from requests.adapters import HTTPAdapter

from app.errors import APIError
from app.inference import InferenceRequest
from app.router import NodePool

log = logging.getLogger("zen.gateway")


class NodeStreamError(Exception):
    """The node's stream failed (broken connection or an error event)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class NodeResult:
    """A finished non-streaming generation from one node."""

    node: str
    body: dict
    attempts: int


@dataclass
class NodeStream:
    """An open stream from one node, positioned after its first event."""

    node: str
    response: requests.Response
    first_events: list[dict]
    attempts: int
    _lines: Iterator[bytes] | None = field(default=None, repr=False)

    def events(self) -> Iterator[dict]:
        """Every event: those already read, then the rest as they arrive.

        Raises NodeStreamError when the connection breaks or the node sends an error event.
        """
        yield from self.first_events
        if self.first_events and self.first_events[-1].get("type") == "done":
            return
        yield from _read_events(self._lines, self.node)

    def close(self) -> None:
        """Close the upstream connection; the node aborts the sequence."""
        try:
            self.response.close()
        except Exception:
            pass


def _read_events(lines: Iterator[bytes], node: str) -> Iterator[dict]:
    try:
        for raw in lines:
            if not raw or not raw.startswith(b"data:"):
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
                raise NodeStreamError(str(err.get("message") or "engine error"), err.get("code"))
            yield event
            if event.get("type") == "done":
                return
    except requests.RequestException as exc:
        raise NodeStreamError(f"connection to the engine node broke: {exc.__class__.__name__}") from None
    raise NodeStreamError("the engine node closed the stream before it finished")


def _node_error(resp: requests.Response) -> dict:
    try:
        body = resp.json()
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            return err
    except ValueError:
        pass
    return {"message": f"engine node answered {resp.status_code}"}


class NodeClient:
    """HTTP to engine nodes: one pooled session per worker process."""

    def __init__(self, pool: NodePool, pool_size: int = 32) -> None:
        self.pool = pool
        self.config = pool.config
        self.session = requests.Session()
        adapter = HTTPAdapter(pool_connections=max(4, len(self.config.urls)),
                              pool_maxsize=pool_size, max_retries=0)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def close(self) -> None:
        self.session.close()

    def dispatch(self, req: InferenceRequest) -> NodeResult | NodeStream:
        """Run `req` on the best node that takes it; APIError when none does."""
        ranked = self.pool.rank(req.model, req.inputs.estimated_tokens(), req.params.max_tokens)
        if not ranked:
            raise APIError(503, "No engine node is available to serve this request; retry shortly.",
                           code="no_node_available", headers={"Retry-After": "1"})
        payload = req.to_node_payload()
        headers = {"X-Node-Secret": self.config.secret, "X-Request-Id": req.request_id,
                   "Accept": "text/event-stream" if req.stream else "application/json"}
        timeout = (self.config.connect_timeout_s, self.config.read_timeout_s)
        retry_after = 1
        last = "no node answered"
        attempts = 0
        for score in ranked[: self.config.max_attempts]:
            url = score.url
            attempts += 1
            try:
                resp = self.session.post(url + "/v1/generate", json=payload, headers=headers,
                                         stream=req.stream, timeout=timeout)
            except requests.RequestException as exc:
                last = f"{url}: {exc.__class__.__name__}"
                self.pool.mark_down(url, last)
                self._failover(req, url, "connect_error")
                continue
            status = resp.status_code
            if status == 200:
                try:
                    if not req.stream:
                        body = resp.json()
                        if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
                            raise ValueError("unexpected body")
                        return NodeResult(url, body, attempts)
                    lines = resp.iter_lines(chunk_size=None)
                    first = []
                    for event in _read_events(lines, url):
                        first.append(event)
                        if event.get("type") in ("token", "done"):
                            break
                    return NodeStream(url, resp, first, attempts, lines)
                except (requests.RequestException, ValueError, NodeStreamError) as exc:
                    resp.close()
                    last = f"{url}: {exc}"
                    self._failover(req, url, "broken_before_first_token")
                    continue
            err = _node_error(resp)
            resp.close()
            if status == 503:
                try:
                    retry_after = max(retry_after, int(float(resp.headers.get("Retry-After", 1))))
                except ValueError:
                    pass
                last = f"{url}: busy ({err.get('message')})"
                self._failover(req, url, "busy")
                continue
            if status == 404 or status >= 500:
                last = f"{url}: {status} {err.get('message')}"
                self._failover(req, url, f"http_{status}")
                continue
            if status == 401:
                log.error("engine node refused the node secret", extra={
                    "event": "node_auth_failed", "node": url, "request_id": req.request_id})
                last = f"{url}: refused the gateway's credentials"
                self._failover(req, url, "auth")
                continue
            # The node says the request itself is bad: the client's error.
            raise APIError(status if 400 <= status < 500 else 400,
                           str(err.get("message") or "invalid request"),
                           param=err.get("param"), code=err.get("code"))
        raise APIError(503, f"No engine node could serve this request ({last}); retry shortly.",
                       code="no_node_available", headers={"Retry-After": str(retry_after)})

    def _failover(self, req: InferenceRequest, url: str, reason: str) -> None:
        log.warning("node attempt failed; trying the next node", extra={
            "event": "failover", "node": url, "reason": reason, "request_id": req.request_id,
            "org": req.org})
        on_failover = getattr(self, "on_failover", None)
        if on_failover is not None:
            on_failover(url, reason)
