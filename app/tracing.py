"""The gateway's traces (service `zen-gateway`): a server span per API request, child of the client's
traceparent when it sends one, with spans for auth, limits, routing and the node request inside it.

Off (no OTLP endpoint configured, or [tracing] enabled = false) nothing is registered:
app.extensions["zen.tracing"] is None, g.trace is never set, and `request_span` hands back one
shared do-nothing context manager after one look at g.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from flask import Flask, Response, g, request

from app.config import GatewayConfig

if TYPE_CHECKING:
    from engine.tracing import Tracing

log = logging.getLogger("zen.gateway")

SERVICE_NAME = "zen-gateway"
EXTENSION_KEY = "zen.tracing"
TRACED_PREFIX = "/v1/"          # the API's requests; health, metrics and docs are not traced
_NO_SPAN = contextlib.nullcontext()


@dataclass
class RequestTrace:
    """The server span of the request being served, and the context token that made it current."""

    span: Any
    token: Any
    ends_with_stream: bool = False


def init_tracing(app: Flask, config: GatewayConfig) -> Tracing | None:
    """Register the request's server span hooks when tracing is on; run right after the request id
    hook and before auth, so that auth's span falls inside the request's."""
    tc = config.tracing
    app.extensions[EXTENSION_KEY] = None
    if not (tc.enabled and tc.endpoint):
        return None
    from engine.tracing import Tracing
    tracing = app.extensions[EXTENSION_KEY] = Tracing(SERVICE_NAME, tc.endpoint, tc.sample_ratio)
    log.info("tracing on", extra={"event": "tracing", "endpoint": tracing.endpoint,
                                  "sample_ratio": tc.sample_ratio})

    @app.before_request
    def _start_request_span():
        if request.path.startswith(TRACED_PREFIX):
            g.trace = start_request_span(tracing)

    @app.after_request
    def _describe_response(response: Response) -> Response:
        trace = g.get("trace")
        if trace is not None:
            describe_response(trace, response)
        return response

    @app.teardown_request
    def _end_request_span(exc: BaseException | None) -> None:
        trace = g.pop("trace", None)
        if trace is not None:
            end_request_span(trace, exc)

    return tracing


def start_request_span(tracing: Tracing) -> RequestTrace:
    from opentelemetry import context
    from opentelemetry.trace import SpanKind, set_span_in_context

    from engine.tracing import extract_context
    span = tracing.tracer.start_span(
        f"{request.method} {request.path}", context=extract_context(request.headers), kind=SpanKind.SERVER,
        attributes={"http.request.method": request.method, "url.path": request.path,
                    "zen.request_id": g.get("request_id") or ""})
    return RequestTrace(span, context.attach(set_span_in_context(span)))


def describe_response(trace: RequestTrace, response: Response) -> None:
    """The outcome on the server span; a stream's span ends when its last byte went out."""
    span = trace.span
    record_status(trace, response.status_code)
    if g.get("org"):
        span.set_attribute("zen.org", g.org)
    for field, attribute in (("model", "zen.model"), ("latency_class", "zen.latency_class"),
                             ("node", "zen.node")):
        value = g.get("log_fields", {}).get(field)
        if value is not None:
            span.set_attribute(attribute, value)
    if response.is_streamed:
        trace.ends_with_stream = True
        response.call_on_close(span.end)


def record_status(trace: RequestTrace, status: int) -> None:
    """The response's status on the server span; again for a stream that no node accepted after its view
    returned (app/api.py's AcceptedStream), whose 200 turned into the error it answers."""
    trace.span.set_attribute("http.response.status_code", status)
    if status >= 500:
        from opentelemetry.trace import Status, StatusCode
        trace.span.set_status(Status(StatusCode.ERROR))


def record_stream_end(trace: RequestTrace, node: str | None, status: int | str) -> None:
    """A stream's server span, before it ends: the node that served it, how the stream ended
    (zen.stream_status: as the request's metrics and log line count it), and an error where it ended in an
    error event, after its first token (status "stream") or with no node left to take it over (5xx): its
    HTTP status stays the 200 it started with."""
    if node:
        trace.span.set_attribute("zen.node", node)
    trace.span.set_attribute("zen.stream_status", str(status))   # 200, 499 (the client left), 400, "stream", ...
    if status == "stream" or (isinstance(status, int) and status >= 500):
        from opentelemetry.trace import Status, StatusCode
        trace.span.set_status(Status(StatusCode.ERROR, f"the stream ended in an error event ({status})"))


def end_request_span(trace: RequestTrace, exc: BaseException | None) -> None:
    from opentelemetry import context
    context.detach(trace.token)
    if exc is not None:
        trace.span.record_exception(exc)
    if not trace.ends_with_stream:
        trace.span.end()


def request_span(name: str, attributes: Callable[[], dict[str, Any]] | None = None):
    """A span around one step of the request being served (current inside it); when the request is
    not traced, a shared context manager that does nothing. `attributes` is called only when traced."""
    if g.get("trace") is None:          # set by this app's hooks only when tracing is on
        return _NO_SPAN
    from flask import current_app
    tracer = current_app.extensions[EXTENSION_KEY].tracer
    return tracer.start_as_current_span(name, attributes=attributes() if attributes else None)


def close_tracing(app: Flask) -> None:
    tracing = app.extensions.pop(EXTENSION_KEY, None)
    if tracing is not None:
        tracing.shutdown()


# -- the node request ------------------------------------------------------------------------------

def traced_rank(tracing: Tracing, rank: Callable[[], list], req) -> list:
    """`rank()`, the router's ranking of nodes for `req`, in a `routing` span naming the chosen node and its
    score."""
    model = req.model
    with tracing.tracer.start_as_current_span("routing", attributes={
            "zen.model": model.alias, "gen_ai.request.model": model.model,
            "zen.quantization": model.quantization}) as span:
        ranked = rank()
        span.set_attribute("zen.routing.candidates", len(ranked))
        if ranked:
            best = ranked[0]
            span.set_attributes({"zen.node": best.url, "zen.routing.score": best.total,
                                 "zen.routing.latency_s": best.latency_s,
                                 "zen.routing.utilization": best.utilization,
                                 "zen.routing.cold_load_s": best.cold_load_s,
                                 "zen.routing.queue_full": best.queue_full})
    return ranked


def start_node_span(tracing: Tracing, req, headers: dict):
    """The `node_request` span (a client span, open until the node's stream is closed), and its
    traceparent in `headers`: the node's spans are its children."""
    from opentelemetry.trace import SpanKind

    from engine.tracing import inject_context
    span = tracing.tracer.start_span("node_request", kind=SpanKind.CLIENT, attributes={
        "zen.model": req.model.alias, "zen.org": req.org, "zen.latency_class": req.latency_class.label,
        "zen.request_id": req.node_request_id})
    inject_context(headers, span)
    return span


def end_node_span(span, node: str, attempts: int, error: BaseException | None = None) -> None:
    span.set_attributes({"zen.node": node, "zen.node_attempts": attempts})
    if error is not None:
        from opentelemetry.trace import Status, StatusCode
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end()
