"""Tracing: a client's traceparent leads through the gateway's spans (auth, limits, routing, the node
request) to a real node's (its request, queueing, prefill, decode), all in one trace; failover shows
as events; spans reach a real OTLP/HTTP receiver; and without an endpoint nothing is set up."""
from __future__ import annotations

import os
import threading
import time
from http.server import BaseHTTPRequestHandler
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pytest
import requests
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app import close_app, create_app
from app.config import load_config
from engine.node.config import ModelSpec, NodeConfig
from scripts.stand_in_node import serve_in_thread, stop_serving
from tests.node_fixtures import start_node, tiny_models  # noqa: F401 (fixtures)
from tests.test_gateway_support import (NODE_SECRET, StandInNode, bearer, free_port, make_config,
                                        node, overrides_for_tests)  # noqa: F401 (node: fixture)

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"
TINY = {"zen-tiny": {"model": "tiny-a", "quantization": "f32", "max_context": 4096, "default_max_tokens": 8,
                     "cold_load_s": 0.5}}
COLLECTOR = "http://127.0.0.1:9"   # never reached: the tests swap in an in-memory exporter


@pytest.fixture(autouse=True)
def no_otel_environment(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)


class ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """Calls a body's close() however the response ends (PEP 3333), as gunicorn does; the node's spans
    are made there. Werkzeug's development server skips it when the client resets the connection."""
    daemon_threads = True


class QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:
        pass


def serve_node(tiny_path: str, otlp_endpoint: str | None):
    """A real node app (CPU, the tiny model resident) on a loopback port, in this process."""
    from engine.node.app import create_app as create_node_app
    config = NodeConfig(models=[ModelSpec(tiny_path, "tiny-a")], backend="cpu", kv_cache_bytes=1 << 20,
                        secret=NODE_SECRET, port=free_port(), otlp_endpoint=otlp_endpoint)
    app = create_node_app(config)
    assert app.extensions["zen_node"].ready.wait(300)
    server = make_server("127.0.0.1", config.port, app, ThreadingWSGIServer, QuietHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return app, server, f"http://127.0.0.1:{config.port}"


@pytest.fixture
def real_node(tiny_models):  # noqa: F811
    app, server, url = serve_node(tiny_models["a"], COLLECTOR)
    exporter = app.extensions["zen_node_tracing"].exporter = InMemorySpanExporter()
    yield url, exporter
    server.shutdown()
    app.extensions["zen_node"].close()


def traced_gateway(node_urls: list[str], **sections):
    config = make_config(node_urls, tracing={"endpoint": COLLECTOR}, models=TINY,
                         tiers={"pro": {"models": ["zen-small", "zen-tiny"]}}, **sections)
    app = create_app(config)
    exporter = app.extensions["zen.tracing"].exporter = InMemorySpanExporter()
    return app, config, exporter


def wait_for_spans(exporter: InMemorySpanExporter, names: set[str], timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        spans = {s.name: s for s in exporter.get_finished_spans()}
        if names <= set(spans) or time.monotonic() > deadline:
            assert names <= set(spans), f"missing spans {names - set(spans)}; got {sorted(spans)}"
            return spans


def ancestry(span, by_id: dict) -> list[int]:
    """Span ids from `span`'s parent up to the first parent not among the recorded spans."""
    chain = []
    while span.parent is not None:
        chain.append(span.parent.span_id)
        span = by_id.get(span.parent.span_id)
        if span is None:
            break
    return chain


@pytest.mark.parametrize("stream", [False, True])
def test_client_traceparent_leads_through_gateway_and_node_spans(real_node, stream):
    node_url, node_spans = real_node
    app, config, gateway_spans = traced_gateway([node_url])
    try:
        r = app.test_client().post(
            "/v1/chat/completions", headers={**bearer(config), "traceparent": TRACEPARENT},
            json={"model": "zen-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                  "temperature": 0, "stream": stream})
        assert r.status_code == 200
        r.get_data()
        r.close()
        gw = wait_for_spans(gateway_spans, {"POST /v1/chat/completions", "auth", "limits.requests",
                                            "limits.tokens", "routing", "node_request"})
        nd = wait_for_spans(node_spans, {"POST /v1/generate", "queueing", "prefill", "decode"})
    finally:
        close_app(app)

    everything = {s.context.span_id: s for s in [*gw.values(), *nd.values()]}
    client_span = int(CLIENT_SPAN_ID, 16)
    for span in everything.values():
        assert span.context.trace_id == int(TRACE_ID, 16), span.name
        assert ancestry(span, everything)[-1] == client_span, span.name
    root = gw["POST /v1/chat/completions"]
    assert root.parent.span_id == client_span and root.parent.is_remote
    assert root.resource.attributes["service.name"] == "zen-gateway"
    assert root.attributes["zen.org"] == "acme" and root.attributes["http.response.status_code"] == 200
    for name in ("auth", "limits.requests", "limits.tokens", "routing", "node_request"):
        assert gw[name].parent.span_id == root.context.span_id, name
    routing = gw["routing"]
    assert routing.attributes["zen.node"] == node_url and routing.attributes["zen.routing.candidates"] == 1
    assert routing.attributes["zen.routing.score"] >= 0 and "zen.routing.latency_s" in routing.attributes
    assert gw["node_request"].attributes["zen.node_attempts"] == 1

    server = nd["POST /v1/generate"]
    assert server.parent.span_id == gw["node_request"].context.span_id and server.parent.is_remote
    assert server.resource.attributes["service.name"] == "zen-node"
    assert server.attributes["gen_ai.usage.output_tokens"] == 4
    assert server.attributes["zen.org"] == "acme" and server.attributes["zen.latency_class"] == "standard"
    assert server.attributes["zen.quantization"] == "f32" and server.attributes["gen_ai.request.model"] == "tiny-a"
    phases = [nd["queueing"], nd["prefill"], nd["decode"]]
    for phase in phases:
        assert phase.parent.span_id == server.context.span_id
        assert server.start_time <= phase.start_time <= phase.end_time <= server.end_time
    assert phases[0].end_time == phases[1].start_time and phases[1].end_time == phases[2].start_time
    assert tuple(nd["decode"].attributes["gen_ai.response.finish_reasons"]) == ("length",)


def test_failover_attempts_are_events_of_the_node_request_span():
    busy, good = StandInNode(node_id="busy").start(), StandInNode(node_id="good").start()
    busy.busy = True
    busy.state = {"utilization": 0.0}
    good.state = {"utilization": 0.9}   # ranked after the busy one
    app, config, spans = traced_gateway([busy.url, good.url])
    try:
        r = app.test_client().post("/v1/completions", headers={**bearer(config), "traceparent": TRACEPARENT},
                                   json={"model": "zen-small", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200
        node_request = wait_for_spans(spans, {"node_request"})["node_request"]
    finally:
        close_app(app)
        busy.stop()
        good.stop()
    assert node_request.attributes["zen.node"] == good.url and node_request.attributes["zen.node_attempts"] == 2
    [event] = [e for e in node_request.events if e.name == "failover"]
    assert event.attributes["zen.node"] == busy.url and event.attributes["zen.failover_reason"] == "busy"


def _traced_stream(node: StandInNode, names: set[str]) -> tuple[int, str, dict]:
    """A completions stream through a traced gateway in front of `node` alone (stopped after): its status,
    its body, and the finished spans named `names`."""
    app, config, spans = traced_gateway([node.url])
    try:
        r = app.test_client().post("/v1/completions", headers=bearer(config),
                                   json={"model": "zen-small", "prompt": "hi", "max_tokens": 5, "stream": True})
        body = r.get_data(as_text=True)
        r.close()
        return r.status_code, body, wait_for_spans(spans, names)
    finally:
        close_app(app)
        node.stop()


def test_a_stream_no_node_accepts_is_an_error_on_the_server_span():
    """The stream's response is returned before a node accepts the request; when none does, its server
    span says so (the status the client got, an error) rather than the 200 the view returned."""
    busy = StandInNode(node_id="busy").start()
    busy.busy = True
    status, _, spans = _traced_stream(busy, {"POST /v1/completions"})
    from opentelemetry.trace import StatusCode
    root = spans["POST /v1/completions"]
    assert status == 503
    assert root.attributes["http.response.status_code"] == 503 and root.status.status_code == StatusCode.ERROR


@pytest.mark.parametrize("tokens, code", [(2, "engine_error"), (0, "no_node_available")])
def test_a_stream_that_ends_in_an_error_event_is_an_error_on_both_gateway_spans(tokens, code):
    """Broken after its first token, or before it with no node left to take it: its status stays 200 (the
    stream had started), the spans say it failed, and which node had it."""
    broken = StandInNode(node_id="broken").start()
    broken.fail_after_tokens = tokens
    status, body, got = _traced_stream(broken, {"POST /v1/completions", "node_request"})
    assert status == 200 and code in body
    from opentelemetry.trace import StatusCode
    root, node_request = got["POST /v1/completions"], got["node_request"]
    assert root.status.status_code == StatusCode.ERROR and root.attributes["zen.node"] == broken.url
    assert node_request.status.status_code == StatusCode.ERROR and node_request.attributes["zen.node"] == broken.url
    assert root.attributes["zen.stream_status"] == ("stream" if tokens else "503")   # as its metrics count it


def test_without_an_endpoint_nothing_is_set_up(node, tiny_models):  # noqa: F811
    config = make_config([node.url])
    assert config.tracing.endpoint == ""
    app = create_app(config)
    try:
        assert app.extensions["zen.tracing"] is None and app.extensions["zen.nodes"].tracing is None
        with app.test_request_context("/v1/models"):
            from app.tracing import _NO_SPAN, request_span
            assert request_span("auth") is _NO_SPAN
        r = app.test_client().post("/v1/completions", headers={**bearer(config), "traceparent": TRACEPARENT},
                                   json={"model": "zen-small", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200
    finally:
        close_app(app)
    node_app, server, _ = serve_node(tiny_models["a"], None)
    try:
        assert node_app.extensions["zen_node_tracing"] is None
    finally:
        server.shutdown()
        node_app.extensions["zen_node"].close()


class OTLPReceiver:
    """An OTLP/HTTP trace receiver on loopback: keeps each POST's path, content type and decoded spans."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, str]] = []
        self.spans: list[tuple[str, str, bytes, bytes]] = []   # (service, span name, trace id, parent id)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                export = ExportTraceServiceRequest.FromString(body)
                receiver.posts.append((self.path, self.headers.get("Content-Type")))
                for resource_spans in export.resource_spans:
                    service = next(a.value.string_value for a in resource_spans.resource.attributes
                                   if a.key == "service.name")
                    receiver.spans += [(service, span.name, span.trace_id, span.parent_span_id)
                                       for scope in resource_spans.scope_spans for span in scope.spans]
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self._server = serve_in_thread(Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        stop_serving(self._server)


def test_endpoint_from_the_environment_and_a_real_otlp_receiver(node):  # noqa: F811
    receiver = OTLPReceiver()
    base = receiver.url
    config = load_config(env={"OTEL_EXPORTER_OTLP_ENDPOINT": base}, overrides=overrides_for_tests([node.url]))
    assert config.tracing.endpoint == base + "/v1/traces"
    assert not load_config(env={"OTEL_EXPORTER_OTLP_ENDPOINT": base, "OTEL_SDK_DISABLED": "true"},
                           overrides=overrides_for_tests([node.url])).tracing.enabled
    app = create_app(config)
    tracing = app.extensions["zen.tracing"]
    try:
        assert tracing._provider is None   # built in the process that serves, on its first request
        r = app.test_client().post("/v1/completions", headers={**bearer(config), "traceparent": TRACEPARENT},
                                   json={"model": "zen-small", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200
        assert tracing._provider is not None
    finally:
        close_app(app)   # flushes the batch
        receiver.stop()
    assert receiver.posts and all(p == ("/v1/traces", "application/x-protobuf") for p in receiver.posts)
    names = {name for service, name, trace_id, _ in receiver.spans
             if service == "zen-gateway" and trace_id.hex() == TRACE_ID}
    assert {"POST /v1/completions", "auth", "routing", "node_request"} <= names


@pytest.mark.slow
def test_a_node_under_gunicorn_exports_its_spans_to_the_otlp_flag(start_node, tiny_models):  # noqa: F811
    """The node's --otlp-endpoint: its worker (not the gunicorn master) batches and sends the spans."""
    receiver = OTLPReceiver()
    try:
        url = start_node([tiny_models["a"] + "=tiny-a"], NODE_SECRET,
                         extra_args=("--otlp-endpoint", receiver.url))
        parent_id = "00f067aa0ba902b7"
        r = requests.post(url + "/v1/generate", timeout=60,
                          headers={"X-Node-Secret": NODE_SECRET, "traceparent": f"00-{TRACE_ID}-{parent_id}-01"},
                          json={"request_id": "acme/t1", "model": "tiny-a", "org": "acme", "prompt": "hi",
                                "sampling": {"max_tokens": 3}})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 20   # the batch processor sends every 5 s
        while len(receiver.spans) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        receiver.stop()
    spans = {name: (service, trace_id.hex(), parent.hex()) for service, name, trace_id, parent in receiver.spans}
    assert spans["POST /v1/generate"] == ("zen-node", TRACE_ID, parent_id)
    assert {"queueing", "prefill", "decode"} <= set(spans)


def test_a_gateway_without_tracing_imports_neither_the_sdk_tracer_nor_the_tracing_module():
    """(redis-py imports parts of OpenTelemetry for its own metrics when they are installed: only the
    SDK's tracing is looked for.)"""
    import subprocess
    import sys
    code = ("import os, sys; os.environ['ZEN_NODES'] = 'http://127.0.0.1:9'; "
            "from app import close_app, create_app; app = create_app(); close_app(app); "
            "print(sorted(m for m in sys.modules if m == 'engine.tracing' or m.startswith('opentelemetry.sdk.trace')))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_traces_url_of_each_way_to_name_the_collector():
    from engine.tracing import Tracing, endpoint_from_env
    traces = lambda env: Tracing("x", endpoint_from_env(env)).endpoint  # noqa: E731
    # the signal's own variable is the URL as it is, whatever its path
    assert traces({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://tempo:4318/otlp/traces"}) == \
        "http://tempo:4318/otlp/traces"
    # the base variable gets /v1/traces after its path
    assert traces({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/prefix/"}) == "http://c:4318/prefix/v1/traces"
    assert traces({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == "http://c:4318/v1/traces"
    # a configured endpoint: a bare address gets the path, a URL with one is kept
    assert Tracing("x", "http://c:4318/").endpoint == "http://c:4318/v1/traces"
    assert Tracing("x", "http://c:4318/v1/traces").endpoint == "http://c:4318/v1/traces"
    assert Tracing("x", "https://c/otlp/traces").endpoint == "https://c/otlp/traces"
