"""The node's traces (service `zen-node`): per generation, a server span (arrival -> close) that is the
child of the gateway's node_request span (the traceparent header), and in it the request's phases:
queueing (arrival -> first scheduled), prefill (first scheduled -> first token) and decode (first
token -> finished).

They are made once the generation closes, from the timestamps its sequences kept, so the engine's
loop never touches a span. Off (no endpoint from --otlp-endpoint or the OTEL_* variables) the app
holds None and a generation carries no trace.
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Mapping

from flask import Flask

from engine.tracing import Tracing, clock_offset_ns, endpoint_from_env, extract_context, record_span, wall_ns

if TYPE_CHECKING:
    from engine.node.generation import Generation

log = logging.getLogger("engine.node")

SERVICE_NAME = "zen-node"
EXTENSION_KEY = "zen_node_tracing"


def init_tracing(app: Flask, endpoint: str | None) -> Tracing | None:
    """The node's Tracing when an endpoint is given (or named by the OTEL_* variables), else None."""
    endpoint = endpoint or endpoint_from_env(os.environ)
    tracing = app.extensions[EXTENSION_KEY] = Tracing(SERVICE_NAME, endpoint) if endpoint else None
    if tracing is not None:
        log.info("tracing on", extra={"event": "tracing", "endpoint": tracing.endpoint})
    return tracing


class GenerationTrace:
    """What a generation's spans need besides the generation: the tracing and the caller's parent."""

    def __init__(self, tracing: Tracing, headers: Mapping[str, str]) -> None:
        self.tracing = tracing
        self.parent = extract_context(headers)

    def record(self, gen: "Generation", outcome: str) -> None:
        """The generation's spans, from its timestamps; called once, as it closes."""
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        tracer, req, call, m = self.tracing.tracer, gen.req, gen.call, gen.m
        now, offset = time.monotonic(), clock_offset_ns()
        scheduled, first_token, end = gen.phase_times(now)
        usage = gen.usage()
        attributes = {
            "gen_ai.request.model": m.id, "zen.quantization": m.quantization,
            "zen.latency_class": call.latency_class.label, "zen.org": call.org,
            "zen.request_id": req.request_id, "zen.outcome": outcome, "zen.stream": call.stream,
            "gen_ai.usage.input_tokens": usage["prompt_tokens"],
            "gen_ai.usage.output_tokens": usage["completion_tokens"],
            "gen_ai.response.finish_reasons": [c.finish_reason or "abort" for c in gen.choices]}
        server = tracer.start_span("POST /v1/generate", context=self.parent, kind=SpanKind.SERVER,
                                   attributes=attributes, start_time=wall_ns(req.arrival_time, offset))
        if outcome not in ("ok", "client_closed"):
            server.set_status(Status(StatusCode.ERROR, outcome))
        inside = set_span_in_context(server)
        phase = {k: attributes[k] for k in ("gen_ai.request.model", "zen.quantization", "zen.latency_class",
                                            "zen.org")}
        record_span(tracer, "queueing", req.arrival_time, scheduled if scheduled is not None else end, offset,
                    inside, phase)
        if scheduled is not None and first_token is not None:
            record_span(tracer, "prefill", scheduled, first_token, offset, inside,
                        {**phase, "gen_ai.usage.input_tokens": usage["prompt_tokens"]})
        if first_token is not None:
            record_span(tracer, "decode", first_token, end, offset, inside,
                        {**phase, "gen_ai.usage.output_tokens": usage["completion_tokens"],
                         "gen_ai.response.finish_reasons": attributes["gen_ai.response.finish_reasons"]})
        server.end(end_time=wall_ns(max(end, now), offset))

