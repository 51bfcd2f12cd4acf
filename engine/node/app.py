"""The node's Flask application factory: the Node in app.extensions, the endpoints' Blueprint, the
X-Node-Secret check and the error handlers (OpenAI's error shape, never a stack trace)."""
from __future__ import annotations

import hmac
import logging
import sys

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from engine.node.config import NodeConfig
from engine.node.node import Node
from engine.node.telemetry import Telemetry
from engine.node.tracing import init_tracing
from engine.node.views import bp, the_node
from engine.protocol import HTTP_ERROR_CODES, REQUEST_ID_HEADER, SECRET_HEADER, STATE_HEADER, APIError

log = logging.getLogger("engine.node")

OPEN_PATHS = ("/health", "/ready", "/metrics")   # everything else needs X-Node-Secret
MAX_BODY_BYTES = 16 << 20
GIL_SWITCH_INTERVAL_S = 0.0005             # a busy thread must not hold up the engine step's GIL hand-backs


def create_app(config: NodeConfig, telemetry: Telemetry | None = None, start: bool = True) -> Flask:
    """The node's Flask app; `start` loads the start-up models in the background."""
    app = Flask("engine.node")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    node = Node(config, telemetry)
    app.extensions["zen_node"] = node
    init_tracing(app, config.otlp_endpoint)
    register_error_handlers(app)
    app.before_request(_authenticate)
    app.after_request(_state_header)
    app.register_blueprint(bp)
    if start:
        node.start()
    return app


def _authenticate():
    g.request_id = request.headers.get(REQUEST_ID_HEADER) or None
    if request.path in OPEN_PATHS:
        return None
    given = request.headers.get(SECRET_HEADER, "").encode()
    if not hmac.compare_digest(given, the_node().config.secret.encode()):
        raise APIError(401, f"missing or wrong {SECRET_HEADER} header", code="invalid_node_secret",
                       type="authentication_error")
    return None


STATE_PATHS = ("/tokenize", "/detokenize")   # besides /v1/: answers with the state header


def _state_header(response: Response) -> Response:
    """Every /v1/ and tokenizer answer (a stream's as it starts, errors too) carries the node's state in
    brief: the gateway routes its next request on it at once, without waiting for its next poll of
    /state (a tokenizer call loads its model too)."""
    if (request.path.startswith("/v1/") or request.path in STATE_PATHS) and response.status_code != 401:
        try:
            response.headers[STATE_HEADER] = the_node().state().to_header()
        except Exception:   # best effort: a state that cannot be read costs the answer nothing
            log.exception("the node state could not be read for the state header")
    return response


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(APIError)
    def _api_error(e: APIError):
        the_node().metrics.rejected(e.code or str(e.status))
        # the node's own refusals (busy, full, draining) are the operator's business; a bad request, the client's
        log.log(logging.WARNING if e.status == 429 or e.status >= 500 else logging.INFO, "request refused", extra={
            "event": "refused", "request_id": getattr(g, "request_id", None), "org": getattr(g, "org", None),
            "path": request.path, "status": e.status, "code": e.code})
        return e.response()

    @app.errorhandler(HTTPException)
    def _http_error(e: HTTPException):
        return APIError(e.code or 500, e.description or e.name, code=HTTP_ERROR_CODES.get(e.code)).response()

    @app.errorhandler(Exception)
    def _unexpected(e: Exception):
        log.exception("unhandled error", extra={"path": request.path, "request_id": getattr(g, "request_id", None)})
        return APIError(500, f"internal error in the engine node (request {getattr(g, 'request_id', '?')})",
                        code="internal_error").response()
