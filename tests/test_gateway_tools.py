"""Tool calling at the gateway: what reaches the node (tools for the template, the grammar of a forced
call), and the node's text turned into message.tool_calls or streamed tool-call deltas."""
from __future__ import annotations

import json
import random

import llguidance
import pytest

from app.responses import CHAT, ChunkWriter, chat_completion
from app.strict_schema import closed
from app.tool_params import tool_plan
from engine.protocol import APIError
from engine.tools import ToolCall, ToolCallParser, render_tool_prompt, tool_call_grammar
from tests.test_gateway_support import auth, client, gateway, node  # noqa: F401 (fixtures)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now"}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _chat(**over):
    return {"model": "zen-small", "messages": [{"role": "user", "content": "weather?"}], **over}


def test_auto_sends_the_tools_and_no_constraint(client, auth, node):  # noqa: F811
    assert client.post("/v1/chat/completions", headers=auth, json=_chat(tools=[WEATHER, CLOCK])).status_code == 200
    sent = node.received[-1]
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_weather", "now"]
    assert "structured_output" not in sent["sampling"]


@pytest.mark.parametrize("choice, names, parallel, repeats", [
    ("required", ["get_weather", "now"], True, True),
    ("required", ["get_weather", "now"], False, False),
    ({"type": "function", "function": {"name": "now"}}, ["now"], False, False),
    ({"type": "function", "function": {"name": "now"}}, ["now"], True, False),   # a named function: one call
])
def test_a_forced_call_is_a_grammar_of_the_allowed_functions(client, auth, node, choice, names, parallel,  # noqa: F811
                                                             repeats):
    body = _chat(tools=[WEATHER, CLOCK], tool_choice=choice, parallel_tool_calls=parallel)
    assert client.post("/v1/chat/completions", headers=auth, json=body).status_code == 200
    grammar = node.received[-1]["sampling"]["structured_output"]
    assert grammar["type"] == "grammar"
    assert all(f'"const": "{n}"' in grammar["value"] for n in names)
    assert ('"const": "get_weather"' in grammar["value"]) == ("get_weather" in names)
    assert grammar["value"].startswith("start: call (" if repeats else "start: call\n")


def test_none_sends_the_tools_but_no_constraint(client, auth, node):  # noqa: F811
    client.post("/v1/chat/completions", headers=auth, json=_chat(tools=[WEATHER], tool_choice="none"))
    assert node.received[-1]["tools"][0]["function"]["name"] == "get_weather"
    assert "structured_output" not in node.received[-1]["sampling"]


def test_history_with_calls_and_results_reaches_the_node(client, auth, node):  # noqa: F811
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert client.post("/v1/chat/completions", headers=auth, json=_chat(messages=msgs, tools=[WEATHER])).status_code == 200
    sent = node.received[-1]["messages"]
    assert sent[1]["tool_calls"][0]["function"]["name"] == "get_weather" and sent[2]["tool_call_id"] == "call_1"


def test_the_grammar_accepts_exactly_valid_calls():
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    grammar = llguidance.grammar_from("lark", tool_call_grammar([WEATHER["function"]], parallel=False))

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        return m.consume_tokens(list(text.encode())) and m.is_accepting()
    assert accepts('<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>')
    assert not accepts('<tool_call>{"name":"get_weather","arguments":{}}</tool_call>')      # city required
    assert not accepts('<tool_call>{"name":"now","arguments":{}}</tool_call>')
    assert not accepts('<tool_call>{"name":"get_weather","arguments":{"city":"a"}}</tool_call>\n' * 2)


def test_a_strict_function_forced_call_holds_only_the_properties_its_parameters_name():
    """`strict` closes the parameters' objects that do not say otherwise (OpenAI's strict mode); without it
    they stay open, as JSON Schema has them. A strict flag that is no boolean is a 400 naming tools."""
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    params = {"type": "object", "properties": {"city": {"type": "string"},
                                               "where": {"type": "object", "properties": {"lat": {"type": "number"}}}}}
    extra = '<tool_call>{"name":"f","arguments":{"city":"a","where":{"lat":1,"alt":2}}}</tool_call>'
    plain = '<tool_call>{"name":"f","arguments":{"city":"a","where":{"lat":1}}}</tool_call>'
    for strict, takes_extra in ((None, True), (False, True), (True, False)):
        tool = {"type": "function", "function": {"name": "f", "parameters": params, "strict": strict}}
        plan = tool_plan({"tools": [tool], "tool_choice": "required"}, has_constraint=False)
        grammar = llguidance.grammar_from("lark", plan.constraint["value"])

        def accepts(text: str) -> bool:
            m = llguidance.LLMatcher(tok, grammar, log_level=0)
            return m.consume_tokens(list(text.encode())) and m.is_accepting()
        assert accepts(plain) and accepts(extra) == takes_extra, strict
        assert plan.tools[0]["function"]["parameters"] == params   # the model reads them as given
    bad = {"type": "function", "function": {"name": "f", "strict": "yes"}}
    with pytest.raises(APIError) as e:
        tool_plan({"tools": [bad]}, has_constraint=False)
    assert e.value.param == "tools" and "strict" in e.value.message


OBJ = {"type": "object", "properties": {"z": {"type": "integer"}}}   # a property value: closed in every case


@pytest.mark.parametrize("schema, takes, refuses", [
    # allOf parts, and a definition mixed in through allOf, add to the same object: none is closed
    ({"allOf": [{"type": "object", "properties": {"a": {}}}, {"properties": {"b": {}, "o": OBJ}}]},
     ['{"a":1,"b":2}'], ['{"o":{"z":1,"y":2}}']),
    ({"$defs": {"Base": {"type": "object", "properties": {"a": {"type": "integer"}}}}, "type": "object",
      "allOf": [{"$ref": "#/$defs/Base"}], "properties": {"b": {"type": "integer"}}, "required": ["b"]},
     ['{"a":1,"b":2}'], []),
    # branches beside the object's own properties add to it; a union's branches are each the whole value
    ({"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"],
      "anyOf": [{"properties": {"x": {"type": "integer"}}}, {"properties": {"y": {"type": "integer"}}}]},
     ['{"kind":"k","x":1}'], []),
    ({"type": "object", "properties": {"v": {"anyOf": [OBJ, {"type": "null"}]}}, "required": ["v"]},
     ['{"v":{"z":1}}', '{"v":null}'], ['{"v":{"z":1,"y":2}}', '{"v":null,"w":1}']),
    # a $ref with only a description is the referenced value: closed
    ({"$defs": {"O": OBJ}, "type": "object", "properties": {"o": {"$ref": "#/$defs/O", "description": "d"}}},
     ['{"o":{"z":1}}'], ['{"o":{"z":1,"y":2}}']),
])
def test_strict_closes_the_objects_of_values_and_leaves_those_composed_beside_others(schema, takes, refuses):
    """Valid output of the schema stays valid once closed; what closing refuses is a property no schema of
    that value names."""
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    grammar = llguidance.grammar_from("json_schema", json.dumps(closed(schema, "response_format")))
    for text, fits in [(t, True) for t in takes] + [(t, False) for t in refuses]:
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        assert (m.consume_tokens(list(text.encode())) and m.is_accepting()) == fits, text


def test_closing_refuses_a_schema_nested_past_recursion():
    deep = {"type": "object"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(APIError) as e:
        closed(deep, "response_format")
    assert e.value.status == 400 and e.value.param == "response_format"


def _plan(field: str = "steps", definition: str = "Step") -> dict:
    """What openai.pydantic_function_tool writes for a model with a nested model: references into $defs."""
    return {"type": "function", "function": {"name": "plan", "parameters": {
        "$defs": {definition: {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"],
                               "additionalProperties": False}},
        "type": "object", "properties": {field: {"type": "array", "items": {"$ref": f"#/$defs/{definition}"}}},
        "required": [field], "additionalProperties": False}}}


PLAN = _plan()


# names that are also keywords whose values are data: a property or a definition may be called so
@pytest.mark.parametrize("field, definition", [
    ("steps", "Step"), ("examples", "Step"), ("default", "Step"), ("enum", "const"), ("const", "examples")])
def test_a_forced_call_follows_the_parameters_references(field, definition):
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    grammar = llguidance.grammar_from("lark", tool_call_grammar([_plan(field, definition)["function"]], parallel=False))

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m.consume_tokens(list(text.encode())) and m.is_accepting()
    assert accepts('<tool_call>{"name":"plan","arguments":{"%s":[{"x":"a"}]}}</tool_call>' % field)
    assert not accepts('<tool_call>{"name":"plan","arguments":{"%s":[{"y":"a"}]}}</tool_call>' % field)


def test_a_forced_call_with_references_is_accepted(client, auth, node):  # noqa: F811
    body = _chat(tools=[PLAN], tool_choice="required", parallel_tool_calls=None)   # null: the default
    assert client.post("/v1/chat/completions", headers=auth, json=body).status_code == 200
    assert node.received[-1]["sampling"]["structured_output"]["value"].startswith("start: call (")



def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The whole text through the parser at once: (content without the calls, the calls)."""
    parser = ToolCallParser()
    pieces = parser.push(text) + parser.finish()
    return "".join(p for kind, p in pieces if kind == "text"), [p for kind, p in pieces if kind == "call"]

class _ByteTokenizer:
    """One token per byte (and an EOS): enough for llguidance to run a grammar over text."""
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, s):
        return list(s.encode() if isinstance(s, str) else s)


def test_whole_answers_become_tool_calls():
    body = {"choices": [{"index": 0, "text": "Let me check.\n" + CALL, "finish_reason": "stop"},
                        {"index": 1, "text": "No call here", "finish_reason": "stop"},
                        {"index": 2, "text": CALL + "\n" + CALL, "finish_reason": "length"}], "usage": {}}
    out = chat_completion("r", "zen-small", "m", "q", body, None, "parallel")
    c0, c1, c2 = out["choices"]
    assert c0["finish_reason"] == "tool_calls" and c0["message"]["content"] == "Let me check."
    call = c0["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert c1["finish_reason"] == "stop" and "tool_calls" not in c1["message"]
    assert c2["finish_reason"] == "length" and len(c2["message"]["tool_calls"]) == 2
    single = chat_completion("r", "zen-small", "m", "q", body, None, "single")["choices"][2]
    assert len(single["message"]["tool_calls"]) == 1 and single["message"]["content"] is None


@pytest.mark.parametrize("arguments, call", [
    ('{"city": "Paris"}', True), ('"{\\"city\\": \\"Paris\\"}"', True),   # an object, or its JSON text
    ('"Paris"', False), ("null", False), ("[1]", False), ('"{broken"', False),
])
def test_a_call_is_one_whose_arguments_are_an_object(arguments, call):
    text = '<tool_call>{"name": "get_weather", "arguments": ' + arguments + '}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert bool(calls) == call and (content == "" if call else content == text)
    if call:
        assert json.loads(calls[0].arguments) == {"city": "Paris"}


def _streamed(text: str, mode: str, piece: int) -> tuple[str, list[tuple[str, dict]], str]:
    """(content, calls, finish reason) that a client reassembles from text streamed in pieces."""
    writer = ChunkWriter(CHAT, "r", "zen-small", "m", "q", 1, False, None, mode)
    chunks = "".join(writer.token({"index": 0, "text": text[i:i + piece]}) for i in range(0, len(text), piece))
    chunks += "".join(writer.done({"choices": [{"index": 0, "finish_reason": "stop"}]}))
    content, calls, finish = "", {}, None
    for e in (json.loads(line[6:]) for line in chunks.split("\n\n") if line.startswith("data: ")):
        d = e["choices"][0]["delta"]
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or []:
            c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            c["name"] += tc.get("function", {}).get("name") or ""
            c["arguments"] += tc.get("function", {}).get("arguments") or ""
        finish = e["choices"][0]["finish_reason"] or finish
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], finish


def test_streamed_deltas_reassemble_into_the_calls():
    text = "ok " + CALL + "\n" + CALL.replace("Paris", "Oslo")
    assert _streamed(text, "parallel", 3) == (
        "ok", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})], "tool_calls")


@pytest.mark.parametrize("mode", ["parallel", "single"])
@pytest.mark.parametrize("text", [
    "Sure" + CALL + "\n" + CALL, CALL + "\n\n", "a\n" + CALL + " b " + CALL + "\n", "no call", " " + CALL,
])
def test_a_whole_answer_is_what_its_stream_adds_up_to(text, mode):
    [choice] = chat_completion("r", "zen-small", "m", "q", {"choices": [
        {"index": 0, "text": text, "finish_reason": "stop"}], "usage": {}}, None, mode)["choices"]
    message = choice["message"]
    whole = (message["content"] or "", [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                        for c in message.get("tool_calls", [])], choice["finish_reason"])
    assert whole == _streamed(text, mode, 1) == _streamed(text, mode, 7)
    assert message["content"] is not None or message.get("tool_calls")


def test_streamed_text_after_a_call_keeps_its_spaces():
    # a space or a newline is often a token of its own: whitespace before a call (or after the last) is a
    # separator; before text it is the text's, as in the whole answer
    text = CALL + "\nIt is" + " " + "25" + " degrees." + "\n\n" + "Bye" + "\n" + CALL + "\n"
    writer = ChunkWriter(CHAT, "r", "zen-small", "m", "q", 1, False, None, "parallel")
    pieces = [CALL, "\n", "It", " is", " ", "25", " degrees.", "\n\n", "Bye", "\n", CALL, "\n"]
    assert "".join(pieces) == text
    chunks = "".join(writer.token({"index": 0, "text": p}) for p in pieces)
    chunks += "".join(writer.done({"choices": [{"index": 0, "finish_reason": "stop"}]}))
    events = [json.loads(line[6:]) for line in chunks.split("\n\n") if line.startswith("data: ")]
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert content == "\nIt is 25 degrees.\n\nBye"
    whole = chat_completion("r", "zen-small", "m", "q", {"choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                                                         "usage": {}}, None, "parallel")
    assert whole["choices"][0]["message"]["content"] == content


def test_streamed_tool_deltas_carry_every_tokens_logprobs():
    writer = ChunkWriter(CHAT, "r", "zen-small", "m", "q", 1, False, 1, "parallel")
    text = "ok " + CALL
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    chunks = "".join(writer.token({"index": 0, "text": piece, "logprobs": {
        "token": piece, "bytes": list(piece.encode()), "logprob": -float(i), "top": []}})
        for i, piece in enumerate(pieces))
    chunks += "".join(writer.done({"choices": [{"index": 0, "finish_reason": "stop"}]}))
    events = [json.loads(line[6:]) for line in chunks.split("\n\n") if line.startswith("data: ")]
    sent = [c["token"] for e in events for c in (e["choices"][0]["logprobs"] or {}).get("content", [])]
    assert sent == pieces   # every token's, once, in order, though the parser held text back


def test_the_parser_holds_back_only_what_may_begin_a_call():
    p = ToolCallParser()
    assert p.push("a <tool") == [("text", "a ")]
    assert p.push("s are") == [("text", "<tools are")]
    assert p.push(" <tool_call>{broken") == [("text", " ")]
    assert p.finish() == [("text", "<tool_call>{broken")]
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_a_close_tag_inside_the_arguments_is_their_text():
    call = '{"name": "note", "arguments": {"text": "ends with \\"</tool_call>\\" here"}}'
    content, calls = parse_tool_calls(f"ok<tool_call>{call}</tool_call>done")
    assert content == "okdone" and len(calls) == 1
    assert json.loads(calls[0].arguments) == {"text": 'ends with "</tool_call>" here'}
    p = ToolCallParser()   # streamed, the tag arriving before the rest of the string
    assert p.push('<tool_call>{"name": "note", "arguments": {"text": "a </tool_call>') == []
    [(kind, streamed)] = p.push(' b"}}</tool_call>')
    assert kind == "call" and json.loads(streamed.arguments) == {"text": "a </tool_call> b"}


@pytest.mark.parametrize("bad", ['{"name":"f","arguments":{"a":"x"y"}}', '{"name":"f","arguments":{"a":"x"y""}}'])
def test_a_block_with_a_stray_quote_is_content_and_the_calls_after_it_stay_calls(bad):
    """A stray quote makes the scan read the close tag as the arguments' text: the first close tag ends
    the block after all, which is content, and the valid call after it is a call (at once or streamed)."""
    good = '{"name":"g","arguments":{"b":1}}'
    text = f"<tool_call>{bad}</tool_call>\n<tool_call>{good}</tool_call>"
    content, calls = parse_tool_calls(text)
    assert content == f"<tool_call>{bad}</tool_call>\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("g", {"b": 1})]
    p = ToolCallParser()
    pieces = [piece for ch in text for piece in p.push(ch)] + p.finish()
    assert "".join(x for kind, x in pieces if kind == "text") == content
    assert [c.name for kind, c in pieces if kind == "call"] == ["g"]
    # a second stray quote turns the scan back: the close tag it finds ends all four blocks at once
    content, calls = parse_tool_calls(text + "\n" + text)
    assert content == f"<tool_call>{bad}</tool_call>\n\n<tool_call>{bad}</tool_call>\n" and len(calls) == 2


def test_the_default_rendering_keeps_turns_alternating_after_tool_results():
    """The results of a turn's parallel calls, and a user message right after them, are one user message:
    templates such as Gemma's refuse two user turns in a row."""
    call = {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    msgs = render_tool_prompt([{"role": "user", "content": "time?"},
                               {"role": "assistant", "content": "", "tool_calls": [call, {**call, "id": "d"}]},
                               {"role": "tool", "tool_call_id": "c", "content": "12:00"},
                               {"role": "tool", "tool_call_id": "d", "content": [{"type": "text", "text": "UTC"}]},
                               {"role": "user", "content": [{"type": "text", "text": "and tomorrow?"}]},
                               {"role": "assistant", "content": "Sunday"}, {"role": "user", "content": "ok"}], None)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert msgs[2]["content"] == ("<tool_response>\n12:00\n</tool_response>\n<tool_response>\nUTC\n"
                                  "</tool_response>\nand tomorrow?")


def test_the_default_rendering_describes_tools_and_history():
    msgs = render_tool_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "", "tool_calls": [
                                   {"id": "c", "type": "function",
                                    "function": {"name": "now", "arguments": "{}"}}]},
                               {"role": "tool", "tool_call_id": "c", "content": "12:00"}], [CLOCK])
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.")
    assert '"name": "now"' in msgs[0]["content"] and "<tool_call>" in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    with pytest.raises(ValueError):
        render_tool_prompt(["not a message"], [CLOCK])


def _ends_in_string(text: str) -> bool:
    """Whether JSON text cut at its end is inside a string, read char by char (the oracle's way)."""
    inside = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = inside
        elif ch == '"':
            inside = not inside
    return inside


def _split_calls(text: str) -> tuple[str, list[str]]:
    """(content, the calls' JSON bodies) of a whole text, each close tag tried from the call's start."""
    content, bodies, pos = "", [], 0
    while (start := text.find("<tool_call>", pos)) >= 0:
        body_at = start + len("<tool_call>")
        end = text.find("</tool_call>", body_at)
        while end >= 0 and _ends_in_string(text[body_at:end]):
            end = text.find("</tool_call>", end + 1)
        if end < 0:
            break
        content, pos = content + text[pos:start], end + len("</tool_call>")
        bodies.append(text[body_at:end])
    return content + text[pos:], bodies


@pytest.mark.parametrize("seed", range(40))
def test_a_call_streamed_in_any_pieces_parses_as_it_does_whole(seed):
    # quotes, backslashes and close tags inside the arguments, the text cut anywhere
    rng = random.Random(seed)
    values = ["a </tool_call> b", 'q " </tool_call>', "back\\", '\\"</tool_call', "</tool_", "plain"]
    text = "".join(rng.choice(["x", "<tool_c", ""]) + "<tool_call>" + json.dumps(
        {"name": "note", "arguments": {"t": rng.choice(values), "u": rng.choice(values)}}) + "</tool_call>"
        for _ in range(3))
    text += rng.choice(["", 'y<tool_call>{"name": "a", "arguments": {"t": "open </tool_call>'])
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) // 3)))
    parser, pieces = ToolCallParser(), []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        pieces += parser.push(text[a:b])
    pieces += parser.finish()
    content, bodies = _split_calls(text)
    assert len(bodies) == 3
    assert "".join(p for kind, p in pieces if kind == "text") == content
    assert [json.loads(p.arguments) for kind, p in pieces if kind == "call"] == [
        json.loads(body)["arguments"] for body in bodies]


def test_json_nested_past_the_parsers_depth_is_text():
    deep = "[" * 1500 + "]" * 1500
    text = '<tool_call>{"name": "f", "arguments": ' + deep + "}</tool_call>"
    assert parse_tool_calls(text) == (text, [])           # the model's: not a call, its text is content
    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}]}]
    assert deep in render_tool_prompt(history, None)[0]["content"]     # the client's: kept as it came
