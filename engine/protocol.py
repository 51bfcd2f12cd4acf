"""The gateway <-> node wire protocol, defined once and imported by both sides (docs/node-protocol.md).

Light on purpose (the standard library only): the gateway imports it in every worker. What lives
here: the header names, the shipped development node secret and the loopback test that confines it,
the latency class, the error shape, the POST /v1/generate payload, the POST /tokenize and
/detokenize bodies and the GET /state body.
"""
from __future__ import annotations

import enum
import ipaddress
import json
import math
import uuid
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from flask import Response

    from engine.sampling import SamplingParams

SECRET_HEADER = "X-Node-Secret"       # every node endpoint but /health, /ready and /metrics needs it
REQUEST_ID_HEADER = "X-Request-Id"
STATE_HEADER = "X-Node-State"         # the node's state in brief (NodeState.to_header) on its /v1/ answers
STATE_FIELD = "state"                 # the same, in the final event of a /v1/generate stream
PROMPT_TOKENS_HEADER = "X-Prompt-Tokens"   # a /v1/generate stream's prompt tokens, known as it starts


# -------------------------------------------------------------------------- development node secret

# config/default.toml ships it ([nodes] secret), so it is public: nodes and gateways take it on loopback only.
DEV_NODE_SECRET = "zen-development-node-secret"
MAX_CHAT_TEMPLATE_CHARS = 100_000    # longest chat_template a request may carry (a catalog's template, app/config.py)
ORG_QUEUE_FULL = "org_queue_full"    # error code (429): the org holds its share of a node's queue (another node may not)
NODE_SHUTDOWN = "node_shutdown"      # error code: the node's drain ended the request (retry elsewhere), not a failure


def json_value(text: str) -> Any:
    """The value of JSON text (a request's body, or JSON a request carries in a string); ValueError when
    it is not JSON or is nested past the parser's depth (json.loads raises RecursionError there)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def parse_json(raw: bytes) -> Any:
    """A request body's JSON; ValueError when it is not JSON, is nested past the parser's depth, or holds a
    lone surrogate (an escape such as "\\ud800": a string that no UTF-8 text, and no tokenizer, takes)."""
    text = raw.decode(json.detect_encoding(raw))   # strict: a raw lone surrogate in UTF-16 is an error
    value = json_value(text)
    if "\\ud" in text or "\\uD" in text:    # only an escape writes a surrogate now
        try:
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ValueError("a string holds a lone UTF-16 surrogate") from None
    return value


def finite_number(value: Any) -> bool:
    """A JSON number a float holds: not a bool, NaN or an infinity (Python's json reads those), nor an
    integer past float's range (json reads 10**400 exactly; float() of it overflows)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_loopback_host(host: str | None) -> bool:
    """Whether `host` (a name or an IP address, IPv6 with or without brackets) is this machine only."""
    name = (host or "").strip().strip("[]").rstrip(".").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# ------------------------------------------------------------------------------------ latency class

class LatencyClass(enum.IntEnum):
    """τ: lower value = served first. Built from its rank (0..2) or its label ("realtime", ...)."""
    REALTIME = 0
    STANDARD = 1
    BATCH = 2

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str) and value.strip().upper() in cls.__members__:
            return cls[value.strip().upper()]
        return None

    @classmethod
    def parse(cls, value) -> "LatencyClass":
        """The class named by `value` (case-insensitive); ValueError if none is."""
        if isinstance(value, cls):
            return value
        try:
            return cls[str(value).strip().upper()]
        except KeyError:
            raise ValueError(f"must be one of {', '.join(c.label for c in cls)}") from None

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def rank(self) -> int:
        """0 for the most urgent class."""
        return int(self)


# ------------------------------------------------------------------------------------------- errors

# OpenAI's error types by HTTP status (what the table does not name: by 4xx/5xx).
_TYPE_BY_STATUS = {429: "rate_limit_exceeded"}


# The error code of werkzeug's HTTP errors, on both sides.
HTTP_ERROR_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
}


def error_type_for(status: int) -> str:
    return _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(Exception):
    """An error to answer in OpenAI's shape with `status` and extra `headers` (such as Retry-After)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or error_type_for(status)
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> Response:
        """The Flask response (flask imported here: the engine library loads this module without it)."""
        from flask import jsonify
        resp = jsonify(self.body())
        resp.status_code = self.status
        resp.headers.update(self.headers)
        return resp


def bad_value(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 naming the parameter at fault (code `invalid_value` unless given, when a parameter is named)."""
    return APIError(400, message, param=param, code=code or ("invalid_value" if param else None))


def sse_error_event(message: str, *, type: str = "server_error", code: str | None = None,
                    param: str | None = None) -> str:
    """The gateway's server-sent event carrying an error, as sent to a client after a stream started."""
    return "data: " + json.dumps(error_body(message, type=type, param=param, code=code)) + "\n\n"


def stream_error_event(message: str, type: str, code: str, param: str | None = None) -> dict:
    """The node's error event, which ends a /v1/generate stream."""
    return {"type": "error", "error": {"message": message, "type": type, "param": param, "code": code}}


# ------------------------------------------------------------------------- POST /v1/generate payload

def optional_str(body: Mapping, name: str, max_len: int = 256) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad_value(f"{name} must be a string, got {type(v).__name__}", name)
    if len(v) > max_len:
        raise bad_value(f"{name} must be at most {max_len} characters", name)
    return v


# Sent only when set away from their defaults, which most requests keep.
_SENT_WHEN_SET = frozenset({"best_of", "skip_special_tokens", "include_stop_str_in_output", "structured_output",
                            "max_tokens_default"})


def sampling_to_json(params: "SamplingParams") -> dict:
    # Shallow: asdict() deep-copies every field, a cost on each request's path for nothing.
    return {f.name: getattr(params, f.name) for f in fields(params)
            if f.name not in _SENT_WHEN_SET or getattr(params, f.name) != f.default}


@dataclass
class GenerateRequest:
    """The body of POST /v1/generate: a request r = (m, x, θ, τ) as the gateway forwards it to a node.
    x is exactly one of prompt, prompt_token_ids, messages."""
    request_id: str
    model: str
    quantization: str | None
    org: str
    latency_class: LatencyClass
    sampling: "SamplingParams"
    stream: bool = False
    queue_timeout_s: float | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list | None = None
    tools: list | None = None        # function tools the chat template renders (engine/tools.py); messages only
    chat_template: str | None = None   # a template's source, rendered in place of the model's own; messages only
    group: str | None = None         # the client's request this is one prompt of (a request id): one request for
                                     # the org's share of the node's queue, however many prompts it sends

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"request_id": self.request_id, "model": self.model,
                               "quantization": self.quantization, "org": self.org,
                               "latency_class": self.latency_class.label}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        elif self.prompt_token_ids is not None:
            out["prompt_token_ids"] = list(self.prompt_token_ids)
        else:
            out["messages"] = self.messages
            if self.tools:
                out["tools"] = self.tools
            if self.chat_template:
                out["chat_template"] = self.chat_template
        out["sampling"] = sampling_to_json(self.sampling)
        out["stream"] = self.stream
        if self.queue_timeout_s is not None:
            out["queue_timeout_s"] = self.queue_timeout_s
        if self.group is not None:
            out["group"] = self.group
        return out

    @classmethod
    def from_json(cls, body: Any, check_quantization: Callable[[str | None], str | None]) -> "GenerateRequest":
        """Validate the JSON of POST /v1/generate (types and shapes; the model checks come later):
        APIError (400) naming the parameter at fault. check_quantization raises ValueError."""
        from engine.sampling import SamplingParamError, SamplingParams
        if not isinstance(body, dict):
            raise bad_value("the request body must be a JSON object", None, "invalid_json")
        request_id = optional_str(body, "request_id") or "node-" + uuid.uuid4().hex
        model = optional_str(body, "model")
        if not model:
            raise bad_value("model is required (a model id this node serves)", "model", "missing_required_parameter")
        quantization = optional_str(body, "quantization") or None
        try:
            check_quantization(quantization)
        except ValueError as e:
            raise bad_value(str(e), "quantization") from None
        org = optional_str(body, "org") or ""
        given = body.get("latency_class")
        try:
            # absent is standard; 0 or false name no class (a falsy value was taken for absent)
            latency_class = LatencyClass.STANDARD if given is None else LatencyClass.parse(given)
        except ValueError as e:
            raise bad_value(f"latency_class {e}; got {given!r}", "latency_class") from None
        inputs = _inputs(body)
        sampling = body.get("sampling")
        if sampling is None:
            sampling = {}
        if not isinstance(sampling, dict):
            raise bad_value(f"sampling must be an object, got {type(sampling).__name__}", "sampling")
        unknown = sorted(set(sampling) - set(SamplingParams.__dataclass_fields__))
        if unknown:
            raise bad_value(f"unknown sampling parameter(s): {', '.join(unknown)}", unknown[0], "unknown_parameter")
        try:
            params = SamplingParams(**sampling)
        except SamplingParamError as e:
            raise bad_value(str(e), e.param, "invalid_value") from None
        except (TypeError, ValueError) as e:
            raise bad_value(f"invalid sampling parameters: {e}", "sampling") from None
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad_value(f"stream must be a boolean, got {type(stream).__name__}", "stream")
        qt = body.get("queue_timeout_s")
        if qt is not None and (not finite_number(qt) or qt <= 0):
            raise bad_value("queue_timeout_s must be a positive number of seconds", "queue_timeout_s")
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
                                  or "messages" not in inputs):
            raise bad_value("tools must be a list of tool objects, sent with messages", "tools")
        return cls(request_id, model, quantization, org, latency_class, params, stream,
                   None if qt is None else float(qt), **inputs, tools=tools or None,
                   chat_template=chat_template_of(body, "messages" in inputs),
                   group=optional_str(body, "group") or None)


def chat_template_of(body: Mapping, has_messages: bool) -> str | None:
    """A request's chat_template: the source of a template to render its messages with, or None."""
    source = body.get("chat_template")
    if source is None:
        return None
    if not isinstance(source, str) or not source or len(source) > MAX_CHAT_TEMPLATE_CHARS or not has_messages:
        raise bad_value(f"chat_template must be a template's source (a string of 1 to {MAX_CHAT_TEMPLATE_CHARS} "
                        "characters), sent with messages", "chat_template", "invalid_type")
    return source


def _inputs(body: Mapping) -> dict:
    """x: exactly one of prompt, prompt_token_ids, messages, checked for its type."""
    given = [k for k in ("prompt", "prompt_token_ids", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise bad_value("give exactly one of prompt, prompt_token_ids, messages"
                        + (f" (got {', '.join(given)})" if given else ""), "prompt", "missing_required_parameter"
                        if not given else "invalid_value")
    if "prompt" in given:
        if not isinstance(body["prompt"], str):
            raise bad_value(f"prompt must be a string, got {type(body['prompt']).__name__}", "prompt")
        return {"prompt": body["prompt"]}
    if "prompt_token_ids" in given:
        ids = body["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad_value("prompt_token_ids must be a list of integers", "prompt_token_ids")
        return {"prompt_token_ids": ids}
    if not isinstance(body["messages"], list):
        raise bad_value("messages must be a list of {role, content} objects", "messages")
    return {"messages": body["messages"]}


# ----------------------------------------------------------------- POST /tokenize, POST /detokenize

def _flag(body: Mapping, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_value(f"{name} must be a boolean, got {type(v).__name__}", name, "invalid_type")
    return v


def _model_of(body: Any) -> tuple[str, str | None]:
    if not isinstance(body, dict):
        raise bad_value("the request body must be a JSON object", None, "invalid_json")
    model = optional_str(body, "model")
    if not model:
        raise bad_value("model is required", "model", "missing_required_parameter")
    return model, optional_str(body, "quantization") or None


@dataclass
class TokenizeRequest:
    """POST /tokenize in vLLM's shape: a prompt, or chat messages rendered with the model's template.
    add_special_tokens defaults to true for a prompt and false for messages (the template has them)."""
    model: str
    quantization: str | None = None
    prompt: str | None = None
    messages: list | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list | None = None        # with messages: rendered by the template as a chat request's are
    chat_template: str | None = None   # with messages: a template's source, used in place of the model's own

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}

    @classmethod
    def from_json(cls, body: Any) -> "TokenizeRequest":
        model, quantization = _model_of(body)
        has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
        if has_prompt == has_messages:
            raise bad_value("give exactly one of prompt, messages", "prompt", "missing_required_parameter")
        if has_prompt and not isinstance(body["prompt"], str):
            raise bad_value("prompt must be a string", "prompt", "invalid_type")
        if has_messages and (not isinstance(body["messages"], list) or not body["messages"]):
            raise bad_value("messages must be a non-empty list of {role, content} objects", "messages",
                            "invalid_type")
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
                                  or not has_messages):
            raise bad_value("tools must be a list of tool objects, sent with messages", "tools")
        return cls(model, quantization, body.get("prompt"), body.get("messages"),
                   _flag(body, "add_special_tokens", has_prompt), _flag(body, "add_generation_prompt", True),
                   _flag(body, "return_token_strs", False), tools or None, chat_template_of(body, has_messages))


@dataclass
class DetokenizeRequest:
    """POST /detokenize in vLLM's shape: token ids -> the text they decode to."""
    model: str
    tokens: list[int]
    quantization: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}

    @classmethod
    def from_json(cls, body: Any) -> "DetokenizeRequest":
        model, quantization = _model_of(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in tokens):
            raise bad_value("tokens must be a list of token ids (integers >= 0)", "tokens", "invalid_type")
        return cls(model, tokens, quantization)


# ------------------------------------------------------------------------------------- GET /state

# A state's numbers are bounded as they are read: a node's garbage (1e308 waiting tokens, a rate of 1e-320
# tokens/s) must not overflow or turn the router's estimates into infinities and NaN.
MAX_NUMBER = 1e15
MAX_COUNT = 2**31 - 1
MAX_SECONDS = 86_400.0     # a load or a step longer than a day is no measurement
MIN_RATE = 1e-3            # tokens/s; below it a rate counts as not measured (0)


def _num(value: Any, default: float = 0.0) -> float:
    return min(MAX_NUMBER, max(-MAX_NUMBER, float(value))) if finite_number(value) else default


def _count(value: Any) -> int:
    return min(MAX_COUNT, max(0, int(_num(value))))


def _seconds(value: Any) -> float:
    return min(MAX_SECONDS, max(0.0, _num(value)))


def _opt_seconds(value: Any) -> float | None:
    return None if value is None else _seconds(value)


def _rate(value: Any) -> float:
    rate = _num(value)
    return rate if rate >= MIN_RATE else 0.0


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _opt_num(value: Any) -> float | None:
    return _num(value) if value is not None else None


def _fraction(value: Any) -> float:
    return min(1.0, max(0.0, _num(value)))


@dataclass(frozen=True)
class ModelState:
    """A model resident on a node, with its measured rates (0: not measured yet)."""
    id: str
    quantization: str
    version: str = ""
    bytes: int = 0
    load_time_s: float | None = None
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0         # per sequence, as one stream sees it
    batch_decode_tokens_per_s: float = 0.0   # the whole batch's
    decode_step_s: float = 0.0               # a decode step's time ~ decode_step_s + decode_step_per_seq_s * batch
    decode_step_per_seq_s: float = 0.0
    running: int = 0
    waiting: int = 0                         # in the engine loop, not running yet
    admitted: int = 0                        # without a first token yet, running or not
    kv_cache_usage: float = 0.0
    kv_cache_blocks: int = 0
    utilization: float = 0.0
    max_model_len: int = 0
    formats: dict | list | None = None
    idle_s: float = 0.0

    @property
    def key(self) -> tuple[str, str]:
        return (self.id, self.quantization)

    @classmethod
    def from_json(cls, m: Mapping) -> "ModelState":
        return cls(
            id=m["id"], quantization=str(m.get("quantization") or ""), version=str(m.get("version") or ""),
            bytes=max(0, int(_num(m.get("bytes")))), load_time_s=_opt_seconds(m.get("load_time_s")),
            prefill_tokens_per_s=_rate(m.get("prefill_tokens_per_s")),
            decode_tokens_per_s=_rate(m.get("decode_tokens_per_s")),
            batch_decode_tokens_per_s=_rate(m.get("batch_decode_tokens_per_s")),
            decode_step_s=_seconds(m.get("decode_step_s")),
            decode_step_per_seq_s=_seconds(m.get("decode_step_per_seq_s")),
            running=_count(m.get("running")), waiting=_count(m.get("waiting")),
            admitted=_count(m.get("admitted")), kv_cache_usage=_fraction(m.get("kv_cache_usage")),
            kv_cache_blocks=_count(m.get("kv_cache_blocks")), utilization=_fraction(m.get("utilization")),
            max_model_len=_count(m.get("max_model_len")), formats=m.get("formats"), idle_s=_num(m.get("idle_s")))


def _per_class(value: Any) -> tuple[int, int, int]:
    """Three counts, one per latency class (realtime, standard, batch)."""
    if not isinstance(value, (list, tuple)) or len(value) != len(LatencyClass):
        return (0, 0, 0)
    return tuple(_count(v) for v in value)  # type: ignore[return-value]


@dataclass(frozen=True)
class QueueState:
    """running and waiting do not overlap (a sequence in its prefill runs); admitted, what max_waiting
    bounds, counts the sequences without a first token, running or not; admitted_by_class splits them
    by latency class (realtime, standard, batch) and admitted_tokens_by_class sums their prompt tokens:
    the prefill work ahead of a new request of each class. max_running: the engine's batch size."""
    waiting: int = 0
    running: int = 0
    admitted: int = 0
    max_waiting: int = 0
    max_running: int = 0
    admitted_by_class: tuple[int, int, int] = (0, 0, 0)
    admitted_tokens_by_class: tuple[int, int, int] = (0, 0, 0)

    @classmethod
    def from_json(cls, q: Mapping) -> "QueueState":
        return cls(waiting=_count(q.get("waiting")), running=_count(q.get("running")),
                   admitted=_count(q.get("admitted")), max_waiting=_count(q.get("max_waiting")),
                   max_running=_count(q.get("max_running")),
                   admitted_by_class=_per_class(q.get("admitted_by_class")),
                   admitted_tokens_by_class=_per_class(q.get("admitted_tokens_by_class")))

    def to_json(self) -> dict:
        out = vars(self).copy()
        out["admitted_by_class"] = list(self.admitted_by_class)
        out["admitted_tokens_by_class"] = list(self.admitted_tokens_by_class)
        return out

    @property
    def full(self) -> bool:
        """No room for another admitted sequence: the router sends the request elsewhere first."""
        return self.max_waiting > 0 and self.admitted >= self.max_waiting

    def ahead_of(self, latency_class: LatencyClass) -> tuple[int, int]:
        """(sequences, prompt tokens) admitted and served before a new request of `latency_class`:
        those of its class and the more urgent ones (the scheduler orders by class first; within a class it
        takes turns between orgs, so a request may start before some of its class's work)."""
        rank = int(latency_class) + 1
        return sum(self.admitted_by_class[:rank]), sum(self.admitted_tokens_by_class[:rank])


@dataclass(frozen=True)
class MemoryState:
    used_bytes: int | None = None
    total_bytes: int | None = None
    budget_bytes: int = 0                    # weights + KV cache of the resident models may use
    resident_bytes: int = 0
    process_rss_bytes: int | None = None

    @classmethod
    def from_json(cls, m: Mapping) -> "MemoryState":
        def opt(v):
            return int(_num(v)) if v is not None else None
        return cls(used_bytes=opt(m.get("used_bytes")), total_bytes=opt(m.get("total_bytes")),
                   budget_bytes=_count(m.get("budget_bytes")), resident_bytes=_count(m.get("resident_bytes")),
                   process_rss_bytes=opt(m.get("process_rss_bytes")))


@dataclass(frozen=True)
class AcceleratorState:
    device: str = ""
    utilization: float | None = None

    @classmethod
    def from_json(cls, a: Mapping) -> "AcceleratorState":
        return cls(device=str(a.get("device") or ""), utilization=_opt_num(a.get("utilization")))


# The brief's positional fields (NodeState.to_brief): the queue's counts, then each model's after its id
# and quantization.
_BRIEF_QUEUE = ("waiting", "running", "admitted", "max_waiting", "max_running")
_BRIEF_MODEL = ("load_time_s", "prefill_tokens_per_s", "decode_tokens_per_s", "batch_decode_tokens_per_s",
                "decode_step_s", "decode_step_per_seq_s", "running", "waiting", "admitted", "kv_cache_usage",
                "utilization")


@dataclass(frozen=True)
class LoadingState:
    """A load in progress on a node: how long it has run, and how long the node expects it to take
    (its last load of the same model; 0: never loaded it)."""
    id: str
    quantization: str
    elapsed_s: float = 0.0
    expected_s: float = 0.0

    @property
    def key(self) -> tuple[str, str]:
        return (self.id, self.quantization)

    @classmethod
    def from_json(cls, x: Mapping) -> "LoadingState":
        return cls(x["id"], str(x.get("quantization") or ""), _seconds(x.get("elapsed_s")),
                   _seconds(x.get("expected_s")))


@dataclass(frozen=True)
class NodeState:
    """σ_g: the body of GET /state. The node writes it with to_json; the router reads it with
    from_json, which tolerates missing optional fields and junk values."""
    node_id: str
    healthy: bool                                      # alive: serving, no engine loop failed
    models: tuple[ModelState, ...] = ()
    available_models: tuple[str, ...] = ()
    utilization: float = 0.0
    queue: QueueState = field(default_factory=QueueState)
    temperature_c: float | None = None
    power_w: float | None = None
    kv_cache_usage: float = 0.0
    ready: bool = False                                # takes traffic: start-up models in, not draining
    draining: bool = False                             # shutting down: finishes what it has, takes nothing new
    loading: tuple[LoadingState, ...] = ()             # loads in progress
    memory: MemoryState = field(default_factory=MemoryState)
    accelerator: AcceleratorState = field(default_factory=AcceleratorState)
    uptime_s: float = 0.0

    def resident(self, key: tuple[str, str]) -> ModelState | None:
        return next((m for m in self.models if m.key == key), None)

    def loading_of(self, key: tuple[str, str]) -> LoadingState | None:
        return next((x for x in self.loading if x.key == key), None)

    def can_load(self, model_id: str) -> bool:
        """Whether the node can serve the model at all (resident or loadable)."""
        return (not self.available_models or model_id in self.available_models
                or any(m.id == model_id for m in self.models))

    def to_json(self) -> dict:
        return {
            "node_id": self.node_id, "healthy": self.healthy, "ready": self.ready,
            "draining": self.draining, "models": [vars(m).copy() for m in self.models],
            "loading": [vars(x).copy() for x in self.loading],
            "available_models": list(self.available_models), "utilization": self.utilization,
            "queue": self.queue.to_json(), "temperature_c": self.temperature_c, "power_w": self.power_w,
            "kv_cache_usage": self.kv_cache_usage, "memory": vars(self.memory).copy(),
            "accelerator": vars(self.accelerator).copy(), "uptime_s": self.uptime_s,
        }

    # -- the state in brief: a header on every /v1/ answer of the node, a field of a stream's last event

    def to_brief(self) -> dict:
        """What changes from one request to the next, in short keys and positional lists (a header is
        read on each request's path); from_brief reads it over the last polled state."""
        q = self.queue
        return {"h": int(self.healthy), "r": int(self.ready), "d": int(self.draining), "u": self.utilization,
                "t": self.temperature_c, "k": self.kv_cache_usage,
                "q": [getattr(q, f) for f in _BRIEF_QUEUE] + list(q.admitted_by_class)
                + list(q.admitted_tokens_by_class),
                "m": [[m.id, m.quantization] + [getattr(m, f) for f in _BRIEF_MODEL] for m in self.models],
                "l": [[x.id, x.quantization, x.elapsed_s, x.expected_s] for x in self.loading]}

    def to_header(self) -> str:
        return json.dumps(self.to_brief(), separators=(",", ":"))

    @classmethod
    def from_header(cls, text: str, base: "NodeState | None") -> "NodeState":
        """The state a STATE_HEADER value describes (ValueError if it is not one)."""
        return cls.from_brief(json_value(text), base)

    @classmethod
    def from_brief(cls, data: Any, base: "NodeState | None") -> "NodeState":
        """to_brief's dict over `base` (the node's last full state: what the brief leaves out, such as
        available_models and memory, comes from it); ValueError if `data` is not a brief. Written out
        field by field: it runs on each request's path."""
        try:
            q = [_count(v) for v in data["q"]]
            queue = QueueState(q[0], q[1], q[2], q[3], q[4], (q[5], q[6], q[7]), (q[8], q[9], q[10]))
            old = {m.key: m for m in base.models} if base is not None else {}
            models = tuple(_brief_model(row, old.get((row[0], row[1]))) for row in data["m"])
            loading = tuple(LoadingState(str(x[0]), str(x[1]), _seconds(x[2]), _seconds(x[3]))
                            for x in data["l"])
            b = base or _EMPTY_STATE
            return cls(b.node_id, data["h"] == 1, models, b.available_models, _fraction(data["u"]), queue,
                       _opt_num(data["t"]), b.power_w, _fraction(data["k"]), data["r"] == 1, data["d"] == 1,
                       loading, b.memory, b.accelerator, b.uptime_s)
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a node state brief: {exc.__class__.__name__}") from None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "NodeState":
        if not isinstance(data, Mapping):
            raise ValueError("state is not an object")
        models = tuple(ModelState.from_json(m) for m in _list(data.get("models"))
                       if isinstance(m, Mapping) and isinstance(m.get("id"), str))
        loading = tuple(LoadingState.from_json(x) for x in _list(data.get("loading"))
                        if isinstance(x, Mapping) and isinstance(x.get("id"), str))

        def part(name: str) -> Mapping:
            value = data.get(name)
            return value if isinstance(value, Mapping) else {}
        return cls(
            node_id=str(data.get("node_id") or ""), healthy=data.get("healthy") is True, models=models,
            available_models=tuple(a for a in _list(data.get("available_models")) if isinstance(a, str)),
            utilization=_fraction(data.get("utilization")), queue=QueueState.from_json(part("queue")),
            temperature_c=_opt_num(data.get("temperature_c")), power_w=_opt_num(data.get("power_w")),
            kv_cache_usage=_fraction(data.get("kv_cache_usage")), ready=data.get("ready") is True,
            draining=data.get("draining") is True, loading=loading,
            memory=MemoryState.from_json(part("memory")), accelerator=AcceleratorState.from_json(part("accelerator")),
            uptime_s=_num(data.get("uptime_s")))


_EMPTY_STATE = NodeState(node_id="", healthy=False)


def _brief_model(row: list, old: ModelState | None) -> ModelState:
    """One model of a brief (its fields in _BRIEF_MODEL order after id and quantization); what the brief
    leaves out comes from the model's entry in the last full state."""
    rates, steps = [_rate(v) for v in row[3:6]], [_seconds(v) for v in row[6:8]]
    return ModelState(str(row[0]), str(row[1]), old.version if old else "", old.bytes if old else 0,
                      _opt_seconds(row[2]), *rates, *steps, _count(row[8]), _count(row[9]),
                      _count(row[10]), _fraction(row[11]), old.kv_cache_blocks if old else 0, _fraction(row[12]),
                      old.max_model_len if old else 0, old.formats if old else None, old.idle_s if old else 0.0)
