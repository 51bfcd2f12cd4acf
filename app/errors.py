"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Views raise `APIError`; the handlers registered here turn it, werkzeug's HTTP errors and
anything unexpected into that shape. A client never sees a stack trace: an unexpected
exception is logged with its traceback and answered with a 500 that names the request id.
"""
from __future__ import annotations

import json
import logging

from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException

log = logging.getLogger("zen.gateway")

# OpenAI's error types by HTTP status.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


def error_type_for(status: int) -> str:
    return _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(Exception):
    """An error to answer in OpenAI's shape with `status` and extra `headers`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type_for(status)
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> Response:
        resp = jsonify(self.body())
        resp.status_code = self.status
        for key, value in self.headers.items():
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


def sse_error_event(message: str, *, type: str = "server_error", code: str | None = None) -> str:
    """A server-sent event carrying an error, as sent after a stream has started."""
    return "data: " + json.dumps(error_body(message, type=type, code=code)) + "\n\n"


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
        err = APIError(status, message, code=_HTTP_CODES.get(status))
        resp = err.response()
        if status == 405 and exc.get_headers():
            for key, value in exc.get_headers():
                if key.lower() == "allow":
                    resp.headers["Allow"] = value
        return resp

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error", extra={"event": "unhandled_error"})
        rid = getattr(g, "request_id", None)
        return APIError(500, f"The server had an error while processing your request "
                             f"(request id {rid}).", code="internal_error").response()
