"""A stand-in engine node for the gateway's tests and benchmarks, and the gateway configuration and
tokens that go with it (tests/test_gateway_support.py adds the pytest fixtures).

`StandInNode` is NOT the engine. It is a small real HTTP server (threads, HTTP/1.1, chunked
transfer like gunicorn) that speaks the engine node protocol of issue 5 (POST /v1/generate
JSON and SSE, GET /state, GET /health, the X-Node-Secret header) and replays a fixed token
sequence, so that the gateway's own behaviour (routing, failover, streaming, limits,
OpenAI formatting) can be tested on its own. Integration tests against real engine nodes
are added once the node service exists.
"""
from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from app.config import load_config
from app.devtoken import mint_token
from engine.protocol import ORG_QUEUE_FULL, PROMPT_TOKENS_HEADER, STATE_FIELD, STATE_HEADER, NodeState
from scripts.local_processes import free_port

NODE_SECRET = "test-node-secret"
JWT_SECRET = "test-jwt-secret-0123456789abcdef-0123456789"
MODEL_ID = "SmolLM2-135M-Instruct"

# The fixed sequence the stand-in node replays: (token id, text).
TOKENS = [(19556, "Hello"), (28, ","), (905, " world"), (17, "!"), (2683, " How"),
          (359, " are"), (346, " you"), (47, "?"), (378, " I"), (5248, " am"),
          (253, " a"), (1345, " small"), (2365, " model"), (30, ".")]
EOS_AFTER = len(TOKENS)


class StandInNode:
    """A stand-in engine node for the gateway's tests (replays TOKENS); not the engine.

    Behaviour knobs, settable while it runs:
      busy: answer 503 (queue full) with Retry-After; org_queue_full: answer 429 (the org's share of the
        queue is full) with Retry-After
      fail_after_tokens: a stream breaks (connection dropped) after this many tokens
      error_after_tokens: a stream sends an error event after this many tokens (its type, code and param:
        error_type, error_code, error_param)
      token_delay_s: pause between streamed tokens; response_delay_s: before answering;
      drop_requests: this many generate requests are read and then answered by closing the
        connection (what a kept-alive connection the node closes as it is reused looks like)
      first_token_delay_s: a stream's pause between its headers and its first token (a prefill),
        with an SSE comment (the node's heartbeat) every 50 ms of it
      trailer_delay_s: pause between the done event and the end of the stream
      close_after_stream: close each connection once its stream ended (as a node's keep-alive
        timeout closes an idle one)
      state: fields merged over the default /state body
    Every generate payload is kept in `received` (and the connection it came on in
    `generate_peers`); streams cut by the client count in `client_disconnects`.
    """

    def __init__(self, secret: str = NODE_SECRET, node_id: str = "standin-0",
                 models: list[tuple[str, str]] | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.secret = secret
        self.tls = tls   # a server context: the node answers HTTPS
        self.node_id = node_id
        self.models = models if models is not None else [(MODEL_ID, "q4_1")]
        self.busy = False
        self.org_queue_full = False
        self.fail_after_tokens: int | None = None
        self.error_after_tokens: int | None = None
        self.error_type, self.error_code, self.error_param = "server_error", "engine_error", None
        self.token_delay_s = 0.0
        self.first_token_delay_s = 0.0
        self.drop_requests = 0
        self.response_delay_s = 0.0
        self.trailer_delay_s = 0.0   # between the done event and the end of the body
        self.close_after_stream = False
        self.cached_tokens = 0       # the prompt tokens it reports found in a prefix cache
        self._brief: str | None = None
        self.state: dict[str, Any] = {}
        self.received: list[dict] = []
        self.client_disconnects = 0
        self.state_polls = 0
        self.generate_peers: set = set()   # (host, port) of each connection a generate request came on
        self.stopped = False
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    # -- protocol ------------------------------------------------------------------------

    @property
    def state(self) -> dict[str, Any]:
        return self._state

    @state.setter
    def state(self, value: dict[str, Any]) -> None:
        self._state, self._brief = value, None

    def state_brief(self) -> str:
        """The state in brief, as a node sends it with every /v1/ answer (made again when `state` is set:
        the stand-in's own work stays off the measured gateway's path in the benchmarks)."""
        if self._brief is None:
            self._brief = json.dumps(NodeState.from_json(self.state_body()).to_brief(), separators=(",", ":"))
        return self._brief

    def state_body(self) -> dict:
        body = {
            "node_id": self.node_id, "healthy": True, "ready": True,
            "models": [{"id": m, "version": "test", "quantization": q, "bytes": 1000,
                        "load_time_s": 0.5, "prefill_tokens_per_s": 1000.0,
                        "decode_tokens_per_s": 50.0, "running": 0, "waiting": 0}
                       for m, q in self.models],
            "available_models": [MODEL_ID],
            "utilization": 0.1,
            "queue": {"waiting": 0, "running": 0, "max_waiting": 64},
            "temperature_c": None, "power_w": None, "kv_cache_usage": 0.0,
            "memory": {"used_bytes": 0, "total_bytes": 1 << 30},
        }
        body.update(self.state)
        return body

    @staticmethod
    def prompt_tokens(payload: dict) -> int:
        if "prompt_token_ids" in payload:
            return len(payload["prompt_token_ids"])
        if "prompt" in payload:
            return max(1, len(payload["prompt"]) // 4)
        return sum(2 + len(m["content"]) // 4 for m in payload["messages"])

    @staticmethod
    def generate_choice(sampling: dict) -> tuple[list[tuple[int, str]], str]:
        """The tokens of one choice and its finish reason."""
        stops = sampling.get("stop") or []
        out: list[tuple[int, str]] = []
        text = ""
        max_tokens = sampling.get("max_tokens") or 16
        i = 0
        while len(out) < max_tokens:
            if i == EOS_AFTER and not sampling.get("ignore_eos"):
                return out, "stop"
            tid, piece = TOKENS[i % len(TOKENS)]
            i += 1
            hit = next((s for s in stops if s in text + piece), None)
            if hit is not None:
                cut = (text + piece).index(hit) - len(text)
                if cut > 0:
                    out.append((tid, piece[:cut]))
                return out, "stop"
            out.append((tid, piece))
            text += piece
        return out, "length"

    @staticmethod
    def logprob_entry(tid: int, piece: str, k: int) -> dict:
        top = [{"token_id": tid, "token": piece, "logprob": -0.25}]
        top += [{"token_id": 100 + j, "token": f"<alt{j}>", "logprob": -2.0 - j} for j in range(k)]
        return {"token_id": tid, "token": piece, "logprob": -0.25, "top": top[:k]}

    # -- server --------------------------------------------------------------------------

    def start(self) -> "StandInNode":
        node = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True   # as gunicorn does for a real node: small chunks go out at once

            def log_message(self, *args):  # keep test output quiet
                pass

            def _json(self, status: int, body: dict, headers: dict | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if (self.path.startswith("/v1/") or self.path in ("/tokenize", "/detokenize")) and status != 401:
                    self.send_header(STATE_HEADER, node.state_brief())
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, message: str, code: str, headers=None) -> None:
                self._json(status, {"error": {"message": message, "type": "invalid_request_error"
                                              if status < 500 else "server_error",
                                              "param": None, "code": code}}, headers)

            def _authorized(self) -> bool:
                if self.headers.get("X-Node-Secret") != node.secret:
                    self._error(401, "missing or wrong node secret", "unauthorized")
                    return False
                return True

            def _gone(self) -> bool:
                """After stop(): drop kept-alive connections without answering (a dead node)."""
                if node.stopped:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                return node.stopped

            def do_GET(self):
                if self._gone():
                    return
                if self.path in ("/health", "/ready"):
                    return self._json(200, {"status": "ok"})
                if not self._authorized():
                    return
                if self.path == "/state":
                    with node._lock:
                        node.state_polls += 1
                    return self._json(200, node.state_body())
                self._error(404, "not found", "not_found")

            def _tokenizer(self, path, payload):
                """A character tokenizer: token id = code point (enough to see the gateway forward)."""
                with node._lock:
                    node.received.append({"path": path, **payload})
                if payload.get("model") != MODEL_ID:
                    return self._error(404, f"unknown model {payload.get('model')}", "model_not_found")
                if path == "/detokenize":
                    return self._json(200, {"prompt": "".join(chr(t) if t < 0x110000 else "?"
                                                              for t in payload["tokens"])})
                text = payload.get("prompt") or "".join(m["content"] for m in payload["messages"])
                return self._json(200, {"count": len(text), "max_model_len": 8192,
                                        "tokens": [ord(c) for c in text], "token_strs": None})

            def do_POST(self):
                if self._gone():
                    return
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if not self._authorized():
                    return
                if self.path in ("/tokenize", "/detokenize"):
                    return self._tokenizer(self.path, json.loads(raw))
                if self.path != "/v1/generate":
                    return self._error(404, "not found", "not_found")
                payload = json.loads(raw)
                with node._lock:
                    node.received.append(payload)
                    node.generate_peers.add(self.client_address)
                    drop = node.drop_requests > 0
                    node.drop_requests -= drop
                if drop:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if node.response_delay_s:
                    time.sleep(node.response_delay_s)
                if node.busy:
                    return self._error(503, "queue full", "queue_full", {"Retry-After": "2"})
                if node.org_queue_full:
                    return self._error(429, "the org's share of the queue is full", ORG_QUEUE_FULL,
                                       {"Retry-After": "3"})
                if payload.get("model") != MODEL_ID:
                    return self._error(404, f"unknown model {payload.get('model')}", "model_not_found")
                if node.prompt_tokens(payload) > 8192:
                    return self._json(400, {"error": {"message": "prompt is longer than the context",
                                                      "type": "invalid_request_error",
                                                      "param": "prompt",
                                                      "code": "context_length_exceeded"}})
                sampling = payload["sampling"]
                room = 8192 - node.prompt_tokens(payload)
                if (sampling.get("max_tokens") or 0) > room:   # the engine's own check and message
                    return self._json(400, {"error": {
                        "message": f"max_tokens ({sampling['max_tokens']}) plus the prompt's tokens exceeds "
                                   f"the context; use max_tokens <= {room}",
                        "type": "invalid_request_error", "param": "max_tokens",
                        "code": "context_length_exceeded"}})
                n = sampling.get("n") or 1
                k = sampling.get("logprobs")
                choices = [node.generate_choice(sampling) for _ in range(n)]
                prompt = node.prompt_tokens(payload)
                completion = sum(len(toks) for toks, _ in choices)
                usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                         "total_tokens": prompt + completion, "cached_tokens": min(node.cached_tokens, prompt)}
                timings = {"queue_s": 0.001, "prefill_s": 0.002, "ttft_s": 0.003,
                           "mean_itl_s": 0.004, "total_s": 0.01}
                if not payload.get("stream"):
                    return self._json(200, {
                        "request_id": payload["request_id"], "model": MODEL_ID,
                        "choices": [{"index": i, "text": "".join(p for _, p in toks),
                                     "token_ids": [t for t, _ in toks], "finish_reason": fin,
                                     "logprobs": None if k is None else
                                     [node.logprob_entry(t, p, k) for t, p in toks]}
                                    for i, (toks, fin) in enumerate(choices)],
                        "usage": usage, "timings": timings})
                self._stream(payload, choices, k, usage, timings)

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _event(self, event: dict) -> None:
                self._chunk(f"data: {json.dumps(event)}\n\n".encode())

            def _stream(self, payload, choices, k, usage, timings) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header(STATE_HEADER, node.state_brief())
                self.send_header(PROMPT_TOKENS_HEADER, str(usage["prompt_tokens"]))
                self.end_headers()
                sent = 0
                try:
                    until = time.monotonic() + node.first_token_delay_s
                    while time.monotonic() < until:
                        time.sleep(min(0.05, max(0.0, until - time.monotonic())))
                        self._chunk(b": ping\n\n")
                    longest = max(len(t) for t, _ in choices) if choices else 0
                    for step in range(longest):
                        for i, (toks, _) in enumerate(choices):
                            if step >= len(toks):
                                continue
                            if node.fail_after_tokens is not None and sent >= node.fail_after_tokens:
                                self.close_connection = True
                                self.connection.shutdown(socket.SHUT_RDWR)
                                return
                            if node.error_after_tokens is not None and sent >= node.error_after_tokens:
                                self._event({"type": "error", "error": {
                                    "message": "engine step failed", "type": node.error_type,
                                    "code": node.error_code, "param": node.error_param}})
                                self._chunk(b"")
                                return
                            tid, piece = toks[step]
                            self._event({"type": "token", "index": i, "token_id": tid,
                                         "text": piece, "logprobs": None if k is None
                                         else node.logprob_entry(tid, piece, k)})
                            sent += 1
                            if node.token_delay_s:
                                time.sleep(node.token_delay_s)
                    self._event({"type": "done", "choices": [
                        {"index": i, "finish_reason": fin} for i, (_, fin) in enumerate(choices)],
                        "usage": usage, "timings": timings, STATE_FIELD: json.loads(node.state_brief())})
                    if node.trailer_delay_s:
                        time.sleep(node.trailer_delay_s)
                    self._chunk(b"")
                    self.close_connection = node.close_after_stream
                except (BrokenPipeError, ConnectionResetError):
                    with node._lock:
                        node.client_disconnects += 1
                    self.close_connection = True

        self._server = serve_in_thread(Handler, self.port, name=f"standin-node-{self.port}", tls=self.tls)
        return self

    def stop(self) -> None:
        self.stopped = True
        if self._server is not None:
            stop_serving(self._server)
            self._server = None


def serve_in_thread(handler: type[BaseHTTPRequestHandler], port: int = 0,
                    name: str | None = None, tls: ssl.SSLContext | None = None) -> ThreadingHTTPServer:
    """A ThreadingHTTPServer on 127.0.0.1:`port` (0: a free one) serving `handler` from a daemon thread,
    over TLS with a `tls` server context; stop_serving() stops it."""
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True, name=name).start()
    return server


def stop_serving(server: ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()


# -- configuration and tokens -------------------------------------------------------------------

def overrides_for_tests(node_urls: list[str] | None = None, **sections: dict) -> dict:
    """Config overrides for tests: test secrets, the given nodes, fast polling."""
    over: dict[str, Any] = {
        "auth": {"hs256_secret": JWT_SECRET},
        "nodes": {"urls": node_urls or [], "secret": NODE_SECRET, "poll_interval_s": 0.2,
                  "state_ttl_s": 2.0, "connect_timeout_s": 0.5, "read_timeout_s": 10.0},
        "server": {"log_level": "WARNING"},
    }
    for name, values in sections.items():
        over.setdefault(name, {}).update(values)
    return over


def make_config(node_urls: list[str] | None = None, **sections: dict):
    return load_config(env={}, overrides=overrides_for_tests(node_urls, **sections))


def bearer(config, org: str = "acme", tier: str | None = None, **claims) -> dict:
    return {"Authorization": "Bearer " + mint_token(config, org, tier, **claims)}
