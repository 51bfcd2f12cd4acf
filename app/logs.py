"""Structured logs: one JSON object a line, carrying the request id and org.

Inside a request the id and org come from flask.g (set by the request-id hook and auth);
code running outside one (a stream's generator, the node poller) passes them as `extra`.
"""
from __future__ import annotations

import logging
import re
import sys
import time
import uuid

from flask import Flask, g, has_request_context, request

from engine.logs import JsonFormatter
from engine.protocol import REQUEST_ID_HEADER

LOGGER_NAME = "zen.gateway"
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def request_fields() -> dict:
    """The request id and org of the request being served (none outside one)."""
    if not has_request_context():
        return {}
    caller = getattr(g, "caller", None)
    return {"request_id": getattr(g, "request_id", None), "org": caller.org if caller is not None else None}


def configure_logging(level: str = "INFO") -> logging.Logger:
    """Send the gateway's logs to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(context=request_fields))
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
    return logger


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


def init_request_logging(app: Flask) -> None:
    """Give every request an id (the client's X-Request-Id when sane) and log its end."""
    log = logging.getLogger(LOGGER_NAME)

    @app.before_request
    def _assign_request_id():
        incoming = request.headers.get(REQUEST_ID_HEADER, "")
        g.request_id = incoming if _REQUEST_ID_RE.fullmatch(incoming) else new_request_id()
        g.started = time.perf_counter()
        g.log_fields = {}

    @app.after_request
    def _log_request(response):
        rid = getattr(g, "request_id", None)
        if rid:
            response.headers["x-request-id"] = rid
        if request.path != "/metrics" and not response.is_streamed:
            log.info("request", extra={
                "event": "request", "method": request.method, "path": request.path,
                "status": response.status_code,
                "duration_ms": round((time.perf_counter() - g.get("started", time.perf_counter())) * 1e3, 3),
                **g.get("log_fields", {}),
            })
        return response
