"""Structured outputs through the whole served stack (gateway, a real engine node serving the default
model), called with the real `openai` SDK: parse() into a Pydantic model, JSON schemas validated for many
seeds at temperature 1, regex and choice constraints, their 400s, and the tokenizer endpoints."""
from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
import requests
from pydantic import BaseModel, Field

from tests.serving_fixtures import serving_stack  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

MODEL = "zen-small"
ORDER_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["customer", "items", "status", "priority"],
    "properties": {
        "customer": {"type": "object", "additionalProperties": False, "required": ["name", "vip"],
                     "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 24},
                                    "vip": {"type": "boolean"}}},
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 99}}}},
        "status": {"enum": ["new", "paid", "shipped"]},
        "priority": {"type": "integer", "minimum": 0, "maximum": 5},
    },
}


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population_millions: int = Field(ge=0, le=100)
    climate: Literal["cold", "mild", "hot"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, default_model):
    from tests.serving_fixtures import start_stack
    s = start_stack(str(tmp_path_factory.mktemp("so-stack")),
                    nodes=[[f"{default_model}=SmolLM2-135M-Instruct"]], node_options={"kv_cache_bytes": "64MiB"},
                    workers=1)
    yield s
    s.stop()


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.token(), max_retries=0, timeout=300)


def _ask(what: str) -> list[dict]:
    return [{"role": "user", "content": what}]


def test_parse_into_a_pydantic_model(client):
    out = client.chat.completions.parse(model=MODEL, messages=_ask("Describe Paris as JSON."),
                                        response_format=City, temperature=0, max_tokens=120)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    city = choice.message.parsed
    assert isinstance(city, City) and city.name and city.climate in ("cold", "mild", "hot")


def test_nested_schema_holds_for_many_seeds_at_temperature_1(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA, "strict": True}}
    texts = []
    for seed in range(4):
        out = client.chat.completions.create(model=MODEL, messages=_ask("An order, as JSON."), n=4, seed=seed,
                                             temperature=1.0, max_tokens=200, response_format=fmt)
        for c in out.choices:
            assert c.finish_reason == "stop", c
            texts.append(c.message.content)
    for text in texts:
        jsonschema.validate(json.loads(text), ORDER_SCHEMA)
    assert len(set(texts)) > 1   # temperature 1 really sampled


def test_json_object_on_completions_streamed(client):
    chunks = list(client.completions.create(model=MODEL, prompt="A JSON object about a cat:", max_tokens=200,
                                            temperature=0.7, seed=2, stream=True,
                                            extra_body={"response_format": {"type": "json_object"}}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    if finish == ["stop"]:
        assert isinstance(json.loads(text), dict)
    else:   # cut by max_tokens: still a prefix of an object
        assert finish == ["length"] and text.startswith("{")


def test_regex_and_choice_hold(client):
    for seed in range(3):
        out = client.chat.completions.create(
            model=MODEL, messages=_ask("A licence plate?"), temperature=1.0, seed=seed, max_tokens=20,
            extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
        assert re.fullmatch("[A-Z]{2}-[0-9]{3}", out.choices[0].message.content)
        out = client.chat.completions.create(
            model=MODEL, messages=_ask("Is the sky green?"), temperature=1.0, seed=seed, max_tokens=20,
            extra_body={"guided_choice": ["yes", "no", "unsure"]})
        assert out.choices[0].message.content in ("yes", "no", "unsure")
        assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nah"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(["}}, "structured_outputs"),
    ({"guided_grammar": "start: missing"}, "guided_grammar"),
])
def test_bad_constraints_are_400s(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=_ask("x"), max_tokens=5, extra_body=extra)
    assert err.value.param == param


def test_tokenize_then_detokenize(stack):
    auth = stack.auth()
    r = requests.post(stack.url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}, headers=auth,
                      timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) >= 2 and body["max_model_len"] > 0
    r = requests.post(stack.url + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]}, headers=auth,
                      timeout=60)
    assert r.status_code == 200 and r.json()["prompt"] == "Hello world"


# ------------------------------------------------------------------------------------------- tools

WEATHER_ARGS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 30},
                               "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                           "parameters": {"type": "object", "additionalProperties": False,
                                                          "required": ["tz"],
                                                          "properties": {"tz": {"enum": ["UTC", "CET"]}}}}}]


def test_required_tool_choice_returns_a_call_whose_arguments_validate(client):
    for seed in range(3):
        out = client.chat.completions.create(model=MODEL, messages=_ask("What is the weather in Paris?"),
                                             tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                                             max_tokens=120, parallel_tool_calls=False)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_named_function_is_the_one_called_and_streamed_deltas_reassemble(client):
    kwargs = dict(model=MODEL, messages=_ask("Weather in Oslo, please."), tools=TOOLS, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=120)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            c["name"] += (tc.function and tc.function.name) or ""
            c["arguments"] += (tc.function and tc.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (w.function.name, json.loads(w.function.arguments)) for w in whole]
    assert whole[0].function.name == "get_weather"
    jsonschema.validate(json.loads(whole[0].function.arguments), WEATHER_ARGS)


def test_a_tool_result_goes_back_to_the_model(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    out = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="none",
                                         temperature=0, max_tokens=30)
    assert out.choices[0].message.content and out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > 100   # the history, call and result included
