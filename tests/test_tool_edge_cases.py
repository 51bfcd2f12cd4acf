"""Tool calling at its edges: parameters schemas that OpenAI takes (and those it refuses), a call the
token limit cut short, arguments that are not strict JSON, and a stream that adds up to its whole answer."""
from __future__ import annotations

import json

import llguidance
import pytest

import app.tool_params
import scripts.stand_in_node as stand_in
from app.responses import CHAT, ChunkWriter, chat_completion
from app.structured import structured_output
from engine.protocol import APIError
from engine.tools import tool_call_grammar
from tests.test_gateway_support import auth, client, gateway, node  # noqa: F401 (fixtures)
from tests.test_gateway_tools import _ByteTokenizer

MSGS = [{"role": "user", "content": "weather?"}]


def _tool(parameters, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _obj(**properties) -> dict:
    return {"type": "object", "properties": properties}


# ------------------------------------------------------------------------------- parameters schemas

# what pydantic and OpenAPI write, which llguidance does not implement (or knows no format of)
UNENFORCED = {
    "pydantic Path, SecretStr, bytes": _obj(p={"type": "string", "format": "path"},
                                            pw={"type": "string", "format": "password", "writeOnly": True},
                                            b={"type": "string", "format": "binary"}),
    "OpenAPI formats": _obj(b={"type": "string", "format": "byte"}, n={"type": "string", "format": "int32"},
                            u={"type": "string", "format": "uri-reference"}),
    "uniqueItems": _obj(tags={"type": "array", "items": {"type": "string"}, "uniqueItems": True}),
    "not": _obj(v={"not": {"type": "null"}}),
    "if/then": {**_obj(a={"type": "integer"}, b={"type": "string"}),
                "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
}


@pytest.mark.parametrize("choice", ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}])
@pytest.mark.parametrize("parameters", UNENFORCED.values(), ids=UNENFORCED.keys())
def test_schemas_openai_takes_are_taken(client, auth, node, parameters, choice):  # noqa: F811
    r = client.post("/v1/chat/completions", headers=auth, json={"model": "zen-small", "messages": MSGS,
                                                                "tools": [_tool(parameters)], "tool_choice": choice})
    assert r.status_code == 200, r.get_json()
    forced = "structured_output" in node.received[-1]["sampling"]
    assert forced == (choice not in ("auto", "none"))


@pytest.mark.parametrize("schema", UNENFORCED.values(), ids=UNENFORCED.keys())
def test_response_format_takes_them_too(schema):
    spec, _ = structured_output({"response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": schema}}})
    assert spec["value"] == schema


@pytest.mark.parametrize("schema", [{"type": "strin"}, _obj(a={"minLength": "x"}), _obj(a={"$ref": "#/$defs/No"})])
def test_what_is_no_schema_is_still_refused(schema):
    with pytest.raises(APIError) as e:
        structured_output({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert e.value.status == 400 and e.value.param == "response_format"
    with pytest.raises(APIError) as e:
        app.tool_params.tool_plan({"tools": [_tool(schema)], "tool_choice": "required"}, False)
    assert e.value.status == 400 and e.value.param == "tools"


@pytest.mark.parametrize("parameters", [
    {"type": "string", "enum": ["Paris"]}, {"type": "array", "items": {"type": "integer"}},
    {"type": ["object", "null"]},
    {"type": "object", "properties": ["city"]}, "{}", [],
])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_parameters_must_be_an_object_schema(client, auth, node, parameters, choice):  # noqa: F811
    r = client.post("/v1/chat/completions", headers=auth, json={"model": "zen-small", "messages": MSGS,
                                                                "tools": [_tool(parameters)], "tool_choice": choice})
    error = r.get_json()["error"]
    assert r.status_code == 400 and error["param"] == "tools" and error["type"] == "invalid_request_error"
    assert "tools[0].function.parameters" in error["message"]


def _accepts(grammar: str, text: str) -> bool:
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    m = llguidance.LLMatcher(tok, llguidance.grammar_from("lark", grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


def test_a_forced_call_without_a_type_still_takes_an_object():
    grammar = tool_call_grammar([{"name": "f", "parameters": {"properties": {"a": {"type": "integer"}}}}], False)
    assert _accepts(grammar, '<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>')
    assert not _accepts(grammar, '<tool_call>{"name":"f","arguments":"a"}</tool_call>')


# what `$id` changes: `#` is the parameters themselves, however deep they are nested
ID_PARAMS = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.com/schemas/lookup",
             "type": "object", "$defs": {"City": {"type": "string", "enum": ["Paris", "Tokyo"]}},
             "properties": {"city": {"$ref": "#/$defs/City"},
                            "also": {"$ref": "https://example.com/schemas/lookup#/$defs/City"}},
             "required": ["city"], "additionalProperties": False}


def test_parameters_with_their_own_id_are_enforced(client, auth, node):  # noqa: F811
    body = {"model": "zen-small", "messages": MSGS, "tools": [_tool(ID_PARAMS)], "tool_choice": "required"}
    assert client.post("/v1/chat/completions", headers=auth, json=body).status_code == 200
    grammar = tool_call_grammar([{"name": "f", "parameters": ID_PARAMS}], False)
    assert _accepts(grammar, '<tool_call>{"name":"f","arguments":{"city":"Paris","also":"Tokyo"}}</tool_call>')
    assert not _accepts(grammar, '<tool_call>{"name":"f","arguments":{"city":"Oslo"}}</tool_call>')


def test_a_schema_that_cannot_be_enforced_is_a_400_in_the_clients_terms(client, auth, node):  # noqa: F811
    bad = _obj(city={"$ref": "#/$defs/Missing"})
    body = {"model": "zen-small", "messages": MSGS, "tools": [_tool(ID_PARAMS, "g"), _tool(bad)],
            "tool_choice": "required"}
    r = client.post("/v1/chat/completions", headers=auth, json=body)
    error = r.get_json()["error"]
    assert r.status_code == 400 and error["param"] == "tools"
    assert "tools[1].function.parameters" in error["message"] and "'/$defs/Missing'" in error["message"]
    assert "%json" not in error["message"] and "start:" not in error["message"]


def test_a_grammar_that_does_not_compile_is_not_shown(monkeypatch):
    # the call's grammar is the server's: whatever fails in it, the 400 says why without it
    monkeypatch.setattr(app.tool_params, "tool_call_grammar", lambda functions, parallel:
                        'start: "<tool_call>" x "</tool_call>"\nx: %json {"$ref": "#/nowhere"}')
    with pytest.raises(APIError) as e:
        app.tool_params.tool_plan({"tools": [_tool(_obj())], "tool_choice": "required"}, False)
    assert e.value.status == 400 and "nowhere" in e.value.message
    assert "\n" not in e.value.message and "start:" not in e.value.message


# ----------------------------------------------------------------------------- answers and streams

def _whole(text: str, mode: str, reason: str) -> tuple[str | None, list[tuple[str, str]], str]:
    [choice] = chat_completion("r", "zen-small", "m", "q", {"choices": [
        {"index": 0, "text": text, "finish_reason": reason}], "usage": {}}, None, mode)["choices"]
    m = choice["message"]
    return m["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])], \
        choice["finish_reason"]


def _streamed(text: str, mode: str, reason: str, piece: int) -> tuple[str | None, list[tuple[str, str]], str]:
    """What a client (the OpenAI SDK's stream accumulation) makes of the chunks of text sent in pieces."""
    writer = ChunkWriter(CHAT, "r", "zen-small", "m", "q", 1, False, None, mode)
    chunks = "".join(writer.start())
    chunks += "".join(writer.token({"index": 0, "text": text[i:i + piece]}) for i in range(0, len(text), piece))
    chunks += "".join(writer.done({"choices": [{"index": 0, "finish_reason": reason}]}))
    chunks.encode("utf-8")   # what the server writes: a lone surrogate would fail here
    content, calls, finish = None, {}, None
    for e in (json.loads(line[6:]) for line in chunks.split("\n\n") if line.startswith("data: ")):
        d = e["choices"][0]["delta"]
        if d.get("content") is not None:
            content = (content or "") + d["content"]
        for tc in d.get("tool_calls") or []:
            c = calls.setdefault(tc["index"], ["", ""])
            c[0] += tc.get("function", {}).get("name") or ""
            c[1] += tc.get("function", {}).get("arguments") or ""
        finish = e["choices"][0]["finish_reason"] or finish
    return content, [tuple(c) for c in calls.values()], finish


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
CUT = [   # text cut by the token limit -> (content, calls) of the answer
    ('<tool_call>{"name":"get_weather","arguments":{"city":"Par', (None, [("get_weather", '{"city":"Par')])),
    ('<tool_call>{"name":"get_weather","', (None, [("get_weather", "")])),
    ('<tool_call>{"name":"get_wea', ("", [])),                                          # half a name calls nothing
    ('<tool_call>', ("", [])),
    ('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "P', ("Sure.", [("get_weather", '{"city": "P')])),
    ('<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_',         # whole but for its close tag
     (None, [("get_weather", '{"city": "Paris"}')])),
    ('<tool_call>{"name":"n","arguments":{"t":"a </tool_', (None, [("n", '{"t":"a </tool_')])),   # in a string: text
    (CALL + '\n<tool_call>{"name":"now","arguments":{', (None, [("get_weather", '{"city": "Paris"}'), ("now", "{")])),
]


@pytest.mark.parametrize("text, answer", CUT)
def test_a_call_cut_by_the_token_limit_is_returned_as_far_as_it_came(text, answer):
    content, calls, finish = _whole(text, "parallel", "length")
    assert (content, calls, finish) == (*answer, "length")
    for piece in (1, 5, len(text)):
        assert _streamed(text, "parallel", "length", piece) == (content, calls, "length")


def test_a_cut_call_through_the_gateway_streamed_or_not(client, auth, node, monkeypatch):  # noqa: F811
    pieces = ['<tool_call>', '{"name":', '"get_weather"', ',"arguments":', '{"city":', '"Par']
    monkeypatch.setattr(stand_in, "TOKENS", list(enumerate(pieces)))
    body = {"model": "zen-small", "messages": MSGS, "tools": [_tool(_obj(), "get_weather")], "max_tokens": len(pieces)}
    whole = client.post("/v1/chat/completions", headers=auth, json=body).get_json()["choices"][0]
    assert whole["finish_reason"] == "length" and whole["message"]["content"] is None
    [call] = whole["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Par'}
    events = [json.loads(line[6:]) for line in client.post(
        "/v1/chat/completions", headers=auth, json={**body, "stream": True}).get_data(as_text=True).split("\n\n")
        if line.startswith("data: {")]
    deltas = [e["choices"][0] for e in events]
    assert not any(d["delta"].get("content") for d in deltas)
    assert "".join(tc["function"].get("arguments", "") for d in deltas for tc in d["delta"].get("tool_calls", [])) \
        == '{"city":"Par'
    assert deltas[-1]["finish_reason"] == "length"


# arguments (or a name) Python's json reads but that are no JSON a client can take
NOT_JSON = ['{"x": 1e999}', '{"x": NaN}', '{"x": -Infinity}', '{"s": "\\ud800"}', '"{\\"x\\": NaN}"',
            '"{\\"s\\": \\"\\\\udfff\\"}"']


@pytest.mark.parametrize("arguments", NOT_JSON)
@pytest.mark.parametrize("reason", ["stop", "length"])
def test_arguments_that_are_not_strict_json_are_text(arguments, reason):
    text = '<tool_call>{"name": "f", "arguments": ' + arguments + '}</tool_call>'
    assert _whole(text, "parallel", reason) == (text, [], reason)
    assert _streamed(text, "parallel", reason, 4) == (text, [], reason)


def test_a_name_that_is_no_text_is_no_call():
    text = '<tool_call>{"name": "\\udc00", "arguments": {}}</tool_call>'
    assert _whole(text, "parallel", "stop") == (text, [], "stop")
    assert _streamed(text, "parallel", "length", 3) == (text, [], "length")
    assert _streamed('<tool_call>{"name": "\\udc00", "arguments": {"a', "parallel", "length", 3) == ("", [], "length")


@pytest.mark.parametrize("mode", ["parallel", "single"])
@pytest.mark.parametrize("reason", ["stop", "length"])
@pytest.mark.parametrize("text", [CALL, CALL + "\n" + CALL, " " + CALL + "\n", "no call", "", "a\n" + CALL])
def test_a_stream_adds_up_to_its_whole_answer_content_null_included(text, mode, reason):
    whole = _whole(text, mode, reason)
    assert whole == _streamed(text, mode, reason, 1) == _streamed(text, mode, reason, 6)
    if text.strip().startswith("<tool_call>"):
        assert whole[0] is None    # calls only: no content, in the stream as in the whole answer


def test_a_plain_answer_starts_with_empty_content():
    writer = ChunkWriter(CHAT, "r", "zen-small", "m", "q", 1, False, None, None)
    assert json.loads(writer.start()[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
