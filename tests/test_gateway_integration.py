"""The gateway in front of two real engine nodes (one with the model resident, one without) and Redis,
all real processes on loopback, called with the openai client."""
from __future__ import annotations

import openai
import pytest

from tests.serving_fixtures import serving_stack, tiny_models  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


def _nodes(stack):
    return [stack.node_state(i) for i in range(len(stack.nodes))]


def _resident(state):
    return {m["id"] for m in state["models"]}


@pytest.fixture
def stack(serving_stack, tiny_models):
    s = serving_stack(
        nodes=[[tiny_models["a"] + "=tiny-a"], [tiny_models["a"] + "=tiny-a"]],
        node_options=[{}, {"preload": []}],          # the second node starts with nothing resident
        redis=True,
        # a cold load outweighs everything: with the default weights, a poll that caught a request
        # running makes node 0 look busy and the idle node's cold load of the tiny model (~0.1 s) rightly wins
        gateway={"limits": {"failure_policy": "closed"}, "routing": {"alpha": 0.001, "beta": 0.0, "gamma": 1000.0}},
    )
    assert not _resident(s.node_state(1))
    return s


def _client(stack, org="loadco"):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.token(org), max_retries=0, timeout=60)


def test_routes_to_the_node_with_the_model_resident_and_streams(stack):
    client = _client(stack)
    for _ in range(3):
        r = client.chat.completions.create(model="zen-tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=5, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    states = _nodes(stack)
    assert "tiny-a" in _resident(states[0]) and not _resident(states[1]), states
    chunks = list(client.completions.create(model="zen-tiny", prompt="hello", max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 6 and isinstance(text, str)
    plain = client.completions.create(model="zen-tiny", prompt="hello", max_tokens=6, temperature=0)
    assert plain.choices[0].text == text


def test_failover_to_the_other_node_which_loads_the_model(stack):
    client = _client(stack)
    stack.nodes[0].stop()
    r = client.completions.create(model="zen-tiny", prompt="hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    assert "tiny-a" in _resident(stack.node_state(1))


def test_openai_client_sees_401_and_429_with_redis_limits(stack):
    bad = openai.OpenAI(base_url=stack.url + "/v1", api_key="not-a-jwt", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    client = _client(stack, org="alpha")      # tier "tiny": 3 requests per minute, held in Redis
    seen = []
    for _ in range(5):
        try:
            client.completions.create(model="zen-tiny", prompt="hi", max_tokens=2)
            seen.append(200)
        except openai.RateLimitError as e:
            seen.append(429)
            assert e.response.headers["x-ratelimit-limit-requests"] == "3"
            assert int(e.response.headers["retry-after"]) >= 1
    assert seen == [200, 200, 200, 429, 429]
