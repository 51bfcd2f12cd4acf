"""`tools`, `tool_choice` and `parallel_tool_calls` of a chat request, checked: what the node renders
into the prompt, the constraint that forces a call ("required" or a named function), and whether the
answer is parsed for calls. The call format itself is engine/tools.py's."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from app import structured
from app.strict_schema import closed, is_strict
from engine.grammar import GrammarError, check_constraint
from engine.protocol import bad_value
from engine.tools import tool_call_grammar

MAX_TOOLS = 128
_GRAMMAR_PLACE = re.compile(r"^.*? at \d+\(\d+\): ")   # "the grammar constraint is invalid: at 3(7): "
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ToolPlan:
    """What the gateway does with a request's tools."""
    tools: tuple[dict, ...] | None      # sent to the node for the chat template (None: no tools)
    constraint: dict | None             # the grammar of a forced call
    parse: str | None                   # look for calls in the answer: "single" or "parallel"; None: not


NO_TOOLS = ToolPlan(None, None, None)


def _function(tool: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
            or not isinstance(tool.get("function"), dict):
        raise bad_value(f"`{where}` must be {{type: \"function\", function: {{name, description, parameters}}}}",
                        "tools", "invalid_type")
    f = tool["function"]
    name = f.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_value(f"`{where}.function.name` must be 1 to 64 letters, digits, _ or -", "tools")
    if f.get("description") is not None and not isinstance(f["description"], str):
        raise bad_value(f"`{where}.function.description` must be a string", "tools", "invalid_type")
    params = f.get("parameters")
    # the arguments of a call are a JSON object; whether llguidance can enforce the schema matters only when
    # a call is forced (_enforceable): the model reads it otherwise, as OpenAI's does
    if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"
                               or not isinstance(params.get("properties", {}), dict)):
        raise bad_value(f"`{where}.function.parameters` must be a JSON schema of an object (`type` \"object\" "
                        "or none, `properties` an object)", "tools", "invalid_type")
    out = {"name": name, "parameters": params or {"type": "object", "properties": {}}}
    if f.get("description"):
        out["description"] = f["description"]
    return out


def _chosen(choice: Any, names: list[str]) -> str | None:
    """tool_choice: "none" | "auto" | "required", or the name of the function it forces."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_value("`tool_choice` must be none, auto, required or {type: function, function: {name}}",
                            "tool_choice")
        return choice
    f = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise bad_value("`tool_choice` must be none, auto, required or {type: function, function: {name}}",
                        "tool_choice", "invalid_type")
    if f["name"] not in names:
        raise bad_value(f"`tool_choice` names {f['name']!r}, which is not in `tools`", "tool_choice")
    return "named"


def tool_plan(body: Mapping[str, Any], has_constraint: bool) -> ToolPlan:
    """The request's ToolPlan; 400 naming tools, tool_choice or parallel_tool_calls when they are bad."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is None:   # absent or null: the default
        parallel = True
    if not isinstance(parallel, bool):
        raise bad_value("`parallel_tool_calls` must be a boolean", "parallel_tool_calls", "invalid_type")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise bad_value("`tool_choice` needs `tools`", "tool_choice")
        return NO_TOOLS
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_value(f"`tools` must be an array of at most {MAX_TOOLS} function tools", "tools", "invalid_type")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    strict = [is_strict(t["function"].get("strict"), f"tools[{i}].function", "tools") for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_value("`tools` names a function twice", "tools")
    mode = _chosen(choice, names)
    rendered = tuple({"type": "function", "function": f} for f in functions)
    if mode == "none":   # the model still sees its tools (as vLLM does), and its answer is plain text
        return ToolPlan(rendered, None, None)
    parse = "parallel" if parallel else "single"
    if mode == "auto":
        return ToolPlan(rendered, None, parse)
    if has_constraint:
        raise bad_value("`tool_choice` that forces a call cannot be combined with `response_format` or "
                        "another structured output", "tool_choice")
    # a strict function's forced arguments hold no properties its parameters do not name (OpenAI's `strict`)
    enforced = [{**f, "parameters": closed(f["parameters"], "tools")} if s else f for f, s in zip(functions, strict)]
    if mode == "required":
        forced = enforced
    else:   # a named function: one call of it (a repeatable call ran on to max_tokens with small models)
        forced, parallel = [f for f in enforced if f["name"] == choice["function"]["name"]], False
    for f in forced:
        _enforceable(f, names.index(f["name"]))
    return ToolPlan(rendered, _forced_call(forced, parallel), parse if mode == "required" else "single")


def _enforceable(function: dict, i: int) -> None:
    """400 naming the function whose parameters llguidance cannot compile (their own pointers in the
    message, not those of the call's grammar); keywords and formats it does not implement are no fault."""
    try:
        check_constraint({"type": "json", "value": function["parameters"]})
    except GrammarError as e:
        reason = str(e).split(": ", 1)[-1]   # after "the json constraint is invalid"
        raise bad_value(f"`tools[{i}].function.parameters` cannot be enforced: {reason}", "tools") from None


def _forced_call(functions: list[dict], parallel: bool) -> dict:
    """The grammar constraint of a forced call; a 400 that does not show the grammar (the server's, not
    the client's) if it does not compile."""
    spec = {"type": "grammar", "value": tool_call_grammar(functions, parallel)}
    try:
        check_constraint(spec)
    except GrammarError as e:
        reason = _GRAMMAR_PLACE.sub("", str(e).splitlines()[0])   # the grammar's lines follow
        raise bad_value(f"`tools` cannot be enforced: {reason}", "tools") from None
    return structured.check(spec, "tools")
