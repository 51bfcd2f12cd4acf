"""Validation of OpenAI request bodies: a 400 naming the parameter, never a 500.

One table (`SAMPLING_FIELDS`) describes the scalar parameters; the validator and the
OpenAPI description (app/openapi.py) are both built from it. The structured fields
(messages, prompt, stop, logit_bias, logprobs, stream_options) have their own checks; the
constraints of structured outputs are in app/structured.py. Unknown fields are ignored, as
vLLM does; fields for features this server does not offer (audio, echo, ...) are refused
with 400.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from engine.protocol import bad_value, finite_number

CHAT = "chat"
COMPLETIONS = "completions"
MAX_STOP = 4
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
MAX_MESSAGES = 4096
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# Fields offered by OpenAI that this server does not implement: refused, not ignored.
UNSUPPORTED = {
    CHAT: ("functions", "function_call", "audio", "modalities", "prediction", "web_search_options"),
    COMPLETIONS: ("suffix",),
}
# values of those fields that ask for what this server does anyway: accepted
SUPPORTED_VALUES = {"modalities": (["text"],)}


@dataclass(frozen=True)
class NumberField:
    """A scalar sampling parameter with its range (None: unbounded)."""

    name: str
    integer: bool
    default: Any
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    description: str = ""


SAMPLING_FIELDS: tuple[NumberField, ...] = (
    NumberField("temperature", False, 1.0, 0.0, 2.0, description="Sampling temperature; 0 is greedy."),
    NumberField("top_p", False, 1.0, 0.0, 1.0,
                description="Nucleus sampling: smallest set of tokens whose probability reaches top_p (0: the "
                            "most likely token)."),
    NumberField("top_k", True, -1, -1, 1_000_000, description="Keep the k most likely tokens; -1 or 0 keeps all (vLLM extension)."),
    NumberField("min_p", False, 0.0, 0.0, 1.0, description="Drop tokens below min_p times the top probability (vLLM extension)."),
    NumberField("presence_penalty", False, 0.0, -2.0, 2.0, description="Penalty on tokens already present."),
    NumberField("frequency_penalty", False, 0.0, -2.0, 2.0, description="Penalty proportional to token frequency."),
    NumberField("repetition_penalty", False, 1.0, 0.0, 10.0, exclusive_minimum=True,
                description="Multiplicative repetition penalty; 1 is none (vLLM extension)."),
    NumberField("seed", True, None, INT64_MIN, INT64_MAX, description="Seed for reproducible sampling."),
    NumberField("n", True, 1, 1, None, description="Number of choices to generate."),
    NumberField("max_tokens", True, None, 1, None, description="Most tokens to generate per choice."),
    NumberField("max_completion_tokens", True, None, 1, None, description="Same as max_tokens (newer name); wins when both are set."),
    NumberField("min_tokens", True, 0, 0, None, description="Fewest tokens to generate before stop conditions apply (vLLM extension)."),
)
_FIELD = {f.name: f for f in SAMPLING_FIELDS}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def number(body: Mapping[str, Any], name: str, spec: NumberField | None = None,
           maximum: float | None = None) -> Any:
    """The value of a numeric parameter, checked against its type and range."""
    spec = spec or _FIELD[name]
    value = body.get(name)
    if value is None:
        return spec.default
    kind = "an integer" if spec.integer else "a number"
    if not _is_number(value) or (isinstance(value, float) and not math.isfinite(value)):
        raise bad_value(f"`{name}` must be {kind}", name, "invalid_type")
    if not finite_number(value):   # an integer past float's range: no parameter takes one
        raise bad_value(f"`{name}` is out of range", name)
    if spec.integer:
        if isinstance(value, float):
            if not value.is_integer():
                raise bad_value(f"`{name}` must be {kind}", name, "invalid_type")
            value = int(value)
    else:
        value = float(value)
    hi = spec.maximum if maximum is None else maximum
    lo = spec.minimum
    if lo is not None and (value < lo or (spec.exclusive_minimum and value == lo)):
        bound = f"greater than {lo:g}" if spec.exclusive_minimum else f"at least {lo:g}"
        raise bad_value(f"`{name}` must be {bound}, got {value}", name)
    if hi is not None and value > hi:
        raise bad_value(f"`{name}` must be at most {hi:g}, got {value}", name)
    return value


def boolean(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_value(f"`{name}` must be a boolean", name, "invalid_type")
    return value


def string(body: Mapping[str, Any], name: str, *, required: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise bad_value(f"`{name}` is required", name, "missing_required_parameter")
        return None
    if not isinstance(value, str):
        raise bad_value(f"`{name}` must be a string", name, "invalid_type")
    return value


def one_of(body: Mapping[str, Any], name: str, allowed: tuple[str, ...]) -> str | None:
    value = string(body, name)
    if value is not None and value not in allowed:
        raise bad_value(f"`{name}` must be one of {', '.join(allowed)}", name, "invalid_value")
    return value


def check_object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise bad_value("The request body must be a JSON object", None, "invalid_json")
    return body


def check_unsupported(body: Mapping[str, Any], kind: str) -> None:
    for name in UNSUPPORTED[kind]:
        if body.get(name) not in (None, [], "", {}, *SUPPORTED_VALUES.get(name, ())):
            raise bad_value(f"`{name}` is not supported by this server", name, "unsupported_parameter")
    if kind == COMPLETIONS and boolean(body, "echo"):
        raise bad_value("`echo` is not supported by this server", "echo", "unsupported_parameter")


# -- structured fields -------------------------------------------------------------------------

def stop_sequences(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_value("`stop` must be a string or an array of strings", "stop", "invalid_type")
    if len(value) > MAX_STOP:
        raise bad_value(f"`stop` may hold at most {MAX_STOP} sequences", "stop")
    if any(s == "" for s in value):
        raise bad_value("`stop` sequences must not be empty", "stop")
    return tuple(value)


def stop_token_ids(body: Mapping[str, Any]) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if (not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 31
                       for t in value)):
        raise bad_value(f"`stop_token_ids` must be an array of at most {MAX_STOP_TOKEN_IDS} "
                        f"non-negative token ids", "stop_token_ids", "invalid_type")
    return tuple(value)


def logit_bias(body: Mapping[str, Any]) -> dict[str, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_value("`logit_bias` must be an object mapping token ids to biases",
                        "logit_bias", "invalid_type")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_value(f"`logit_bias` may hold at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10
                and int(key) < 2 ** 31):
            raise bad_value(f"`logit_bias` keys must be token ids, got {key[:20]!r}", "logit_bias")
        if not finite_number(bias) or not -100 <= bias <= 100:
            raise bad_value("`logit_bias` values must be numbers in [-100, 100]", "logit_bias")
        out[str(int(key))] = float(bias)
    return out


def stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = boolean(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise bad_value("`stream_options` must be an object", "stream_options", "invalid_type")
    if not stream:
        raise bad_value("`stream_options` is only allowed when `stream` is true", "stream_options")
    return stream, boolean(opts, "include_usage") if "include_usage" in opts else False


def chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """The node's `logprobs` for a chat request: None, or the number of alternatives."""
    want = boolean(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        top = number(body, "top_logprobs",
                     NumberField("top_logprobs", True, None, 0, MAX_CHAT_TOP_LOGPROBS))
        if not want:
            raise bad_value("`top_logprobs` requires `logprobs` to be true", "top_logprobs")
    return (top or 0) if want else None


def completion_logprobs(body: Mapping[str, Any]) -> int | None:
    if body.get("logprobs") is None:
        return None
    return number(body, "logprobs", NumberField("logprobs", True, None, 0, MAX_COMPLETION_LOGPROBS))


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad_value(f"`{where}`: only text content parts are supported",
                                "messages", "invalid_type")
            parts.append(part["text"])
        return "\n".join(parts)
    raise bad_value(f"`{where}` must be a string or an array of text parts",
                    "messages", "invalid_type")


def _tool_calls(value: Any, where: str) -> list[dict]:
    """An assistant message's earlier calls: [{id, type: function, function: {name, arguments}}]."""
    if not isinstance(value, list):
        raise bad_value(f"`{where}` must be an array", "messages", "invalid_type")
    out = []
    for j, call in enumerate(value):
        f = call.get("function") if isinstance(call, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("arguments", ""), str) or not isinstance(call.get("id", ""), str):
            raise bad_value(f"`{where}[{j}]` must be {{id, type: \"function\", function: {{name, arguments}}}}",
                            "messages", "invalid_type")
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": f["name"], "arguments": f.get("arguments", "")}})
    return out


def messages(body: Mapping[str, Any]) -> tuple[dict, ...]:
    """The chat messages as the node takes them: {role, content} (developer becomes system), with an
    assistant's `tool_calls` and a tool message's `tool_call_id` when present."""
    value = body.get("messages")
    if value is None:
        raise bad_value("`messages` is required", "messages", "missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise bad_value("`messages` must be a non-empty array", "messages", "invalid_type")
    if len(value) > MAX_MESSAGES:
        raise bad_value(f"`messages` may hold at most {MAX_MESSAGES} messages", "messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise bad_value(f"`messages[{i}]` must be an object", "messages", "invalid_type")
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise bad_value(f"`messages[{i}].role` must be one of {', '.join(CHAT_ROLES)}",
                            "messages")
        calls = msg.get("tool_calls") if role == "assistant" else None
        if msg.get("content") is None and not calls:
            raise bad_value(f"`messages[{i}].content` is required", "messages",
                            "missing_required_parameter")
        m = {"role": "system" if role == "developer" else role,
             "content": "" if msg.get("content") is None else _text_of(msg["content"], f"messages[{i}].content")}
        if calls:
            m["tool_calls"] = _tool_calls(calls, f"messages[{i}].tool_calls")
        if role == "tool":
            if not isinstance(msg.get("tool_call_id"), str):
                raise bad_value(f"`messages[{i}].tool_call_id` is required in a tool message", "messages",
                                "missing_required_parameter")
            m["tool_call_id"] = msg["tool_call_id"]
        out.append(m)
    return tuple(out)


def _token_ids(value: list, name: str) -> tuple[int, ...]:
    if not value or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 31
                            for t in value):
        raise bad_value(f"`{name}` token arrays must hold non-negative integers", name,
                        "invalid_type")
    return tuple(value)


def prompts(body: Mapping[str, Any]) -> list[tuple[str | None, tuple[int, ...] | None]]:
    """The completion's prompts, each (text, token ids) with exactly one set: a string or an array of
    token ids is one prompt; an array of strings or of token arrays, one each."""
    value = body.get("prompt")
    if value is None:
        raise bad_value("`prompt` is required", "prompt", "missing_required_parameter")
    if isinstance(value, str):
        return [(value, None)]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return [(p, None) for p in value]
        if all(isinstance(p, list) for p in value):
            return [(None, _token_ids(p, "prompt")) for p in value]
        return [(None, _token_ids(value, "prompt"))]
    raise bad_value("`prompt` must be a string, an array of token ids, or an array of either", "prompt",
                    "invalid_type")


def max_tokens(body: Mapping[str, Any], max_context: int, default: int) -> tuple[int, str | None]:
    """(max_tokens, the parameter it came from: None for the model's default), at most the model's context."""
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            value = number(body, name)
            if value > max_context:
                raise bad_value(f"`{name}` is {value}, more than the model's context of "
                                f"{max_context} tokens", name)
            return value, name
    return default, None


def require_model(body: Mapping[str, Any]) -> str:
    model = string(body, "model", required=True)
    if not model:
        raise bad_value("`model` must not be empty", "model")
    return model
