"""The real `openai` Python client against the gateway (served over HTTP in a thread),
streaming and not, and how it sees 401, 404 and 429."""
from __future__ import annotations

import threading

import openai
import pytest
from werkzeug.serving import make_server

from app import close_app, create_app
from app.devtoken import mint_token
from tests.test_gateway_support import TOKENS, free_port, make_config, node  # noqa: F401

FULL_TEXT = "".join(p for _, p in TOKENS)


@pytest.fixture
def served(node):  # noqa: F811
    cfg = make_config([node.url], tiers={"free": {"requests_per_minute": 2}})
    app = create_app(cfg)
    server = make_server("127.0.0.1", free_port(), app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/v1", cfg
    server.shutdown()
    close_app(app)


def _client(base_url, key, **kw):
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=20, **kw)


def test_chat_and_completions(served):
    base, cfg = served
    client = _client(base, mint_token(cfg, "acme"))
    out = client.chat.completions.create(model="zen-small",
                                         messages=[{"role": "user", "content": "hi"}],
                                         temperature=0.2, seed=7, max_completion_tokens=4,
                                         extra_body={"top_k": 20, "min_p": 0.1,
                                                     "repetition_penalty": 1.05})
    assert out.choices[0].message.content == "Hello, world!"
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    assert out.model == "zen-small"
    comp = client.completions.create(model="zen-small", prompt="Once", max_tokens=2, n=2)
    assert [c.text for c in comp.choices] == ["Hello,", "Hello,"]
    models = client.models.list()
    assert [m.id for m in models.data] == ["zen-small", "zen-small-q8", "zen-small-f16"]


def test_streaming(served):
    base, cfg = served
    client = _client(base, mint_token(cfg, "acme"))
    stream = client.chat.completions.create(model="zen-small",
                                            messages=[{"role": "user", "content": "hi"}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == FULL_TEXT
    assert chunks[-1].usage.completion_tokens == len(TOKENS)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    stream = client.completions.create(model="zen-small", prompt="x", max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in stream) == "Hello, world"


def test_stream_error_event_raises_in_the_client(served, node):  # noqa: F811
    base, cfg = served
    node.error_after_tokens = 2
    client = _client(base, mint_token(cfg, "acme"))
    stream = client.chat.completions.create(model="zen-small",
                                            messages=[{"role": "user", "content": "hi"}], stream=True)
    got = []
    with pytest.raises(openai.APIError, match="engine node failed"):
        for chunk in stream:
            got.append(chunk.choices[0].delta.content or "")
    assert "".join(got) == "Hello,"


def test_401_404_and_429_as_the_client_sees_them(served):
    base, cfg = served
    with pytest.raises(openai.AuthenticationError) as err:
        _client(base, "not-a-jwt").models.list()
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    assert "malformed" in err.value.message
    with pytest.raises(openai.AuthenticationError, match="expired"):
        _client(base, mint_token(cfg, "acme", ttl_s=-3600)).models.list()

    client = _client(base, mint_token(cfg, "acme"))
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="zen-small", messages=[{"role": "user", "content": "x"}],
                                       temperature=5)
    assert err.value.param == "temperature"

    free = _client(base, mint_token(cfg, "globex"))       # 2 requests per minute
    free.models.list()
    free.models.list()
    with pytest.raises(openai.RateLimitError) as err:
        free.models.list()
    e = err.value
    assert e.status_code == 429 and e.code == "rate_limit_exceeded"
    assert e.response.headers["x-ratelimit-limit-requests"] == "2"
    assert e.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(e.response.headers["retry-after"]) >= 1
    # The client reads the limits on success too
    raw = client.models.with_raw_response.list()
    assert int(raw.headers["x-ratelimit-remaining-requests"]) >= 0
