"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Views raise `APIError` (engine/protocol.py, shared with the node); the handlers registered here
turn it, werkzeug's HTTP errors and anything unexpected into that shape. A client never sees a
stack trace: an unexpected exception is logged with its traceback and answered with a 500 that
names the request id.
"""
from __future__ import annotations

import logging

from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException

from engine.protocol import APIError

log = logging.getLogger("zen.gateway")


def error_response(e: APIError) -> Response:
    resp = jsonify(e.body())
    resp.status_code = e.status
    for key, value in e.headers.items():
        resp.headers[key] = value
    return resp


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 naming the parameter at fault."""
    return APIError(400, message, param=param, code=code or ("invalid_value" if param else None))


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key",
                    headers={"WWW-Authenticate": 'Bearer realm="zen"'})


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    param="model", code="model_not_found")


_HTTP_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
}


def register_error_handlers(app: Flask) -> None:
    """Answer every error in OpenAI's shape."""

    @app.errorhandler(APIError)
    def _api_error(exc: APIError):
        return error_response(exc)

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
        err = APIError(status, message, code=_HTTP_CODES.get(status))
        resp = error_response(err)
        if status == 405 and exc.get_headers():
            for key, value in exc.get_headers():
                if key.lower() == "allow":
                    resp.headers["Allow"] = value
        return resp

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error", extra={"event": "unhandled_error"})
        rid = getattr(g, "request_id", None)
        return error_response(APIError(500, f"The server had an error while processing your request "
                                            f"(request id {rid}).", code="internal_error"))
