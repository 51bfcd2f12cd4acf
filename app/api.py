"""The OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, /v1/models.

A generation request goes: authenticate (app/auth) → requests-per-minute (app/limits,
before the view) → validate the body (app/params) → resolve the model (app/catalog) →
latency class (app/priority) → reserve tokens (app/limits) → pick a node and forward,
failing over before the first token (app/router, app/node_client) → answer as JSON or as
server-sent events → settle the token reservation with the real usage and record metrics.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Iterator, Mapping

from flask import Blueprint, Response, current_app, g, jsonify, request
from werkzeug.wsgi import ClosingIterator

from app import params, prompt_batch, structured, tool_params
from app.auth import login_required
from app.catalog import Catalog
from app.config import GatewayConfig
from app.errors import CLIENT_CLOSED, model_not_found, unexpected_error
from app.inference import InferenceRequest, PromptInput, sampling_params
from app.limits import TokenLimiter, request_limit_headers, token_headers
from app.metrics import GatewayMetrics
from app.org_share import CONCURRENCY_KEY
from app.node_client import PING, NodeClient, NodeStream, NodeStreamError, collect_result
from app.priority import (AUTO_TIER, LATENCY_CLASS_HEADER, SERVICE_TIERS, ConflictingTier, latency_class_for,
                          service_tier)
from app.prompt_batch import PromptBatch
from app.responses import (CHAT, COMPLETIONS, SSE_DONE, ChunkWriter, chat_completion,
                           text_completion, usage_of)
from app.tracing import record_status, record_stream_end, request_span
from engine.client_socket import ClientGone, client_gone
from engine.protocol import NODE_SHUTDOWN, ORG_QUEUE_FULL, APIError, bad_value, parse_json, sse_error_event
from engine.request_body import request_body

log = logging.getLogger("zen.gateway")
bp = Blueprint("api", __name__, url_prefix="/v1")
NODE_QUEUE_LIMIT = "node_queue"   # the limit label of a 429 for the org's share of the nodes' queues


def _config() -> GatewayConfig:
    return current_app.extensions["zen.config"]


def _catalog() -> Catalog:
    return current_app.extensions["zen.catalog"]


def _tokens() -> TokenLimiter:
    return current_app.extensions["zen.tokens"]


def _metrics() -> GatewayMetrics:
    return current_app.extensions["zen.metrics"]


def _nodes() -> NodeClient:
    return current_app.extensions["zen.nodes"]


def read_json_body() -> Mapping[str, Any]:
    """The request's JSON object; 400 when it is not one, 413 when it is too large."""
    raw = request_body()
    if not raw:
        raise bad_value("The request body is empty; send a JSON object", None, "invalid_json")
    try:
        body = parse_json(raw)
    except ValueError:   # not JSON, nested too deeply, a lone surrogate
        raise bad_value("We could not parse the JSON body of your request", None,
                        "invalid_json") from None
    return params.check_object(body)


# -- models --------------------------------------------------------------------------------------

@bp.get("/models")
@login_required
def list_models():
    models = _catalog().visible_to(g.caller.tier, _nodes().pool.servable_models())
    return jsonify({"object": "list", "data": [Catalog.model_object(m) for m in models]})


@bp.get("/models/<path:model>")
@login_required
def retrieve_model(model: str):
    """A model of the tier's catalog that every node, all up, says it cannot serve is not found, as a
    request for it is (a node down might serve it: the list, of what can be served now, leaves it out)."""
    resolved = _catalog().resolve(model, g.caller.tier)
    if _nodes().pool.lists_nowhere(resolved.model):
        raise model_not_found(model)
    return jsonify(Catalog.model_object(resolved))


# -- generation ----------------------------------------------------------------------------------

@bp.post("/chat/completions")
@login_required
def chat_completions():
    return _generate(read_json_body(), CHAT)


@bp.post("/completions")
@login_required
def completions():
    return _generate(read_json_body(), COMPLETIONS)


def build_request(body: Mapping[str, Any], kind: str) -> tuple[InferenceRequest, bool, int | None]:
    """Validate `body` into r = (m, x, θ, τ); also (include_usage, logprobs_top)."""
    caller = g.caller
    config = _config()
    params.check_unsupported(body, kind)
    alias = params.require_model(body)
    constraint, g.constraint_param = structured.structured_output(body)
    tools = tool_params.NO_TOOLS
    if kind == CHAT:
        tools = tool_params.tool_plan(body, constraint is not None)
        if tools.constraint:
            constraint, g.constraint_param = tools.constraint, "tools"
        batch = [PromptInput(messages=params.messages(body), tools=tools.tools)]
        logprobs = params.chat_logprobs(body)
    else:
        batch = [PromptInput(prompt=text) if ids is None else PromptInput(prompt_token_ids=ids)
                 for text, ids in params.prompts(body)]
        logprobs = params.completion_logprobs(body)
    stream, include_usage = params.stream_flags(body)
    n = params.number(body, "n", maximum=config.server.max_n)
    if len(batch) > config.server.max_prompts:
        raise bad_value(f"`prompt` holds {len(batch)} prompts, more than this server's "
                        f"{config.server.max_prompts} per request", "prompt")
    best_of = body.get("best_of")
    if kind == COMPLETIONS and best_of is not None and (isinstance(best_of, bool) or best_of != n):   # True == 1
        raise bad_value("`best_of` other than `n` is not supported", "best_of",
                        "unsupported_parameter")
    sampling = {f: params.number(body, f) for f in
                ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "seed")}
    stop = params.stop_sequences(body)
    stop_ids = params.stop_token_ids(body)
    bias = params.logit_bias(body)
    flags = {"ignore_eos": params.boolean(body, "ignore_eos"),
             "skip_special_tokens": params.boolean(body, "skip_special_tokens", True),
             "include_stop_str_in_output": params.boolean(body, "include_stop_str_in_output")}
    params.string(body, "user")
    tier = params.one_of(body, "service_tier", (AUTO_TIER, *SERVICE_TIERS))

    model = _catalog().resolve(alias, caller.tier)
    if kind == CHAT:
        model.check_chat()
    max_tokens, max_param = params.max_tokens(body, model.max_context, model.default_max_tokens)
    g.max_tokens_param = max_param
    min_tokens = params.number(body, "min_tokens", maximum=max_tokens)
    known = [len(x.prompt_token_ids) for x in batch if x.prompt_token_ids is not None]
    if known and max_param is None:   # a default fits what the longest prompt leaves
        max_tokens = max(1, min_tokens, min(max_tokens, model.max_context - max(known)))
    if known and max(known) + max_tokens > model.max_context:
        raise APIError(400, f"This model's maximum context length is {model.max_context} tokens. "
                            f"However, you requested {max(known) + max_tokens} "
                            f"tokens ({max(known)} in the prompt, {max_tokens} "
                            f"in the completion).", param="prompt", code="context_length_exceeded")
    try:
        latency_class = latency_class_for(request.headers.get(LATENCY_CLASS_HEADER),
                                          caller.max_latency_class, caller.default_latency_class, tier)
    except ConflictingTier as exc:
        raise bad_value(str(exc), "service_tier") from None
    except ValueError as exc:
        raise bad_value(f"`{LATENCY_CLASS_HEADER}` header {exc}", LATENCY_CLASS_HEADER) from None
    entries = len(batch) * n * max_tokens * ((logprobs or 0) + 1)
    if logprobs is not None and not stream and entries > config.server.max_logprob_entries:
        # a JSON answer is built whole in the gateway's memory: ~0.7 KB a logprob entry
        raise bad_value(f"An answer that does not stream may hold at most {config.server.max_logprob_entries} "
                        f"logprob entries (prompts x n x max_tokens x (alternatives + 1)); this request asks "
                        f"for {entries}: stream it, or lower max_tokens, n or the alternatives",
                        "top_logprobs" if kind == CHAT else "logprobs")
    theta = sampling_params(max_tokens=max_tokens, max_tokens_default=max_param is None, min_tokens=min_tokens, stop=stop,
                            stop_token_ids=stop_ids, logit_bias=bias, n=n, logprobs=logprobs,
                            structured_output=constraint, **flags, **sampling)
    req = InferenceRequest(model=model, inputs=batch[0], params=theta, latency_class=latency_class,
                           org=caller.org, request_id=g.request_id, stream=stream, tool_calls=tools.parse,
                           batch=tuple(batch) if len(batch) > 1 else ())
    return req, include_usage, logprobs


def _generate(body: Mapping[str, Any], kind: str) -> Response:
    req, include_usage, logprobs_top = build_request(body, kind)
    g.log_fields.update(model=req.model.alias, latency_class=req.latency_class.label,
                        stream=req.stream)
    try:
        release = current_app.extensions[CONCURRENCY_KEY].acquire(req.org)   # its thread, until it is answered
    except APIError:
        g.limited_by = "concurrency"
        raise
    try:
        resp = _admitted(req, kind, include_usage, logprobs_top)
    except BaseException:
        release()
        raise
    if resp.is_streamed:
        resp.call_on_close(release)
    else:
        release()
    return resp


def _admitted(req: InferenceRequest, kind: str, include_usage: bool, logprobs_top: int | None) -> Response:
    """The request's answer, once its org has a thread for it: tokens reserved, a node, the answer."""
    try:
        cost = req.token_cost()
        with request_span("limits.tokens", lambda: {"zen.org": req.org, "zen.tokens_reserved": cost}):
            reservation = _tokens().reserve(req.org, g.caller.tier, cost)
    except APIError as exc:
        if exc.status == 429:
            g.limited_by = "tokens"
        raise
    g.token_limit_headers = token_headers(reservation.result)
    started = g.started
    sock = request.environ.get("gunicorn.socket")
    if req.stream and sock is not None:   # a client that reads nothing for this long ends its stream
        sock.settimeout(_config().server.write_timeout_s)   # (gunicorn clears it for the next request)
    gone = lambda: client_gone(sock)  # noqa: E731
    if not _config().limits.uses_redis:
        # a store in this process or on its disk: CPU work, done before the node's kernels start on the
        # same cores (read after the send, it lengthened the node's prefill; docs/serving.md)
        request_limit_headers()

    outcome = None
    try:
        outcome = prompt_batch.send(_nodes(), req)
        try:
            # While the node reads the request the gateway's core is idle: a Redis store's round trip
            # for the limit headers waits here (a local store's were read above), and a stream's answer
            # is returned now, its status settled by the node's answer in its first iteration: Flask's
            # and gunicorn's work on the response is done before the node computes, not during.
            request_limit_headers()
            if req.stream:
                return _answer_stream(req, kind, outcome, reservation, include_usage, logprobs_top, started,
                                      gone)
            outcome.accept()
            result = collect_result(outcome, gone)
        except BaseException:
            outcome.close()
            raise
        finally:
            if not req.stream:
                g.log_fields.update(node=outcome.node, node_attempts=outcome.attempts)
        return _answer_json(req, kind, outcome.node, result, reservation, logprobs_top, started)
    except ClientGone:
        _settle_cut_short(req, outcome, reservation, started, client_left=True)
        g.log_fields.update(client="gone")
        return Response(status=CLIENT_CLOSED)   # nobody reads it; the node's sequence is aborted
    except NodeStreamError as exc:
        _settle_cut_short(req, outcome, reservation, started)
        failure = stream_failure(exc)
        _name_prompt_param(failure, kind, g.max_tokens_param, g.constraint_param)
        raise failure from None
    except APIError as exc:
        _refund(reservation)
        _name_prompt_param(exc, kind, g.max_tokens_param, g.constraint_param)
        if exc.code == ORG_QUEUE_FULL:
            g.limited_by = NODE_QUEUE_LIMIT
        raise
    except BaseException:
        _refund(reservation)
        raise


def _refund(reservation) -> None:
    """Give the whole reservation back (no node served the request); the answer's token headers say so."""
    result = _tokens().settle(reservation, 0)
    if result is not None:
        g.token_limit_headers = token_headers(result)


def stream_failure(exc: NodeStreamError) -> APIError:
    """The client's error for a node stream that failed: the node's own refusal of the request (400, or
    409 for a request id in use), a node that shut down (503: retry at once), or a failed node (502)."""
    if exc.refused:
        status = 409 if exc.code == "duplicate_request_id" else 400
        return APIError(status, str(exc), param=exc.param, code=exc.code, type="invalid_request_error")
    if exc.code == NODE_SHUTDOWN:
        return APIError(503, f"The engine node shut down during generation: {exc}", type="server_error",
                        code=NODE_SHUTDOWN, headers={"Retry-After": "1"})
    return APIError(502, f"The engine node failed during generation: {exc}", code="engine_error")


def _cut_short_usage(req: InferenceRequest, completion_tokens: int, client_left: bool = False,
                     counted: int | None = None) -> dict:
    """What a request cut short has used: its prompt (as the node counted it, else the estimate) and the
    tokens it got; nothing when the nodes failed it before its first token, like a request refused before
    it started. A client that left once a node had taken the request pays its prompt: the node may have
    computed it (else leaving before the first token would make long prompts free)."""
    prompt = (req.estimated_tokens if counted is None else counted) if completion_tokens or client_left else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens}


def _settle_usage(tokens: TokenLimiter, metrics: GatewayMetrics, req: InferenceRequest, reservation,
                  usage: dict, e2e_s: float) -> None:
    """Charge the org's bucket what the request used, and count it (a JSON answer's or a stream's)."""
    tokens.settle(reservation, usage["total_tokens"])
    if usage["total_tokens"]:
        metrics.usage(req.org, req.model.alias, usage["prompt_tokens"], usage["completion_tokens"])
        metrics.latency(req.model.alias, req.latency_class.label, e2e_s=e2e_s)


def _settle_cut_short(req: InferenceRequest, outcome: NodeStream | PromptBatch | None, reservation,
                      started: float, client_left: bool = False) -> None:
    read, counted = (outcome.tokens_read, outcome.prompt_tokens) if outcome is not None else (0, None)
    _settle_usage(_tokens(), _metrics(), req, reservation, _cut_short_usage(req, read, client_left, counted),
                  time.perf_counter() - started)


def _name_prompt_param(exc: APIError, kind: str, max_tokens_param: str | None,
                       constraint_param: str | None) -> None:
    """A node's error names the request's own parameters: messages or prompt, max_completion_tokens
    where the client sent that rather than max_tokens (the node knows only max_tokens), and the field the
    constraint came in (the node knows only structured_output)."""
    if exc.param in ("prompt", "messages", "prompt_token_ids") or (
            exc.code == "context_length_exceeded" and exc.param not in ("max_tokens", "min_tokens")):
        exc.param = "messages" if kind == CHAT else "prompt"
    elif exc.param == "max_tokens" and max_tokens_param == "max_completion_tokens":
        exc.param = "max_completion_tokens"
        exc.message = exc.message.replace("max_tokens", "max_completion_tokens")
    elif exc.param == "structured_output" and constraint_param:
        exc.param = constraint_param


class AcceptedStream(Response):
    """A streaming answer returned before the node accepted the request: its first iteration waits for
    the node's answer (`accept`); when no node takes the request, the client gets the HTTP error the
    view would have answered (`refused` turns the exception into it and records it), with the
    response's limit headers but not the stream's own."""

    def __init__(self, body: Any, accept: Callable[[], None], refused: Callable[[Exception], APIError],
                 **kwargs: Any) -> None:
        super().__init__(body, **kwargs)
        self._accept, self._refused = accept, refused

    def __call__(self, environ: dict, start_response: Callable) -> Any:
        app_iter, status, headers = self.get_wsgi_response(environ)
        return ClosingIterator(self._iterate(environ, app_iter, status, headers, start_response),
                               app_iter.close)

    def _iterate(self, environ: dict, app_iter: Any, status: str, headers: list,
                 start_response: Callable) -> Iterator[bytes]:
        # WSGI lets the first iteration call start_response: nothing has been sent yet
        try:
            self._accept()
        except Exception as error:   # noqa: BLE001 (as the app's error handlers: nothing else reaches a client)
            exc = self._refused(error)
            answer = Response(json.dumps(exc.body()), exc.status, mimetype="application/json")
            for key, value in headers:
                if key.lower() not in _STREAM_HEADERS:
                    answer.headers.add(key, value)
            answer.headers.update(exc.headers)
            app_iter, status, headers = answer.get_wsgi_response(environ)
        start_response(status, headers)
        for chunk in app_iter:   # not `yield from`: it would close app_iter too, which ClosingIterator does
            yield chunk


_STREAM_HEADERS = ("content-type", "content-length", "cache-control", "x-accel-buffering", "x-latency-class")


def _answer_json(req: InferenceRequest, kind: str, node: str, result: dict, reservation,
                 logprobs_top: int | None, started: float) -> Response:
    build = chat_completion if kind == CHAT else text_completion
    m = req.model
    body = build(req.request_id, m.alias, m.model, m.quantization, result, logprobs_top, req.tool_calls,
                 service_tier(req.latency_class))
    usage = body["usage"]
    metrics = _metrics()
    _settle_usage(_tokens(), metrics, req, reservation, usage, time.perf_counter() - started)
    if result.get("first_token_at") is not None:   # from the request's arrival, as a stream's: routing included
        metrics.latency(m.alias, req.latency_class.label, ttft_s=result["first_token_at"] - started)
    g.log_fields.update(prompt_tokens=usage["prompt_tokens"],
                        completion_tokens=usage["completion_tokens"])
    resp = jsonify(body)
    resp.headers["x-latency-class"] = req.latency_class.label
    return resp


def _answer_stream(req: InferenceRequest, kind: str, outcome: NodeStream | PromptBatch, reservation,
                   include_usage: bool, logprobs_top: int | None, started: float,
                   gone: Callable[[], bool]) -> Response:
    m = req.model
    writer = ChunkWriter(kind, req.request_id, m.alias, m.model, m.quantization, req.num_choices,
                         include_usage, logprobs_top, req.tool_calls, service_tier(req.latency_class))
    tokens, metrics = _tokens(), _metrics()
    endpoint = request.endpoint
    log_fields = {"event": "request", "method": request.method, "path": request.path,
                  "request_id": req.request_id, "org": req.org, **g.log_fields}

    result = {"status": 200, "usage": None, "completion_tokens": 0}   # what finish() reports
    trace, max_tokens_param, constraint_param = g.get("trace"), g.max_tokens_param, g.constraint_param

    def generate():
        last_token_at = None
        # The chat role chunk goes out with the first chunk after it: alone, its write and its reader's
        # wake-up take a core from the node's prefill (docs/serving.md).
        opening = "".join(writer.start())
        try:
            # The node accepted the request (AcceptedStream): the headers go out now, as the node starts
            # on it, so that the first token's path is short.
            yield ""
            for event in outcome.events():
                kind_ = event.get("type")
                if kind_ == "token":
                    now = time.perf_counter()
                    first = result["completion_tokens"] == 0
                    result["completion_tokens"] += 1
                    if first:
                        yield opening + writer.token(event)
                        opening = ""
                    else:
                        yield writer.token(event)
                    # recorded once the chunk is out: the histograms are not on the token's path
                    if first:
                        metrics.latency(m.alias, req.latency_class.label, ttft_s=now - started)
                    elif event.get("index", 0) == 0 and last_token_at is not None:
                        metrics.latency(m.alias, req.latency_class.label, itl_s=now - last_token_at)
                    if event.get("index", 0) == 0:
                        last_token_at = now
                elif kind_ == "finish":    # one prompt of a PromptBatch ended
                    yield opening + "".join(writer.finish(event["choices"]))
                    opening = ""
                elif kind_ == "done":
                    result["usage"] = usage_of(event.get("usage"))
                    yield opening + "".join(writer.done(event))
                elif event is PING and gone():   # the node's heartbeat: a moment to look at the client
                    result["status"] = CLIENT_CLOSED
                    return
            yield SSE_DONE
        except NodeStreamError as exc:
            failure = stream_failure(exc)
            # the node's refusal of the request (a 400 or 409) is the client's error, not a failed stream
            result["status"] = failure.status if exc.refused else "stream"
            log.warning("engine stream failed after the first token", extra={
                "event": "stream_error", "request_id": req.request_id, "org": req.org,
                "node": outcome.node, "error": str(exc), "status": result["status"]})
            _name_prompt_param(failure, kind, max_tokens_param, constraint_param)
            yield sse_error_event(failure.message, type=failure.type, code=failure.code, param=failure.param)
            yield SSE_DONE
        except APIError as exc:   # the node failed before the first token, and no other took over
            result["status"] = exc.status
            log.warning("no engine node took the stream over", extra={
                "event": "stream_error", "request_id": req.request_id, "org": req.org,
                "error": exc.message})
            yield sse_error_event(exc.message, type=exc.type, code=exc.code, param=exc.param)
            yield SSE_DONE
        except GeneratorExit:
            result["status"] = CLIENT_CLOSED
            outcome.close()   # at once: the node aborts the sequence
            raise

    def finish():
        # After the response's last byte went out (the server closes the response then): the
        # bookkeeping, and the read of the node's last bytes that frees its connection for reuse,
        # do not hold back the end of the client's stream.
        ended = time.perf_counter()
        outcome.close()
        usage = result["usage"] or _cut_short_usage(req, result["completion_tokens"],
                                                    result["status"] == CLIENT_CLOSED, outcome.prompt_tokens)
        _settle_usage(tokens, metrics, req, reservation, usage, ended - started)
        metrics.request_done(req.org, endpoint, result["status"])
        if trace is not None:
            record_stream_end(trace, outcome.node, result["status"])
        log.info("request", extra={
            **log_fields, "node": outcome.node, "node_attempts": outcome.attempts,
            "status": result["status"], "duration_ms": round((ended - started) * 1e3, 3),
            "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"]})

    def refused(error: Exception) -> APIError:
        # no node took the request: the error the view would have raised, with finish()'s bookkeeping
        exc = error if isinstance(error, APIError) else unexpected_error(req.request_id)
        _name_prompt_param(exc, kind, max_tokens_param, constraint_param)
        bucket = tokens.settle(reservation, 0)   # given back now: the answer's token headers show it
        if bucket is not None:
            exc.headers.update(token_headers(bucket))
        result["status"] = exc.status
        if exc.code == ORG_QUEUE_FULL:
            metrics.limited(req.org, NODE_QUEUE_LIMIT)
        if trace is not None:
            record_status(trace, exc.status)
        return exc

    resp = AcceptedStream(generate(), outcome.accept, refused, mimetype="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                   "x-latency-class": req.latency_class.label})
    resp.call_on_close(finish)
    return resp
