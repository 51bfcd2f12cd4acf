"""Bad-input fuzzing: schemathesis against the gateway's own description (GET /openapi.json).

Schemathesis loads the schema from the WSGI app in-process (no sockets for the gateway itself) and
generates requests for every operation, valid ones and invalid ones (both generation modes), a
bounded number per operation. Every response must be in the schema: no 5xx, a documented status, a
documented content type, a body and headers that match. The engine behind the gateway is the
stand-in node of the gateway tests (a real HTTP server on loopback replaying fixed tokens), so
valid requests really complete; the caller's tier has limits no example can reach, so a 429 would be
a finding, not noise. Bounded: MAX_EXAMPLES per operation and mode; no example database on disk.
"""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.generation.meta import negated_parameters
from schemathesis.specs.openapi.checks import (content_type_conformance, response_headers_conformance,
                                               response_schema_conformance, status_code_conformance)

from app import close_app, create_app
from app.openapi import build_openapi
from tests.test_gateway_support import StandInNode, bearer, make_config

pytestmark = pytest.mark.slow
MAX_EXAMPLES = 50
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]


@pytest.fixture(scope="module")
def fuzz_gateway():
    node = StandInNode().start()
    config = make_config(
        [node.url],
        tiers={"fuzz": {"requests_per_minute": 1_000_000, "tokens_per_second": 1e9,
                        "models": ["zen-small", "zen-small-q8", "zen-small-f16"],
                        "max_latency_class": "realtime", "default_latency_class": "standard"}},
        orgs={"fuzzco": {"tier": "fuzz"}})
    app = create_app(config)
    yield app, config
    close_app(app)
    node.stop()


def served_openapi(app) -> dict:
    r = app.test_client().get("/openapi.json")
    assert r.status_code == 200
    return r.get_json()


def sse_schemas(doc: dict) -> list[dict]:
    """The text/event-stream media type objects of every response in `doc`."""
    return [resp["content"]["text/event-stream"]
            for ops in doc["paths"].values() for op in ops.values()
            for resp in op.get("responses", {}).values()
            if "text/event-stream" in resp.get("content", {})]


@pytest.fixture(scope="module")
def api_schema(fuzz_gateway):
    """The gateway's served description, loaded by schemathesis against the WSGI app (in-process)."""
    app, _ = fuzz_gateway
    return schemathesis.openapi.from_wsgi("/openapi.json", app)


@pytest.fixture(scope="module")
def auth_headers(fuzz_gateway):
    return bearer(fuzz_gateway[1], "fuzzco")


# The operations, from the same builder the gateway serves /openapi.json with (no app needed here).
OPERATIONS = [(method.upper(), path) for path, ops in build_openapi(8, 32)["paths"].items() for method in ops]


def _auth_negated(case) -> bool:
    return "authorization" in {str(name).lower() for name, _ in negated_parameters(case.meta)}


def _has_inputs(path: str, method: str) -> bool:
    op = build_openapi(8, 32)["paths"][path][method.lower()]
    return bool(op.get("parameters") or op.get("requestBody"))


def _has_body(path: str, method: str) -> bool:
    return "requestBody" in build_openapi(8, 32)["paths"][path][method.lower()]


# Valid examples for every operation; invalid ones where there is a body to get wrong (the other
# operations' only invalid input is the Authorization header, which the JWT tests cover).
CASES = [pytest.param(method, path, mode, id=f"{method} {path} {mode.value}")
         for method, path in OPERATIONS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if mode is GenerationMode.POSITIVE or _has_body(path, method)]


@pytest.mark.parametrize("method,path,mode", CASES)
def test_gateway_conforms_to_its_openapi(api_schema, auth_headers, method, path, mode):
    """MAX_EXAMPLES generated requests for one operation in one mode; every response in the schema.
    (Driven through hypothesis directly: schemathesis' pytest plugin does not run on pytest 9.) Half of
    the valid generation requests name a real model (and a chat one a user message), so that they get past
    model resolution and reach the parameter checks, the router, the node and the response writers."""
    operation = api_schema[path][method]
    statuses: dict[int, int] = {}

    cases = operation.as_strategy(generation_mode=mode)
    if mode is GenerationMode.NEGATIVE:
        # Invalid inputs behind a valid token, so that they reach the validators: cases whose only
        # "invalidity" is a removed or mangled Authorization header are left to the JWT tests.
        cases = cases.filter(lambda c: not _auth_negated(c))

    @given(case=cases, real_model=st.booleans())
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink])
    def run(case, real_model):
        headers = dict(case.headers or {})
        headers.update(auth_headers)
        if real_model and mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "zen-small"
            if "messages" in case.body:   # the schema lets a message go without content (a tool call's)
                case.body["messages"] = [{"role": "user", "content": "Hello"}]
        response = case.call_and_validate(headers=headers, checks=CHECKS)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    run()
    if _has_inputs(path, method):
        assert sum(statuses.values()) >= min(10, MAX_EXAMPLES), statuses
    if mode is GenerationMode.POSITIVE and method == "POST":
        assert statuses.get(200, 0) > 0, f"no valid request was served: {statuses}"
    print(f"{method} {path} {mode.value}: statuses {dict(sorted(statuses.items()))}")


def test_schema_is_served_and_lists_the_api(fuzz_gateway):
    app, _ = fuzz_gateway
    r = app.test_client().get("/openapi.json")
    assert r.status_code == 200
    paths = r.get_json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}"} <= set(paths)


def test_sse_responses_are_described_per_event(fuzz_gateway):
    media = sse_schemas(served_openapi(fuzz_gateway[0]))
    assert media
    for m in media:
        schema = m.get("itemSchema") or m.get("schema")
        assert schema.get("type") == "object" and "data" in schema.get("properties", {}), m
