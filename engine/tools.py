"""The tool-call format: how tools reach a chat prompt, what a call looks like in the model's output, the
grammar that forces a valid call, and the parser that finds calls in generated text.

A call is written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (several in a row when
parallel calls are allowed): the format of the Hermes/Qwen family of templates. A model whose chat
template renders `tools` itself gets them there; any other template gets the default rendering
(`render_tool_prompt`): the tools and the call format described in the system message, earlier calls as
the assistant's text and tool results as user messages in `<tool_response>` tags (docs/structured-outputs.md).

The gateway builds the grammar (tool_choice "required" or a named function) and parses the output; the
node renders the prompt. Nothing here imports more than the standard library, the wire protocol and the
chat messages' checks.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.protocol import json_value
from models.chat_template import normalize_messages

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
ANY_OBJECT = {"type": "object"}
# compact JSON inside calls, and keywords or formats llguidance does not implement left unenforced, as for
# response_format (engine/grammar.py's reasons)
_CALL_OPTIONS = {"whitespace_flexible": False, "lenient": True}

DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more functions to help with the user's request. The functions, described as JSON \
schemas:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object that names it and gives its arguments, inside tags:
<tool_call>{{"name": <function name>, "arguments": <arguments as a JSON object>}}</tool_call>"""


# ------------------------------------------------------------------------------------------ grammar

_ARGUMENTS = "/properties/arguments"   # where a function's parameters sit in its call's schema
_LITERAL_KEYWORDS = ("const", "enum", "default", "examples")   # their values are data, not schemas
# their values map names (a property's, a definition's) to schemas: a name is never a keyword
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _rebased(schema: Any, prefix: str, names: bool = False) -> Any:
    """schema with its local references (`#`, `#/...`) pointing under `prefix`: the parameters' `$defs`
    (what `openai.pydantic_function_tool` writes for nested models) stay reachable once nested. With
    `names`, schema is a map of names to schemas."""
    if isinstance(schema, list):
        return [_rebased(v, prefix) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if names:
            out[key] = _rebased(value, prefix)
        elif key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = "#" + prefix + value[1:]
        elif key in _LITERAL_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, prefix, names=key in _SCHEMA_MAPS)
    return out


def _arguments_schema(parameters: dict | None) -> dict:
    """The parameters as the schema of a call's arguments, always an object. With an `$id` of their own
    they are a schema resource, whose references resolve inside it: nested as they are; without, their
    local references are rebased to where they now sit."""
    schema = parameters or ANY_OBJECT
    own_id = schema.get("$id")
    if not (isinstance(own_id, str) and own_id and not own_id.startswith("#")):   # "#name": an anchor
        schema = _rebased(schema, _ARGUMENTS)
    return {**schema, "type": "object"}


def _call_schema(function: dict) -> dict:
    """The JSON schema of one call of `function`: its name, and arguments matching its parameters."""
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": function["name"]},
                           "arguments": _arguments_schema(function.get("parameters"))},
            "x-guidance": _CALL_OPTIONS}


def tool_call_grammar(functions: list[dict], parallel: bool) -> str:
    """A Lark grammar (llguidance's, with %json) whose sentences are one valid call of one of
    `functions` ({name, parameters}), or several separated by newlines when `parallel`."""
    alternatives = []
    rules = []
    for i, f in enumerate(functions):
        rules.append(f"fn_{i}: %json {json.dumps(_call_schema(f))}")
        alternatives.append(f"fn_{i}")
    head = "start: call (\"\\n\" call)*" if parallel else "start: call"
    call = f"call: {json.dumps(CALL_OPEN)} ({' | '.join(alternatives)}) {json.dumps(CALL_CLOSE)}"
    return "\n".join([head, call, *rules])


# ---------------------------------------------------------------------------------------- the prompt

def _objects(messages) -> list[dict]:
    """The messages, each an object (ValueError otherwise: the caller answers 400)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages must be a list of {role, content} objects")
    return messages


def _call_function(call) -> dict:
    """A history's tool call's function with its arguments as JSON values where they parse (ValueError for
    a call that is no {id, type, function} object)."""
    f = (call.get("function") or {}) if isinstance(call, dict) else None
    if not isinstance(f, dict):
        raise ValueError("tool_calls must hold {id, type, function} objects, function an object")
    f = dict(f)
    if isinstance(f.get("arguments"), str):
        try:
            f["arguments"] = json_value(f["arguments"])
        except ValueError:
            pass
    return f


def _call_text(call) -> str:
    f = _call_function(call)
    return CALL_OPEN + json.dumps({"name": f.get("name"), "arguments": f.get("arguments")},
                                  ensure_ascii=False) + CALL_CLOSE


def uses_tools(messages, tools) -> bool:
    """Whether a chat needs tool rendering: tools given, or calls and results in its history."""
    return bool(tools) or (isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in messages))


def render_tool_prompt(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The default rendering, for a chat template that knows nothing of tools: plain messages only (the
    tools described in the system message when there are any)."""
    out: list[dict] = []
    results = False   # the last message out holds tool results
    for m in normalize_messages(messages):   # contents as text
        role, content = m["role"], m["content"]
        # a turn's results, and a user message after them, in one user message: templates want turns to alternate
        if role == "tool" or (role == "user" and results):
            text = f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}" if role == "tool" else content
            if results:
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text})
            results = role == "tool"
            continue
        results = False
        if role == "assistant" and isinstance(m.get("tool_calls"), list):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + calls})
        else:
            out.append({"role": role, "content": content})
    if not tools:
        return out
    note = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + note}
    else:
        out.insert(0, {"role": "system", "content": note})
    return out


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages for a template that renders tools itself: call arguments as objects (what such
    templates iterate over), everything else as given."""
    out = []
    for m in _objects(messages):
        if isinstance(m.get("tool_calls"), list):
            calls = []
            for c in m["tool_calls"]:
                if not isinstance(c, dict):
                    raise ValueError("tool_calls must hold {id, type, function} objects")
                calls.append({**c, "function": _call_function(c)})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


# ------------------------------------------------------------------------------------------- parser

@dataclass
class ToolCall:
    name: str
    arguments: str   # JSON text, as OpenAI's function.arguments


def _strict_json(value: Any) -> str | None:
    """value as JSON text a client can read: None when it holds NaN or an infinity (Python's json reads
    `NaN` and `1e999`) or a lone surrogate (an escape such as "\\ud800", which UTF-8 cannot encode)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except ValueError:   # UnicodeEncodeError is one
        return None
    return text


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json_value(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or _strict_json(obj["name"]) is None:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):   # a model that wrote the arguments as JSON text: an object's, or no call
        try:
            args = json_value(args)
        except ValueError:
            return None
    # OpenAI's arguments are a JSON object (clients json.loads them and expect one), in strict JSON
    text = _strict_json(args) if isinstance(args, dict) else None
    return ToolCall(obj["name"], text) if text is not None else None


# the beginning of a call cut short: its name (whole), then the arguments so far
_OPEN_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")(?:\s*,\s*"(?:arguments|parameters)"\s*:\s*(.*))?',
                        re.DOTALL)


def _cut_call(body: str) -> list[tuple[str, Any]]:
    """The pieces of a block that the token limit cut short (body: its JSON text so far, without a close
    tag): whole JSON is read as a closed block is; else, once the name is whole, a call with the
    arguments' text so far (not JSON yet); else nothing (half a name calls nothing, and markup is no answer)."""
    try:
        json_value(body)
    except ValueError:
        match = _OPEN_CALL.match(body)
        try:
            name = json_value(match.group(1)) if match else None
        except ValueError:
            name = None
        if name is None or _strict_json(name) is None:
            return []
        return [("call", ToolCall(name, match.group(2) or ""))]
    call = _parse_call(body)
    return [("call", call)] if call else [("text", CALL_OPEN + body)]


# inside a call: what changes whether the JSON text is in a string, and the close tag
_CALL_MARKS = re.compile(r'["\\]|' + re.escape(CALL_CLOSE))


class ToolCallParser:
    """Generated text in, pieces out: ("text", str) safe to show as content, and ("call", ToolCall) for
    each complete call. A tail that may begin a call is held back until it is known; a block that does
    not hold a valid call is content after all. A call's text is scanned once, however it arrives."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._scanned = 0          # inside a call: how far the buffer was scanned, and whether that point
        self._in_string = False    # is inside a JSON string (a close tag there is the arguments' text)

    def push(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        out: list[tuple[str, Any]] = []
        while True:
            if self._in_call:
                end = self._call_end()
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(CALL_CLOSE):]
                self._in_call, self._scanned, self._in_string = False, 0, False
                call = _parse_call(body)
                if call is None and CALL_CLOSE in body:   # a stray quote hid the close tag that ends it
                    at = body.index(CALL_CLOSE)
                    body, self._buf = body[:at], body[at + len(CALL_CLOSE):] + CALL_CLOSE + self._buf
                    call = _parse_call(body)
                out.append(("call", call) if call else ("text", CALL_OPEN + body + CALL_CLOSE))
                continue
            start = self._buf.find(CALL_OPEN)
            if start >= 0:
                if start:
                    out.append(("text", self._buf[:start]))
                self._buf, self._in_call = self._buf[start + len(CALL_OPEN):], True
                continue
            keep = _partial_tail(self._buf, CALL_OPEN)
            if len(self._buf) > keep:
                out.append(("text", self._buf[:len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep:]
            return out

    def _call_end(self) -> int:
        """Where the call's close tag outside any JSON string begins, or -1 while there is none yet;
        scanning on from where the last push left off."""
        buf, pos = self._buf, self._scanned
        while (mark := _CALL_MARKS.search(buf, pos)) is not None:
            token = mark.group()
            if token == CALL_CLOSE and not self._in_string:
                return mark.start()
            if token == "\\" and self._in_string:
                pos = mark.end() + 1           # past what it escapes, which may not have come yet
                continue
            if token == '"':
                self._in_string = not self._in_string
            pos = mark.end()
        # no quote or backslash past pos: only a close tag cut at the end may still complete
        self._scanned = max(pos, len(buf) - len(CALL_CLOSE) + 1)
        return -1

    def finish(self, cut: bool = False) -> list[tuple[str, Any]]:
        """The end of the text: what was held back is content, an unclosed call too; unless `cut` (by the
        token limit), where an unclosed call is read by `_cut_call`."""
        body, in_call, in_string = self._buf, self._in_call, self._in_string
        self._buf, self._in_call, self._scanned, self._in_string = "", False, 0, False
        if not in_call:
            return [("text", body)] if body else []
        if in_string and CALL_CLOSE in body:   # a stray quote hid the close tag that ends the call
            at = body.index(CALL_CLOSE)
            call = _parse_call(body[:at])
            first = ("call", call) if call else ("text", CALL_OPEN + body[:at] + CALL_CLOSE)
            return [first] + self.push(body[at + len(CALL_CLOSE):]) + self.finish(cut)
        if not cut:
            return [("text", CALL_OPEN + body)]
        if not in_string:   # a close tag cut short is markup, not the arguments' text
            body = body[:len(body) - _partial_tail(body, CALL_CLOSE)]
        return _cut_call(body)


def _partial_tail(buf: str, tag: str) -> int:
    """Length of the longest tail of buf that is a proper beginning of tag."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0

