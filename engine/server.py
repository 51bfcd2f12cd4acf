"""The engine node's HTTP service: generation, node state, health, metrics and model management.

One gunicorn worker (the process that owns the device) with threads for concurrent streams. Each
resident model has its own EngineLoop (engine/registry.py); a request thread validates and
tokenizes, submits to the model's loop, then reads the request's deltas and writes them back as JSON
or as server-sent events. A client that goes away (the socket reads EOF, or a write fails and the
WSGI iterable is closed) cancels its request, whose blocks go back to the pool at once.

Protocol (the gateway in app/node_client.py speaks it): every endpoint but GET /health and
GET /metrics needs the header `X-Node-Secret`; errors are OpenAI's shape
{"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import hmac
import json
import logging
import math
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from flask import Flask, Response, current_app, g, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics
from werkzeug.exceptions import HTTPException

from engine.connection import client_gone
from engine.config import EngineConfig
from engine.engine import RequestError
from engine.metrics import FinishedSequence, ModelSnapshot, NodeMetrics, NodeSnapshot
from engine.node_config import ModelSpec, NodeConfig
from engine.registry import ModelBusy, ModelNotFound, ModelRegistry, ModelUnavailable, ResidentModel
from engine.request import InferenceRequest, LatencyClass
from engine.sampling import SamplingParamError, SamplingParams
from engine.scheduler import SchedulerConfig
from engine.telemetry import Telemetry, host_memory_available
from models.quant import FORMATS

log = logging.getLogger("engine.node")

OPEN_PATHS = ("/health", "/metrics")       # everything else needs X-Node-Secret
SECRET_HEADER = "X-Node-Secret"
POLL_S = 0.2                               # how often a waiting request thread checks its client
HEARTBEAT_S = 1.0                          # a stream without tokens this long sends an SSE comment
MAX_BODY_BYTES = 16 << 20
# How long a thread running Python may keep the GIL while another waits (CPython's default: 5 ms). An
# engine step takes and gives back the GIL several times (its Python parts, kernels that release it);
# behind a busy thread (a cold load, request parsing) every hand-back could cost a full interval,
# which stretched steps of 1-5 ms into tens of milliseconds.
GIL_SWITCH_INTERVAL_S = 0.0005
# How many times a kernel thread of libgomp (numba's OpenMP layer) spins at the end of a parallel region
# before it sleeps. libgomp's default, 300,000, kept a core busy for about 8 ms after every last step
# of a burst on the 2-core test machine: the core the gateway and the clients beside the node need just
# then, to send the next request. 30,000 (under 1 ms there) still covers the gap between two steps.
OPENMP_SPINCOUNT = "30000"
# Where the kernel threads run: bound one to a CPU (libgomp's OMP_PROC_BIND) when they are as many as the
# CPUs the node may use. Unbound, a thread that other work (the gateway, the clients, the node's own
# HTTP threads) preempted could be moved to the other core's queue, and the whole parallel region then
# waited for it at the barrier: on the 2-core test machine binding gave 5-11% more tokens/s at 1, 16
# and 64 streams and a first token 1-2 ms sooner.
OPENMP_PROC_BIND = "close"
SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)
_STANDARD_LOG_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


# ------------------------------------------------------------------------------------------ errors

_TYPE_BY_STATUS = {401: "authentication_error", 429: "rate_limit_exceeded"}


class APIError(Exception):
    """An error answered in OpenAI's shape with `status` (and headers such as Retry-After)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})
        self.type = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        resp = jsonify(self.body())
        resp.status_code = self.status
        resp.headers.update(self.headers)
        return resp


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str, retry_after: int = 1) -> APIError:
    return APIError(503, message, code=code, headers={"Retry-After": str(max(1, int(retry_after)))})


# -------------------------------------------------------------------------------------------- logs

class JsonFormatter(logging.Formatter):
    """One JSON object a line; `extra` fields become keys (request_id, org, model, event, ...)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        for key, value in vars(record).items():
            if key not in _STANDARD_LOG_ATTRS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("engine")
    logger.handlers = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


# ------------------------------------------------------------------------------------ backpressure

class Admission:
    """The node's bounded waiting queue: sequences accepted that have not produced a token yet."""

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self.waiting = 0
        self.by_model: dict[tuple[str, str], int] = {}

    def would_refuse(self, n: int) -> bool:
        return self.waiting > 0 and self.waiting + n > self.max_waiting

    def admit(self, key: tuple[str, str], n: int) -> "Ticket | None":
        """A ticket for n sequences, or None when the queue is full (a request larger than the bound
        is taken only into an empty queue)."""
        with self._lock:
            if self.would_refuse(n):
                return None
            self.waiting += n
            self.by_model[key] = self.by_model.get(key, 0) + n
            return Ticket(self, key, n)

    def _release(self, key: tuple[str, str], n: int) -> None:
        with self._lock:
            self.waiting -= n
            self.by_model[key] -= n
            if not self.by_model[key]:
                del self.by_model[key]


class Ticket:
    def __init__(self, admission: Admission, key, n: int):
        self.admission, self.key, self.pending = admission, key, n

    def started(self) -> None:
        """One sequence produced its first delta: it no longer waits."""
        if self.pending > 0:
            self.pending -= 1
            self.admission._release(self.key, 1)

    def close(self) -> None:
        if self.pending > 0:
            n, self.pending = self.pending, 0
            self.admission._release(self.key, n)


# ---------------------------------------------------------------------------------------- the node

class Node:
    """Everything the app serves from: config, registry, metrics, telemetry, admission."""

    def __init__(self, config: NodeConfig, telemetry: Telemetry | None = None):
        self.config = config
        self.telemetry = telemetry or Telemetry()
        self.admission = Admission(config.max_waiting)
        self.metrics = NodeMetrics(config.max_org_labels, self.snapshot)
        budget = config.memory_budget_bytes or self._default_budget()
        self.registry = ModelRegistry(config.models, budget, self.engine_config,
                                      on_loaded=self._on_loaded, on_evicted=self._on_evicted)
        self.ready = threading.Event()
        self.closing = False
        self.started_at = time.time()

    def _default_budget(self) -> int:
        """Without --memory-budget: 90% of the GPU's memory, or 80% of the host memory available now."""
        if self.telemetry.is_gpu:
            return int(self.telemetry.sample().memory_total_bytes * 0.9)
        return int(host_memory_available() * 0.8)

    def engine_config(self, spec: ModelSpec, quantization: str | None) -> EngineConfig:
        c = self.config
        return EngineConfig(
            model=spec.path, model_id=spec.id, quantization=quantization, backend=c.backend,
            block_size=c.block_size, kv_cache_bytes=c.kv_cache_bytes, max_model_len=c.max_model_len,
            scheduler=SchedulerConfig(max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                                      max_waiting=c.max_waiting))

    def _on_loaded(self, m: ResidentModel) -> None:
        m.loop.step_listeners.append(self.metrics.step_listener(m.id, m.quantization))
        m.loop.step_listeners.append(StreamRate(m))
        self.metrics.model_loaded(m.id, m.quantization, m.load_time_s)

    def _on_evicted(self, m: ResidentModel) -> None:
        self.metrics.model_evicted(m.id, m.quantization)

    def start(self) -> None:
        """Load the start-up models in the background; /health answers 503 until they are in."""
        def run():
            try:
                self.registry.preload(self.config.preload)
            finally:
                self.ready.set()
                log.info("node ready", extra={"event": "node_ready", "node_id": self.config.node_id,
                                              "models": [f"{m.id}:{m.quantization}" for m in self.registry.resident()]})
        threading.Thread(target=run, name="preload", daemon=True).start()

    def close(self) -> None:
        self.closing = True
        self.registry.close()
        self.telemetry.close()

    @property
    def healthy(self) -> bool:
        return self.ready.is_set() and not self.closing and all(
            m.loop.failed is None for m in self.registry.resident())

    # ---- state
    def snapshot(self) -> NodeSnapshot:
        models = []
        for m in self.registry.resident():
            e = m.engine
            models.append(ModelSnapshot(
                m.id, m.quantization, e.num_running, e.num_waiting, e.pool.usage, e.pool.prefix_query_tokens,
                e.pool.prefix_hit_tokens, m.bytes, m.load_time_s, m.loop.utilization()))
        return NodeSnapshot(models, self.telemetry.sample(), self.registry.memory_budget_bytes,
                            self.admission.waiting, self.config.max_waiting, dict(self.registry.last_load_s))

    def state(self) -> dict:
        resident = self.registry.resident()
        tel = self.telemetry.sample()
        models, used_blocks, blocks = [], 0, 0
        for m in resident:
            e, loop = m.engine, m.loop
            used_blocks += e.pool.num_blocks - e.pool.num_free_blocks
            blocks += e.pool.num_blocks
            models.append({
                "id": m.id, "version": m.version, "quantization": m.quantization, "bytes": m.bytes,
                "load_time_s": round(m.load_time_s, 4),
                "prefill_tokens_per_s": round(loop.prefill_tokens_per_s, 2),
                "decode_tokens_per_s": round(m.stream_decode_tokens_per_s, 2),
                "batch_decode_tokens_per_s": round(loop.decode_tokens_per_s, 2),
                "running": e.num_running, "waiting": loop.num_waiting,
                "admitted": self.admission.by_model.get(m.key, 0),
                "kv_cache_usage": round(e.pool.usage, 4), "kv_cache_blocks": e.pool.num_blocks,
                "utilization": round(loop.utilization(), 4), "max_model_len": e.max_model_len,
                "formats": e.formats, "idle_s": round(time.monotonic() - m.last_used, 1),
            })
        return {
            "node_id": self.config.node_id,
            "healthy": self.healthy,
            "ready": self.ready.is_set(),
            "models": models,
            "loading": [{"id": k[0], "quantization": k[1]} for k in self.registry.loading()],
            "available_models": self.registry.available(),
            "utilization": round(max((m.loop.utilization() for m in resident), default=0.0), 4),
            # running and waiting do not overlap (a sequence in its prefill runs); admitted, what
            # max_waiting bounds, counts the sequences without a first token, running or not.
            "queue": {"waiting": sum(x["waiting"] for x in models), "running": sum(x["running"] for x in models),
                      "admitted": self.admission.waiting, "max_waiting": self.config.max_waiting},
            "temperature_c": tel.temperature_c,
            "power_w": tel.power_w,
            "kv_cache_usage": round(used_blocks / blocks, 4) if blocks else 0.0,
            "memory": {"used_bytes": tel.memory_used_bytes, "total_bytes": tel.memory_total_bytes,
                       "budget_bytes": self.registry.memory_budget_bytes,
                       "resident_bytes": sum(m.bytes for m in resident),
                       "process_rss_bytes": tel.process_rss_bytes},
            "accelerator": {"device": tel.device, "utilization": tel.utilization},
            "uptime_s": round(time.time() - self.started_at, 1),
        }


class StreamRate:
    """Step listener: decode tokens per second as one stream sees them (1 / decode-step time), a moving
    average — the rate the gateway's latency estimate divides max_tokens by."""

    def __init__(self, m: ResidentModel):
        self.m = m

    def __call__(self, engine, step_seconds: float, deltas) -> None:
        if step_seconds > 0 and engine.last_batch_size and engine.last_step_tokens == engine.last_batch_size:
            rate = 1.0 / step_seconds
            old = self.m.stream_decode_tokens_per_s
            self.m.stream_decode_tokens_per_s = rate if not old else 0.8 * old + 0.2 * rate


# ------------------------------------------------------------------------------- request parsing

@dataclass
class GenerateCall:
    request_id: str
    model: str
    quantization: str | None
    org: str
    latency_class: LatencyClass
    sampling: SamplingParams
    stream: bool
    queue_timeout_s: float | None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list | None = None


def _opt_str(body: dict, name: str, max_len: int = 256) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad_request(f"{name} must be a string, got {type(v).__name__}", name)
    if len(v) > max_len:
        raise bad_request(f"{name} must be at most {max_len} characters", name)
    return v


def parse_generate(body: Any) -> GenerateCall:
    """Validate the JSON of POST /v1/generate (types and shapes; the model checks come later)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_json")
    request_id = _opt_str(body, "request_id") or "node-" + uuid.uuid4().hex
    model = _opt_str(body, "model")
    if not model:
        raise bad_request("model is required (a model id this node serves)", "model", "missing_required_parameter")
    quantization = _opt_str(body, "quantization") or None
    if quantization is not None and quantization not in FORMATS:
        raise bad_request(f"quantization must be one of {', '.join(FORMATS)}; got {quantization!r}", "quantization")
    org = _opt_str(body, "org") or ""
    try:
        latency_class = LatencyClass.parse(body.get("latency_class") or "standard")
    except ValueError as e:
        raise bad_request(str(e), "latency_class") from None
    given = [k for k in ("prompt", "prompt_token_ids", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise bad_request("give exactly one of prompt, prompt_token_ids, messages"
                          + (f" (got {', '.join(given)})" if given else ""), "prompt", "missing_required_parameter"
                          if not given else "invalid_value")
    call_inputs: dict = {}
    if "prompt" in given:
        if not isinstance(body["prompt"], str):
            raise bad_request(f"prompt must be a string, got {type(body['prompt']).__name__}", "prompt")
        call_inputs["prompt"] = body["prompt"]
    elif "prompt_token_ids" in given:
        ids = body["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad_request("prompt_token_ids must be a list of integers", "prompt_token_ids")
        call_inputs["prompt_token_ids"] = ids
    else:
        if not isinstance(body["messages"], list):
            raise bad_request("messages must be a list of {role, content} objects", "messages")
        call_inputs["messages"] = body["messages"]
    sampling = body.get("sampling")
    if sampling is None:
        sampling = {}
    if not isinstance(sampling, dict):
        raise bad_request(f"sampling must be an object, got {type(sampling).__name__}", "sampling")
    unknown = sorted(set(sampling) - SAMPLING_FIELDS)
    if unknown:
        raise bad_request(f"unknown sampling parameter(s): {', '.join(unknown)}", unknown[0], "unknown_parameter")
    try:
        params = SamplingParams(**sampling)
    except SamplingParamError as e:
        raise bad_request(str(e), e.param) from None
    except (TypeError, ValueError) as e:
        raise bad_request(f"invalid sampling parameters: {e}", "sampling") from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be a boolean, got {type(stream).__name__}", "stream")
    qt = body.get("queue_timeout_s")
    if qt is not None and (isinstance(qt, bool) or not isinstance(qt, (int, float)) or not math.isfinite(qt)
                           or qt <= 0):
        raise bad_request("queue_timeout_s must be a positive number of seconds", "queue_timeout_s")
    return GenerateCall(request_id, model, quantization, org, latency_class, params, stream,
                        None if qt is None else float(qt), **call_inputs)


def tokenize(call: GenerateCall, m: ResidentModel) -> tuple[list[int], str | None]:
    tok = m.engine.tokenizer
    try:
        if call.prompt is not None:
            return tok.encode(call.prompt), call.prompt
        if call.prompt_token_ids is not None:
            return list(call.prompt_token_ids), None
        text = tok.apply_chat_template(call.messages, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False), None
    except ValueError as e:   # malformed messages, a template that refuses them
        raise bad_request(str(e), "messages" if call.messages is not None else "prompt") from None


def json_body() -> Any:
    raw = request.get_data(cache=False)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", None, "invalid_json") from None


# ------------------------------------------------------------------------------------- generation

class ClientGone(Exception):
    pass


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


@dataclass
class Choice:
    index: int
    text: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    times: Any = None
    started: bool = False


class Generation:
    """One submitted request: reads its deltas, keeps what the answer needs, and cleans up once."""

    def __init__(self, node: Node, m: ResidentModel, call: GenerateCall, req: InferenceRequest, stream,
                 ticket: Ticket, sock):
        self.node, self.m, self.call, self.req, self.stream = node, m, call, req, stream
        self.ticket, self.sock = ticket, sock
        self.choices = [Choice(i, logprobs=[] if call.sampling.logprobs is not None else None)
                        for i in range(call.sampling.n)]
        self._closed = False
        self._lock = threading.Lock()

    def deltas(self, heartbeat_s: float | None = None):
        """The request's deltas as they come; ClientGone when the client hangs up first (checked every
        POLL_S, whether deltas flow or not). With heartbeat_s, None is yielded after that long without
        a delta, so a stream can show its reader that it is alive (and learn whether the reader is)."""
        checked = last = time.monotonic()
        while True:
            try:
                d = self.stream.next_delta(timeout=POLL_S)
                if d is None:   # asked once more after the last delta: see RequestStream.next_delta
                    return
            except queue.Empty:
                d = None
            now = time.monotonic()
            if now - checked >= POLL_S:
                checked = now
                if client_gone(self.sock):
                    raise ClientGone()
                if self.node.closing or self.m.loop.failed is not None:
                    raise RuntimeError("the engine stopped serving this model")
            if d is None:
                if heartbeat_s is not None and now - last >= heartbeat_s:
                    last = now
                    yield None
                continue
            last = now
            c = self.choices[d.index]
            if not c.started:
                c.started = True
                self.ticket.started()
            c.token_ids.extend(d.token_ids)
            c.text.append(d.text)
            if c.logprobs is not None:
                c.logprobs.extend(d.logprobs)
            c.times = d.times
            if d.finish_reason is not None:
                c.finish_reason = d.finish_reason
            yield d

    def logprob_entry(self, lp) -> dict:
        tok = self.m.engine.tokenizer
        return {"token_id": lp.token_id, "token": tok.token_text(lp.token_id), "logprob": _finite(lp.logprob),
                "top": [{"token_id": t, "token": tok.token_text(t), "logprob": _finite(v)} for t, v in lp.top]}

    def usage(self) -> dict:
        prompt = len(self.req.prompt_token_ids)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def timings(self) -> dict:
        times = [c.times for c in self.choices if c.times is not None]
        arrival = self.req.arrival_time
        fs = [t.first_scheduled for t in times if t.first_scheduled is not None]
        ft = [t.first_token for t in times if t.first_token is not None]
        fin = [t.finished for t in times if t.finished is not None]
        gaps = [b - a for t in times for a, b in zip(t.token_times, t.token_times[1:])]

        def r(x):
            return None if x is None else round(max(0.0, x), 6)
        return {"queue_s": r(min(fs) - arrival if fs else None),
                "prefill_s": r(min(ft) - min(fs) if ft and fs else None),
                "ttft_s": r(min(ft) - arrival if ft else None),
                "mean_itl_s": r(sum(gaps) / len(gaps) if gaps else (0.0 if ft else None)),
                "total_s": r((max(fin) if fin and len(fin) == len(self.choices) else time.monotonic()) - arrival)}

    @property
    def timed_out_before_start(self) -> bool:
        return all(c.finish_reason == "timeout" and not c.token_ids for c in self.choices)

    def close(self, outcome: str) -> None:
        """Once: cancel if unfinished (its blocks return to the pool), free the queue slot and the lease,
        and record metrics and the log line."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            unfinished = [c for c in self.choices if c.finish_reason is None]
            if unfinished:
                self.stream.cancel()
            self.ticket.close()
            now = time.monotonic()
            metrics, model, cls = self.node.metrics, self.m.id, self.call.latency_class.label
            for c in self.choices:
                t = c.times
                metrics.observe_finished(FinishedSequence(
                    model, cls, self.call.org, c.finish_reason or "abort", self.req.arrival_time,
                    t.first_scheduled if t else None, t.first_token if t else None,
                    list(t.token_times) if t else [], (t.finished if t and t.finished else now)))
            usage = self.usage()
            metrics.count_tokens(model, cls, self.call.org, usage["prompt_tokens"], usage["completion_tokens"])
            log.info("generation", extra={
                "event": "generation", "request_id": self.req.request_id, "org": self.call.org, "model": model,
                "quantization": self.m.quantization, "latency_class": cls, "outcome": outcome,
                "stream": self.call.stream, "finish_reasons": [c.finish_reason or "abort" for c in self.choices],
                **usage, **self.timings()})
        finally:
            self.node.registry.release(self.m)


class SSEBody:
    """The WSGI iterable of a stream. close() — called by the server when the response ends, when a
    write fails or when the client went away — always runs the cleanup, even if iteration never began."""

    def __init__(self, gen: Generation):
        self.gen = gen
        self._it = self._events()

    def __iter__(self):
        return self._it

    def close(self) -> None:
        try:
            self._it.close()
        finally:
            self.gen.close("client_closed")

    @staticmethod
    def _event(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def _events(self):
        gen = self.gen
        outcome = "client_closed"
        yield b""   # sends the headers now: the client knows the node took the request
        try:
            for d in gen.deltas(heartbeat_s=HEARTBEAT_S):
                if d is None:
                    yield b": ping\n\n"   # an SSE comment: readers skip it
                    continue
                chunk = []
                n = len(d.token_ids)
                for j, tid in enumerate(d.token_ids):
                    lp = d.logprobs[j] if j < len(d.logprobs) else None
                    chunk.append(self._event({
                        "type": "token", "index": d.index, "token_id": tid, "text": d.text if j == n - 1 else "",
                        "logprobs": gen.logprob_entry(lp) if lp is not None else None}))
                if not n and d.text:
                    chunk.append(self._event({"type": "token", "index": d.index, "token_id": None,
                                              "text": d.text, "logprobs": None}))
                if chunk:
                    yield b"".join(chunk)
            if gen.timed_out_before_start:
                outcome = "queue_timeout"
                yield self._event({"type": "error", "error": {
                    "message": "the request waited past its queue_timeout_s before it was scheduled",
                    "type": "server_error", "code": "queue_timeout"}})
                return
            outcome = "ok"
            yield self._event({"type": "done", "request_id": gen.req.request_id,
                               "choices": [{"index": c.index, "finish_reason": c.finish_reason} for c in gen.choices],
                               "usage": gen.usage(), "timings": gen.timings()})
        except ClientGone:
            outcome = "client_closed"
        except RequestError as e:
            outcome = "error"
            yield self._event({"type": "error", "error": {"message": str(e), "type": "invalid_request_error",
                                                          "code": e.code or "invalid_value"}})
        except Exception as e:   # noqa: BLE001 — an engine failure ends this stream with an error event
            outcome = "error"
            log.exception("stream failed", extra={"request_id": gen.req.request_id, "org": gen.call.org})
            yield self._event({"type": "error", "error": {"message": f"engine failure: {e}",
                                                          "type": "server_error", "code": "engine_failure"}})
        finally:
            gen.close(outcome)


def collect(gen: Generation) -> Response:
    """Non-streaming: wait for every choice, then answer one JSON body."""
    outcome = "error"
    try:
        for _ in gen.deltas():
            pass
        if gen.timed_out_before_start:
            outcome = "queue_timeout"
            raise unavailable("the request waited past its queue_timeout_s before it was scheduled", "queue_timeout")
        outcome = "ok"
        choices = [{"index": c.index, "text": "".join(c.text), "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                    "logprobs": None if c.logprobs is None else [gen.logprob_entry(lp) for lp in c.logprobs]}
                   for c in gen.choices]
        return jsonify({"request_id": gen.req.request_id, "model": gen.m.id, "quantization": gen.m.quantization,
                        "choices": choices, "usage": gen.usage(), "timings": gen.timings()})
    except ClientGone:
        outcome = "client_closed"
        return Response(status=499)
    except RequestError as e:
        raise _request_error(e) from None
    except RuntimeError as e:   # the model's loop failed, or the node is stopping
        raise unavailable(f"engine failure: {e}", "engine_failure", 5) from None
    finally:
        gen.close(outcome)


def _request_error(e: RequestError) -> APIError:
    if e.param == "request_id":
        return APIError(409, str(e), param="request_id", code="duplicate_request_id")
    return bad_request(str(e), e.param, e.code or "invalid_value")


# ------------------------------------------------------------------------------------------ the app

def create_app(config: NodeConfig, telemetry: Telemetry | None = None, start: bool = True) -> Flask:
    """The node's Flask app; `start` loads the start-up models in the background."""
    app = Flask("engine.node")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    node = Node(config, telemetry)
    app.extensions["zen_node"] = node
    secret = config.secret.encode()

    def the_node() -> Node:
        return current_app.extensions["zen_node"]

    @app.errorhandler(APIError)
    def _api_error(e: APIError):
        the_node().metrics.rejected(e.code or str(e.status))
        return e.response()

    @app.errorhandler(HTTPException)
    def _http_error(e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.code)
        return APIError(e.code or 500, e.description or e.name, code=code).response()

    @app.errorhandler(Exception)
    def _unexpected(e: Exception):
        log.exception("unhandled error", extra={"path": request.path, "request_id": getattr(g, "request_id", None)})
        return APIError(500, f"internal error in the engine node (request {getattr(g, 'request_id', '?')})",
                        code="internal_error").response()

    @app.before_request
    def _authenticate():
        g.request_id = request.headers.get("X-Request-Id") or None
        if request.path in OPEN_PATHS:
            return None
        given = request.headers.get(SECRET_HEADER, "").encode()
        if not hmac.compare_digest(given, secret):
            raise APIError(401, f"missing or wrong {SECRET_HEADER} header", code="invalid_node_secret")
        return None

    @app.get("/health")
    def health():
        n = the_node()
        if n.healthy:
            return jsonify({"status": "ok"})
        status = "stopping" if n.closing else ("loading" if not n.ready.is_set() else "unhealthy")
        resp = jsonify({"status": status})
        resp.status_code = 503
        resp.headers["Retry-After"] = "2"
        return resp

    @app.get("/metrics")
    def metrics():
        return Response(the_node().metrics.render(), mimetype=CONTENT_TYPE_LATEST)

    @app.get("/state")
    def state():
        return jsonify(the_node().state())

    @app.get("/v1/models")
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
            raise bad_request("the request body must be a JSON object", None, "invalid_json")
        model = _opt_str(body, "model")
        if not model:
            raise bad_request("model is required", "model", "missing_required_parameter")
        quant = _opt_str(body, "quantization") or None
        if quant is not None and quant not in FORMATS:
            raise bad_request(f"quantization must be one of {', '.join(FORMATS)}", "quantization")
        return model, quant

    @app.post("/v1/models/load")
    def load_model():
        n = the_node()
        model, quant = _model_body()
        try:
            m = n.registry.load(model, quant, n.config.load_wait_s)
        except ModelNotFound as e:
            raise APIError(404, str(e), param="model", code="model_not_found") from None
        except ModelUnavailable as e:
            raise unavailable(str(e), e.code, e.retry_after) from None
        return jsonify({"status": "loaded", "model": m.id, "quantization": m.quantization, "bytes": m.bytes,
                        "load_time_s": round(m.load_time_s, 4)})

    @app.post("/v1/models/unload")
    def unload_model():
        n = the_node()
        model, quant = _model_body()
        try:
            gone = n.registry.unload(model, quant)
        except ModelNotFound as e:
            raise APIError(404, str(e), param="model", code="model_not_found") from None
        except ModelBusy as e:
            raise APIError(409, str(e), param="model", code="model_busy") from None
        if not gone:
            raise APIError(404, f"the model {model!r} is not resident", param="model", code="model_not_loaded")
        return jsonify({"status": "unloaded", "unloaded": [{"id": m.id, "quantization": m.quantization}
                                                           for m in gone]})

    @app.post("/v1/generate")
    def generate():
        n = the_node()
        received = time.monotonic()
        call = parse_generate(json_body())
        g.request_id = call.request_id
        try:
            n.registry.spec(call.model)
        except ModelNotFound as e:
            raise APIError(404, str(e), param="model", code="model_not_found") from None
        if n.admission.would_refuse(call.sampling.n):   # before any cold load
            raise unavailable("the node's waiting queue is full", "queue_full")
        try:
            m = n.registry.acquire(call.model, call.quantization, n.config.load_wait_s)
        except ModelUnavailable as e:
            raise unavailable(str(e), e.code, e.retry_after) from None
        handed_over = False
        try:
            ids, text = tokenize(call, m)
            req = InferenceRequest(call.request_id, m.id, ids, call.sampling, call.latency_class, call.org,
                                   arrival_time=received, queue_timeout_s=call.queue_timeout_s, prompt_text=text)
            ticket = n.admission.admit(m.key, call.sampling.n)
            if ticket is None:
                raise unavailable("the node's waiting queue is full", "queue_full")
            try:
                stream = m.loop.submit(req)
            except RequestError as e:
                ticket.close()
                raise _request_error(e) from None
            except RuntimeError as e:   # the model's loop has failed
                ticket.close()
                raise unavailable(str(e), "engine_failure", 5) from None
            gen = Generation(n, m, call, req, stream, ticket, request.environ.get("gunicorn.socket"))
            handed_over = True
            if call.stream:
                return Response(SSEBody(gen), mimetype="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return collect(gen)
        finally:
            if not handed_over:
                n.registry.release(m)

    if start:
        node.start()
    return app


# ---------------------------------------------------------------------------------------- gunicorn

def _worker_exit(server, worker) -> None:
    app = getattr(worker, "wsgi", None)
    node = app.extensions.get("zen_node") if isinstance(app, Flask) else None
    if node is not None:
        node.close()


def serve(config: NodeConfig) -> None:
    """Run the node under gunicorn: one worker (it owns the device), gthread for concurrent streams."""
    from gunicorn.app.base import BaseApplication

    class NodeApplication(BaseApplication):
        def load_config(self):
            host = f"[{config.host}]" if ":" in config.host else config.host
            settings = {
                "bind": f"{host}:{config.port}", "workers": 1, "worker_class": "gthread",
                "threads": config.threads, "timeout": 120, "graceful_timeout": 10, "keepalive": 5,
                "accesslog": None, "errorlog": "-", "loglevel": config.log_level, "preload_app": False,
                "worker_exit": _worker_exit, "proc_name": f"zen-node-{config.port}",
                "control_socket_disable": True,   # one node per port; no shared control socket
            }
            for key, value in settings.items():
                self.cfg.set(key, value)

        def load(self):   # in the worker: threads, the device and the models belong to it
            configure_logging(config.log_level)
            disable_created_metrics()
            return create_app(config)

    openmp_defaults(os.environ)   # before the worker loads libgomp, which reads them once
    NodeApplication().run()


def openmp_defaults(environ) -> None:
    """libgomp's settings for the node's kernel threads, where the operator chose none. Threads are
    bound only when numba starts one per CPU the node may use: with fewer (several nodes sharing a
    host), libgomp would bind every node's threads to the same first CPUs."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = OPENMP_SPINCOUNT
    cpus = len(os.sched_getaffinity(0))
    if (not any(k in environ for k in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY"))
            and environ.get("NUMBA_NUM_THREADS", str(cpus)).strip() == str(cpus)):
        environ["OMP_PROC_BIND"] = OPENMP_PROC_BIND
