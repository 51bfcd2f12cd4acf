"""Org isolation through a real gateway (gunicorn, 2 workers, Redis) and a real engine node: nothing one org
can call reveals another org's requests, usage or limits. Model lists, 404s, rate-limit headers and
429 messages carry only the caller's own figures; one org's traffic does not move another's limits;
answers never cross between orgs; a request id chosen by one org does not collide with another's.

Orgs: the `tiny` tier (3 requests/min, burst 600 tokens, zen-tiny only) and the `roomy` tier (500
requests/min, burst 99999, 7777 tokens/s, zen-tiny and zen-tiny-b): figures distinct enough that a
leak is visible. Most tests use fresh org names (unconfigured orgs with a `tier` claim), so the
tests do not depend on one another's counters."""
from __future__ import annotations

import re
import threading
import uuid

import pytest
import requests

from tests.serving_fixtures import read_sse, start_stack, tiny_models  # noqa: F401 (tiny_models: fixture)

pytestmark = pytest.mark.slow
ROOMY_FIGURES = ("99999", "7777", "500")     # the roomy tier's limits, never shown to a tiny-tier org
TINY_FIGURES = ("600",)                      # the tiny tier's burst


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):  # noqa: F811
    log_dir = str(tmp_path_factory.mktemp("isolation"))
    # Redis: the limits are shared by both gunicorn workers, so every count below is exact.
    s = start_stack(log_dir, nodes=[[tiny_models["a"] + "=tiny-a", tiny_models["b"] + "=tiny-b"]], redis=True,
                    gateway={"auth": {"allow_unconfigured_orgs": True, "default_tier": "tiny"}})
    yield s
    s.stop()


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def headers(stack, org: str, tier: str | None = None, **extra) -> dict:
    token = stack.token(org, tier=tier) if tier else stack.token(org)
    return {"Authorization": f"Bearer {token}", **extra}


def complete(stack, org_headers: dict, **body) -> requests.Response:
    payload = {"model": "zen-tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0, **body}
    return requests.post(stack.url + "/v1/completions", json=payload, headers=org_headers, timeout=60)


def no_figures(text: str, figures, where: str) -> None:
    for f in figures:   # as a number of its own: a random request id or timestamp may hold its digits
        assert not re.search(rf"(?<![0-9A-Za-z]){f}(?![0-9A-Za-z])", text), f"{where} shows {f!r}: {text[:400]}"


def limit_headers(r: requests.Response) -> str:
    return " ".join(f"{k}={v}" for k, v in r.headers.items() if k.lower().startswith(("x-ratelimit", "retry")))


def test_model_lists_are_per_tier(stack):
    tiny = requests.get(stack.url + "/v1/models", headers=headers(stack, fresh("a"), "tiny"), timeout=30)
    roomy = requests.get(stack.url + "/v1/models", headers=headers(stack, fresh("b"), "roomy"), timeout=30)
    assert tiny.status_code == roomy.status_code == 200
    assert [m["id"] for m in tiny.json()["data"]] == ["zen-tiny"]
    assert {m["id"] for m in roomy.json()["data"]} == {"zen-tiny", "zen-tiny-b"}
    no_figures(tiny.text, ("zen-tiny-b", "tiny-b"), "the tiny tier's model list")


def test_forbidden_model_looks_like_an_unknown_one(stack):
    h = headers(stack, fresh("a"), "roomy")
    h_tiny = headers(stack, fresh("a"), "tiny")
    forbidden = requests.get(stack.url + "/v1/models/zen-tiny-b", headers=h_tiny, timeout=30)
    unknown = requests.get(stack.url + "/v1/models/zen-nope", headers=h, timeout=30)
    assert forbidden.status_code == unknown.status_code == 404
    f, u = forbidden.json()["error"], unknown.json()["error"]
    assert (f["type"], f["code"], f["param"]) == (u["type"], u["code"], u["param"])
    assert f["message"].replace("zen-tiny-b", "X") == u["message"].replace("zen-nope", "X")


def test_rate_limits_and_their_messages_are_per_org(stack):
    a, b = fresh("alpha"), fresh("bravo")
    ha, hb = headers(stack, a, "tiny"), headers(stack, b, "roomy")
    # b is busy first: a's figures must not move because of it.
    for _ in range(4):
        assert complete(stack, hb).status_code == 200
    seen = []
    for _ in range(6):                       # the tiny tier allows 3 requests a minute
        r = complete(stack, ha)
        seen.append(r)
        if r.status_code == 429:
            break
    assert [r.status_code for r in seen[:3]] == [200, 200, 200], [r.text[:200] for r in seen]
    assert seen[-1].status_code == 429
    for r in seen:
        text = limit_headers(r) + " " + r.text
        assert r.headers["x-ratelimit-limit-requests"] == "3"
        no_figures(text, ROOMY_FIGURES + (b,), f"{a}'s response")
    # a's first request: its own bucket, untouched by b's traffic (prompt "hi" = 1 token + 4).
    assert seen[0].headers["x-ratelimit-limit-tokens"] == "600"
    assert seen[0].headers["x-ratelimit-remaining-tokens"] == str(600 - 5)
    assert seen[0].headers["x-ratelimit-remaining-requests"] == "2"
    err = seen[-1].json()["error"]
    assert err["code"] == "rate_limit_exceeded" and a in err["message"] and b not in err["message"]
    # b, after a was limited: its own counters only.
    r = complete(stack, hb)
    assert r.status_code == 200, r.text
    assert r.headers["x-ratelimit-limit-requests"] == "500"
    assert r.headers["x-ratelimit-remaining-requests"] == str(500 - 5)
    no_figures(limit_headers(r) + r.text, (a, "limit-requests=3 "), f"{b}'s response")


def test_token_limit_error_names_only_the_callers_figures(stack):
    a, b = fresh("alpha"), fresh("bravo")
    assert complete(stack, headers(stack, b, "roomy"), max_tokens=64).status_code == 200
    r = complete(stack, headers(stack, a, "tiny"), max_tokens=1000)      # beyond the tiny burst of 600
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert a in err["message"] and "600" in err["message"]
    assert r.headers["x-should-retry"] == "false"
    no_figures(r.text + limit_headers(r), ROOMY_FIGURES + (b,), "the tiny org's 429")


def test_answers_never_cross_between_orgs(stack):
    """Concurrent streams of two orgs: each gets its own request id, its own token count and usage."""
    orgs = [(fresh("alpha"), "roomy"), (fresh("bravo"), "roomy")]
    results, errors = {}, []

    def run(i: int) -> None:
        org, tier = orgs[i % 2]
        rid = f"iso-{i}-{uuid.uuid4().hex[:6]}"
        max_tokens = 5 + i
        try:
            with requests.post(stack.url + "/v1/completions", stream=True, timeout=60,
                               headers=headers(stack, org, tier, **{"X-Request-Id": rid}),
                               json={"model": "zen-tiny", "prompt": "x " * (3 + 7 * i), "max_tokens": max_tokens,
                                     "stream": True, "stream_options": {"include_usage": True},
                                     "ignore_eos": True, "temperature": 0}) as r:
                assert r.status_code == 200, r.text
                assert r.headers["x-request-id"] == rid
                events = read_sse(r)
            chunks = [e for e in events if isinstance(e, dict)]
            assert all(c["id"] == f"cmpl-{rid}" for c in chunks), chunks[:2]
            tokens = sum(1 for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is None)
            usage = chunks[-1]["usage"]
            results[i] = (tokens, usage, max_tokens)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{i}: {exc!r}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) == 10
    prompt_tokens = {}
    for i, (tokens, usage, max_tokens) in results.items():
        assert tokens == usage["completion_tokens"] == max_tokens, (i, tokens, usage)
        prompt_tokens[i] = usage["prompt_tokens"]
    assert sorted(prompt_tokens.values()) == [prompt_tokens[i] for i in range(10)]   # grows with i: own prompt


def test_request_ids_of_different_orgs_do_not_collide(stack):
    a, b = fresh("alpha"), fresh("bravo")
    rid = "shared-" + uuid.uuid4().hex[:8]
    started = threading.Event()
    done = {}

    def long_stream() -> None:
        with requests.post(stack.url + "/v1/completions", stream=True, timeout=120,
                           headers=headers(stack, a, "roomy", **{"X-Request-Id": rid}),
                           json={"model": "zen-tiny", "prompt": "tell me a story", "max_tokens": 3000,
                                 "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith(b"data:"):
                    started.set()
                    break
            done["a"] = read_sse(r, deadline_s=120)

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        assert started.wait(60), "org a's stream did not start"
        r = complete(stack, headers(stack, b, "roomy", **{"X-Request-Id": rid}))
        assert r.status_code == 200, r.text
        assert a not in r.text
    finally:
        t.join(150)


def test_metrics_do_not_reveal_other_orgs(stack):
    """GET /metrics carries per-org counters: an org's own token does not open it (nor does none);
    the operator's metrics token does."""
    # "alpha" and "bravo" are configured orgs, so they have their own metric label.
    assert complete(stack, headers(stack, "bravo"), max_tokens=3).status_code == 200
    for h in (headers(stack, "alpha"), {}, {"Authorization": "Bearer not-the-metrics-token"}):
        r = requests.get(stack.url + "/metrics", headers=h, timeout=30)
        assert r.status_code in (401, 403, 404) or 'org="bravo"' not in r.text, \
            [line for line in r.text.splitlines() if 'org="bravo"' in line][:5]
        assert 'org="bravo"' not in r.text
    token = stack.gateway.config.server.metrics_token
    assert token, "the test gateway runs with a metrics token (config/default.toml)"
    r = requests.get(stack.url + "/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert r.status_code == 200 and 'org="bravo"' in r.text
