"""The node's HTTP endpoints (a Blueprint): health, ready, metrics, state, models, load/unload, generate,
tokenize/detokenize."""
from __future__ import annotations

import time
from typing import Any

from flask import Blueprint, Response, current_app, g, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST

from engine.node.generation import SSEBody, collect, model_not_found, prompt_token_ids, unavailable
from engine.node.node import Node
from engine.node.registry import ModelBusy, ModelNotFound, ModelUnavailable
from engine.node.tracing import EXTENSION_KEY as TRACING_KEY, GenerationTrace
from engine.protocol import (PROMPT_TOKENS_HEADER, APIError, DetokenizeRequest, GenerateRequest, TokenizeRequest,
                             bad_value, optional_str, parse_json)
from engine.request_body import request_body
from models.inspect import check_quantization

bp = Blueprint("node", __name__)


def the_node() -> Node:
    return current_app.extensions["zen_node"]


def json_body() -> Any:
    raw = request_body()
    try:
        return parse_json(raw)
    except ValueError as e:   # UnicodeDecodeError too
        raise bad_value(f"the request body is not valid JSON: {e}", None, "invalid_json") from None


NOT_READY_REASONS = {
    "loading": "the start-up models are still loading",
    "draining": "the node is shutting down: it finishes what it has and takes nothing new",
    "stopping": "the node is stopping",
    "unhealthy": "an engine loop has failed",
    "preload_failed": "start-up models failed to load (their errors: GET /v1/models); a later load that "
                      "succeeds makes the node ready",
}
PROBE_RETRY_AFTER_S = "2"


def _not_ready(status: str) -> Response:
    body = {"status": status, "reason": NOT_READY_REASONS[status]}
    if status == "preload_failed":
        body["models"] = the_node().failed_startup_models()
    resp = jsonify(body)
    resp.status_code = 503
    resp.headers["Retry-After"] = PROBE_RETRY_AFTER_S
    return resp


@bp.get("/health")
def health():
    """Liveness: 200 while the node serves and no engine loop has failed (loading and draining too)."""
    why = the_node().liveness()
    return _not_ready(why) if why else jsonify({"status": "ok"})


@bp.get("/ready")
def ready():
    """Readiness: 200 once the start-up models are in (none failed), while the node is alive and not draining."""
    why = the_node().readiness()
    return _not_ready(why) if why else jsonify({"status": "ready"})


@bp.get("/metrics")
def metrics():
    return Response(the_node().metrics.render(), mimetype=CONTENT_TYPE_LATEST)


@bp.get("/state")
def state():
    return jsonify(the_node().state().to_json())


@bp.get("/v1/models")
def models():
    n = the_node()
    resident = n.registry.resident()
    data = []
    for model_id in n.registry.available():
        mine = [m for m in resident if m.id == model_id]
        data.append({"id": model_id, "object": "model", "created": int(n.started_at), "owned_by": "zen-node",
                     "resident": bool(mine), "quantizations": sorted(m.quantization for m in mine),
                     "last_error": n.registry.last_error.get(model_id)})
    return jsonify({"object": "list", "data": data})


def _model_body() -> tuple[str, str | None]:
    body = json_body()
    if not isinstance(body, dict):
        raise bad_value("the request body must be a JSON object", None, "invalid_json")
    model = optional_str(body, "model")
    if not model:
        raise bad_value("model is required", "model", "missing_required_parameter")
    try:
        quant = check_quantization(optional_str(body, "quantization") or None)
    except ValueError as e:
        raise bad_value(str(e), "quantization") from None
    return model, quant


@bp.post("/v1/models/load")
def load_model():
    n = the_node()
    model, quant = _model_body()
    try:
        m = n.registry.load(model, quant, n.config.load_wait_s)
    except ModelNotFound as e:
        raise model_not_found(e) from None
    except ModelUnavailable as e:
        raise unavailable(str(e), e.code, e.retry_after) from None
    return jsonify({"status": "loaded", "model": m.id, "quantization": m.quantization, "bytes": m.bytes,
                    "load_time_s": round(m.load_time_s, 4)})


@bp.post("/v1/models/unload")
def unload_model():
    n = the_node()
    model, quant = _model_body()
    try:
        gone = n.registry.unload(model, quant)
    except ModelNotFound as e:
        raise model_not_found(e) from None
    except ModelBusy as e:
        raise APIError(409, str(e), param="model", code="model_busy") from None
    if not gone:
        raise APIError(404, f"the model {model!r} is not resident", param="model", code="model_not_loaded")
    return jsonify({"status": "unloaded", "unloaded": [{"id": m.id, "quantization": m.quantization}
                                                       for m in gone]})


@bp.post("/v1/generate")
def generate():
    received = time.monotonic()
    call = GenerateRequest.from_json(json_body(), check_quantization)
    g.request_id, g.org = call.request_id, call.org
    gen = the_node().submit(call, received, request.environ.get("gunicorn.socket"))
    tracing = current_app.extensions.get(TRACING_KEY)
    if tracing is not None:
        gen.trace = GenerationTrace(tracing, request.headers)
    if call.stream:
        return Response(SSEBody(gen), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                 PROMPT_TOKENS_HEADER: str(len(gen.req.prompt_token_ids))})
    return collect(gen)


def _acquired(model: str, quantization: str | None):
    """The resident model (loaded if need be); release it with registry.release."""
    n = the_node()
    try:
        quantization = check_quantization(quantization)
        return n.registry.acquire(model, quantization, n.config.load_wait_s)
    except ValueError as e:
        raise bad_value(str(e), "quantization") from None
    except ModelNotFound as e:
        raise model_not_found(e) from None
    except ModelUnavailable as e:
        raise unavailable(str(e), e.code, e.retry_after) from None


@bp.post("/tokenize")
def tokenize():
    call = TokenizeRequest.from_json(json_body())
    m = _acquired(call.model, call.quantization)
    try:
        tok = m.engine.tokenizer
        ids = prompt_token_ids(tok, call.prompt, call.messages, call.add_special_tokens,
                               call.add_generation_prompt, tools=call.tools, chat_template=call.chat_template)
        return jsonify({"count": len(ids), "max_model_len": m.engine.max_model_len, "tokens": ids,
                        "token_strs": [tok.token_text(t) for t in ids] if call.return_token_strs else None})
    finally:
        the_node().registry.release(m)


@bp.post("/detokenize")
def detokenize():
    call = DetokenizeRequest.from_json(json_body())
    m = _acquired(call.model, call.quantization)
    try:
        try:
            return jsonify({"prompt": m.engine.tokenizer.decode(call.tokens, skip_special_tokens=False)})
        except ValueError as e:   # a token id past the vocabulary
            raise bad_value(str(e), "tokens") from None
    finally:
        the_node().registry.release(m)
