"""OpenTelemetry tracing, the same for the gateway and the node: the OTLP/HTTP pipeline of one
service, W3C trace-context headers (traceparent, tracestate), and spans placed after the fact from
monotonic timestamps.

Tracing is on only where an OTLP endpoint is configured. Off, nothing here is built: callers hold
None and test it, so no SDK, no tracer provider and no span exists on the request path (the gateway
does not even import this module then). The SDK is imported only when a Tracing starts, in the
process that first uses it (a gunicorn worker, never the master), so its BatchSpanProcessor's thread
lives where the spans are made.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Mapping, MutableMapping
from urllib.parse import urlsplit

TRACEPARENT_HEADER = "traceparent"
TRACESTATE_HEADER = "tracestate"
TRACES_PATH = "/v1/traces"
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"          # the collector's base URL: /v1/traces is added
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"   # the traces URL as it is
DISABLED_ENV = "OTEL_SDK_DISABLED"


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a configured endpoint: a collector's address with no path gets
    /v1/traces; a URL with a path is the traces URL as it is (a collector behind a proxy's prefix too)."""
    endpoint = endpoint.strip()
    return endpoint.rstrip("/") + TRACES_PATH if urlsplit(endpoint).path in ("", "/") else endpoint


def sdk_disabled(environ: Mapping[str, str]) -> bool:
    return environ.get(DISABLED_ENV, "").strip().lower() == "true"


def endpoint_from_env(environ: Mapping[str, str]) -> str | None:
    """The traces URL that the standard OTEL_* variables name; None when none does or the SDK is
    disabled there."""
    if sdk_disabled(environ):
        return None
    if environ.get(TRACES_ENDPOINT_ENV, "").strip():
        return environ[TRACES_ENDPOINT_ENV].strip()
    if environ.get(ENDPOINT_ENV, "").strip():   # a base URL, path or not: /v1/traces goes after it
        return environ[ENDPOINT_ENV].strip().rstrip("/") + TRACES_PATH
    return None


def clock_offset_ns() -> int:
    """Epoch minus monotonic time, in nanoseconds: read once for spans placed together, so that
    one's end and the next one's start, the same monotonic reading, are the same instant."""
    return time.time_ns() - time.monotonic_ns()


def wall_ns(monotonic_s: float, offset_ns: int) -> int:
    """A time.monotonic() reading as OpenTelemetry's nanoseconds since the epoch."""
    return offset_ns + round(monotonic_s * 1e9)


class Tracing:
    """The spans of one service, exported over OTLP/HTTP (batched) to `endpoint`.

    Set `exporter` before the first span to export elsewhere, synchronously (tests pass the SDK's
    in-memory exporter). The provider is built on first use in each process and is this object's
    own: the global tracer provider is left alone.
    """

    def __init__(self, service_name: str, endpoint: str, sample_ratio: float = 1.0) -> None:
        self.service_name = service_name
        self.endpoint = traces_url(endpoint)
        self.sample_ratio = sample_ratio
        self.exporter = None
        self._provider = None
        self._tracer = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    @property
    def tracer(self):
        if self._pid != os.getpid():
            self._start()
        return self._tracer

    def _start(self) -> None:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        with self._lock:
            if self._pid == os.getpid():
                return
            provider = TracerProvider(resource=Resource.create({SERVICE_NAME: self.service_name}),
                                      sampler=ParentBased(TraceIdRatioBased(self.sample_ratio)))
            if self.exporter is not None:
                provider.add_span_processor(SimpleSpanProcessor(self.exporter))
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.endpoint)))
            self._provider = provider
            self._tracer = provider.get_tracer("zen")
            self._pid = os.getpid()

    def force_flush(self) -> None:
        if self._provider is not None and self._pid == os.getpid():
            self._provider.force_flush()

    def shutdown(self) -> None:
        """Export what is pending and stop the exporter thread (this process's)."""
        if self._provider is not None and self._pid == os.getpid():
            self._provider.shutdown()
        self._provider = self._tracer = self._pid = None


def extract_context(headers: Mapping[str, str]):
    """The remote parent that a request's traceparent/tracestate headers name (an empty context
    when they name none, or are malformed)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    carrier = {name: headers.get(name) for name in (TRACEPARENT_HEADER, TRACESTATE_HEADER)
               if headers.get(name)}
    return TraceContextTextMapPropagator().extract(carrier)


def inject_context(headers: MutableMapping[str, str], span) -> None:
    """Add the traceparent (and tracestate) that make `span` the parent of the receiver's spans."""
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    TraceContextTextMapPropagator().inject(headers, context=set_span_in_context(span))


def record_span(tracer, name: str, start_s: float, end_s: float, offset_ns: int, parent=None,
                attributes: Mapping[str, Any] | None = None):
    """A finished span from monotonic start/end readings (clock_offset_ns's offset), child of `parent`
    (a context)."""
    span = tracer.start_span(name, context=parent, attributes=dict(attributes or {}),
                             start_time=wall_ns(start_s, offset_ns))
    span.end(end_time=wall_ns(max(start_s, end_s), offset_ns))
