"""Redis (the shared rate-limit storage) stopped in the middle of serving, behind a real gateway
(gunicorn, 2 workers) with a real engine node, under both configured policies:

  * fail open: every request keeps being served (per-worker in-memory limits meanwhile);
  * fail closed: inference and model listing answer 503 in OpenAI's shape with Retry-After;

in both, the gateway says so in its log (which policy it applies), and when redis-server is back on
the same port it uses Redis again: requests are served (closed) and the limit counters reappear in
the new Redis (open and closed)."""
from __future__ import annotations

import time

import pytest
import redis
import requests

from tests.serving_fixtures import serving_stack, tiny_models, wait_until  # noqa: F401 (fixtures)

pytestmark = pytest.mark.fault
RETRY_S = 1.0                  # limits.retry_s: how soon the gateway tries Redis again


def completion(stack, headers) -> requests.Response:
    return requests.post(stack.url + "/v1/completions", headers=headers, timeout=30,
                         json={"model": "zen-tiny", "prompt": "hello", "max_tokens": 3, "ignore_eos": True})


def redis_keys(url: str) -> list[bytes]:
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        return client.keys("*")
    finally:
        client.close()


def storage_events(stack, since: float) -> list[dict]:
    return [e for e in stack.gateway.log_events()
            if e.get("ts", 0) >= since and str(e.get("event", "")).startswith("limits_storage")]


@pytest.mark.parametrize("policy", ["open", "closed"])
def test_redis_outage_follows_the_policy_and_recovers(serving_stack, tiny_models, policy):  # noqa: F811
    stack = serving_stack(nodes=[[tiny_models["a"] + "=tiny-a"]], redis=True,
                          gateway={"limits": {"failure_policy": policy, "retry_s": RETRY_S,
                                              "redis_timeout_s": 0.5}})
    headers = stack.auth("loadco")
    for _ in range(4):                              # both workers, Redis in use
        r = completion(stack, headers)
        assert r.status_code == 200, r.text
    keys = redis_keys(stack.redis.url)
    assert any(k.startswith(b"zen") for k in keys), keys

    # ---- Redis goes away.
    outage_start = time.time()
    stack.redis.stop()
    statuses, bodies = [], []
    for i in range(8):
        r = completion(stack, headers) if i % 2 == 0 else \
            requests.get(stack.url + "/v1/models", headers=headers, timeout=30)
        statuses.append(r.status_code)
        bodies.append(r)
    if policy == "open":
        assert statuses == [200] * 8, [(b.status_code, b.text[:200]) for b in bodies]
    else:
        assert statuses == [503] * 8, [(b.status_code, b.text[:200]) for b in bodies]
        for r in bodies:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
            assert "Traceback" not in r.text and "redis" not in r.text.lower()
            assert int(r.headers["Retry-After"]) >= 1
    assert stack.gateway.alive()

    # ---- The log says what happened and which policy applies.
    def logged_down():
        events = [e for e in storage_events(stack, outage_start) if e["event"] == "limits_storage_down"]
        return events or None
    down = wait_until(logged_down, 10, "a limits_storage_down log line")
    words = " ".join(e["msg"] for e in down)
    assert (("policy open" in words) if policy == "open" else ("failing closed" in words or "policy closed" in words)), \
        down
    assert all(e["level"] in ("warning", "error") for e in down)

    # ---- Redis is back on the same port: the gateway serves and uses it again.
    stack.redis.start()
    recovered_at = time.time()

    def served_again():
        r = completion(stack, headers)
        return r.status_code == 200 or None
    wait_until(served_again, 30, "requests to be served again", interval=0.25)
    # Both workers: all requests served again, and the limit counters are back in the new Redis.
    time.sleep(RETRY_S + 0.5)
    for _ in range(6):
        r = completion(stack, headers)
        assert r.status_code == 200, r.text
    wait_until(lambda: any(k.startswith(b"zen") for k in redis_keys(stack.redis.url)) or None, 30,
               "the gateway's counters to reappear in Redis")
    print(policy, sorted({(e["level"], e["event"], e["msg"][:90]) for e in storage_events(stack, outage_start)}))
    # Each worker says it once when Redis goes and once when it is back: not a line per request.
    events = storage_events(stack, outage_start)
    down = [e for e in events if e["event"] == "limits_storage_down" and e["ts"] < recovered_at]
    assert 1 <= len(down) <= len(stack.gateway.worker_pids()), events
    recovered = [e for e in storage_events(stack, recovered_at) if e["event"] == "limits_storage_recovered"]
    assert 1 <= len(recovered) <= len(stack.gateway.worker_pids()), events
    assert all(e["level"] == "warning" for e in recovered)
