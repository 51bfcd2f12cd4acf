"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Views raise `APIError` (engine/protocol.py, shared with the node); the handlers registered here
turn it, werkzeug's HTTP errors and anything unexpected into that shape. A client never sees a
stack trace: an unexpected exception is logged with its traceback and answered with a 500 that
names the request id.
"""
from __future__ import annotations

import logging

from flask import Flask, g, request
from werkzeug.exceptions import HTTPException

from engine.protocol import HTTP_ERROR_CODES, APIError

log = logging.getLogger("zen.gateway")

CLIENT_CLOSED = 499   # the status of a request whose client left first (nginx's): not an error of the service


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key",
                    headers={"WWW-Authenticate": 'Bearer realm="zen"'})


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    param="model", code="model_not_found")


def unexpected_error(request_id: str | None) -> APIError:
    """The exception being handled, which nothing expected: logged with its traceback, answered as a 500
    that names the request id."""
    log.exception("unhandled error", extra={"event": "unhandled_error", "request_id": request_id})
    return APIError(500, f"The server had an error while processing your request "
                    f"(request id {request_id}).", code="internal_error")


def register_error_handlers(app: Flask) -> None:
    """Answer every error in OpenAI's shape."""

    @app.errorhandler(APIError)
    def _api_error(exc: APIError):
        return exc.response()

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        status = exc.code or 500
        if status == 404:
            message = f"Invalid URL ({request.method} {request.path})"
        elif status == 405:
            message = f"Method {request.method} is not allowed for {request.path}"
        elif status == 413:
            limit = app.config.get("MAX_CONTENT_LENGTH")
            message = f"Request body is too large (limit {limit} bytes)"
        else:
            message = exc.description or exc.name
        resp = APIError(status, message, code=HTTP_ERROR_CODES.get(status)).response()
        if status == 405 and exc.get_headers():
            for key, value in exc.get_headers():
                if key.lower() == "allow":
                    resp.headers["Allow"] = value
        return resp

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        return unexpected_error(getattr(g, "request_id", None)).response()
