"""Structured outputs and the tokenizer endpoints on a real engine node (gunicorn on loopback, a tiny
model): constrained generation holds, a bad constraint is a 400 before anything is queued, and
/tokenize and /detokenize answer in vLLM's shapes."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import requests

from tests.node_fixtures import (SECRET_HEADER, assert_openai_error, generate, launch_node, node_state,
                                 sse_events, tiny_models)  # noqa: F401 (tiny_models: fixture)

SECRET = "node-structured-test-secret"
AUTH = {SECRET_HEADER: SECRET}
# bounded everywhere: a random tiny model would otherwise write digits until max_tokens
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "kind", "flags"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "kind": {"enum": ["cat", "dog"]},
                         "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def node(tiny_models, tmp_path_factory):
    n = launch_node([tiny_models["a"] + "=tiny-a"], SECRET, log_dir=str(tmp_path_factory.mktemp("node-so")))
    yield n.url
    n.stop()


def _body(rid: str, constraint: dict, **sampling) -> dict:
    return {"request_id": rid, "model": "tiny-a", "prompt": "the cat is",
            "sampling": {"max_tokens": 120, "temperature": 1.0, "structured_output": constraint, **sampling}}


def test_json_schema_holds_for_every_choice(node):
    r = generate(node, _body("so-json", {"type": "json", "value": SCHEMA}, n=6, seed=3), SECRET)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["text"]), SCHEMA)


def test_regex_and_choice_hold_streaming_or_not(node):
    r = generate(node, _body("so-re", {"type": "regex", "value": "[a-c]{2}-[0-9]{3}"}, n=4, seed=1), SECRET)
    assert all(re.fullmatch("[a-c]{2}-[0-9]{3}", c["text"]) and c["finish_reason"] == "stop"
               for c in r.json()["choices"]), r.text
    body = {**_body("so-choice", {"type": "choice", "value": ["red", "green", "blue"]}, seed=5), "stream": True}
    events = sse_events(generate(node, body, SECRET, stream=True))
    text = "".join(e.get("text") or "" for e in events if e["type"] == "token")
    assert text in ("red", "green", "blue") and events[-1]["choices"][0]["finish_reason"] == "stop"


def test_max_tokens_cuts_a_constrained_sequence_with_length(node):
    r = generate(node, _body("so-len", {"type": "regex", "value": "x[0-9]{20}"}, max_tokens=2), SECRET)
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("constraint", [
    {"type": "json", "value": {"type": "frobnicate"}},
    {"type": "regex", "value": "(unclosed"},
    {"type": "grammar", "value": "start: undefined_rule"},
    {"type": "yaml", "value": "a: 1"},
])
def test_bad_constraint_is_a_400_and_nothing_runs(node, constraint):
    r = generate(node, _body("so-bad", constraint), SECRET)
    assert_openai_error(r, 400, param="structured_output")
    assert node_state(node, SECRET)["queue"]["admitted"] == 0


def test_tokenize_and_detokenize(node):
    r = requests.post(node + "/tokenize", json={"model": "tiny-a", "prompt": "the cat is",
                                                "return_token_strs": True}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["count"] == len(out["tokens"]) > 0 and out["max_model_len"] == 4096
    assert "".join(out["token_strs"]).endswith("the cat is")
    back = requests.post(node + "/detokenize", json={"model": "tiny-a", "tokens": out["tokens"]}, headers=AUTH,
                         timeout=30)
    assert back.status_code == 200 and back.json()["prompt"].endswith("the cat is")
    chat = requests.post(node + "/tokenize", json={"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}]},
                         headers=AUTH, timeout=30).json()
    assert chat["count"] > out["count"] - 3   # the template's markers around the message
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with_tools = requests.post(node + "/tokenize", json={"model": "tiny-a", "messages": [{"role": "user",
                                                                                         "content": "hi"}],
                                                         "tools": [tool], "return_token_strs": True},
                               headers=AUTH, timeout=30).json()
    # the tools are rendered into the prompt, as they are for a chat request with them
    assert with_tools["count"] > chat["count"] and "get_weather" in "".join(with_tools["token_strs"])


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": "tiny-a"}, "prompt"),
    ("/tokenize", {"model": "tiny-a", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/detokenize", {"model": "tiny-a", "tokens": [1, "x"]}, "tokens"),
    ("/detokenize", {"model": "tiny-a", "tokens": [10 ** 9]}, "tokens"),
    ("/tokenize", {"prompt": "a"}, "model"),
    ("/tokenize", {"model": "tiny-a", "prompt": "a", "tools": [{"type": "function"}]}, "tools"),
    ("/tokenize", {"model": "tiny-a", "messages": [{"role": "user", "content": "b"}], "tools": "x"}, "tools"),
])
def test_tokenizer_endpoints_refuse_bad_input(node, path, body, param):
    assert_openai_error(requests.post(node + path, json=body, headers=AUTH, timeout=30), 400, param=param)


def test_tokenizer_endpoints_need_the_secret(node):
    assert requests.post(node + "/tokenize", json={"model": "tiny-a", "prompt": "a"}, timeout=30).status_code == 401


def test_a_template_with_tool_support_renders_the_tools_itself():
    from engine.node.generation import prompt_token_ids
    from models.chat_template import renders_tools
    from tests.tiny_model import make_tiny_tokenizer
    tok = make_tiny_tokenizer()
    tok.chat_template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                         "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                         "{% for c in m.tool_calls or [] %}[call {{ c.function.arguments.city }}]{% endfor %}"
                         "{% endfor %}")
    assert renders_tools(tok.chat_template)
    assert not renders_tools("{# no tools here #}{% for m in messages %}{{ m.content }} (tools: none){% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c", "content": "sunny"}]
    ids = prompt_token_ids(tok, None, msgs, add_special_tokens=False, tools=tools)
    assert tok.decode(ids) == "[tool get_weather]<user>hi<assistant>[call Oslo]<tool>sunny"


def test_a_constraint_that_breaks_down_while_generating_is_a_400_or_an_error_event(node):
    """llguidance gives up on a 600-property object once a property name begins: the answer is an error
    naming the constraint, never output that does not conform."""
    wide = {"type": "json", "value": {"type": "object",
                                      "properties": {f"field_{i}": {"type": "string"} for i in range(600)}}}
    r = generate(node, _body("so-wide", wide, temperature=0.0), SECRET)
    err = assert_openai_error(r, 400, "structured_output_failed")
    assert err["param"] == "structured_output" and "could not be enforced" in err["message"]
    events = sse_events(generate(node, {**_body("so-wide-s", wide, temperature=0.0), "stream": True}, SECRET,
                                 stream=True))
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "invalid_request_error"
    assert events[-1]["error"]["code"] == "structured_output_failed"
