"""Per-org rate limits: token-bucket arithmetic, reserve-then-settle, requests per minute per org,
the 429 body and headers, Redis storage and the failure policy."""
from __future__ import annotations

import gc
import logging
import math
import threading
import time

import lmdb
import pytest

from app import close_app, create_app
from app.config import LimitsConfig, TierConfig
from app.limits import REQUESTS_KEY, SweptMemoryStorage, TokenLimiter, format_duration
from app.token_buckets import MemoryTokenBuckets, RedisTokenBuckets, refill
from engine.protocol import APIError
from tests.test_gateway_support import (METRICS_HEADERS, bearer, free_port, make_config, node,  # noqa: F401
                                        redis_url)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _tier(rate=10.0, burst=100, rpm=1000):
    return TierConfig("t", rpm, rate, burst, ("zen-small",))


# -- arithmetic ----------------------------------------------------------------------------------

def test_refill_arithmetic():
    assert refill(0, 10.0, 12.5, capacity=100, rate=10) == 25.0
    assert refill(90, 0.0, 5.0, capacity=100, rate=10) == 100       # capped at the burst
    assert refill(-30, 0.0, 1.0, capacity=100, rate=10) == -20       # debt is paid back first
    assert refill(40, 5.0, 4.0, capacity=100, rate=10) == 40         # clock going back: no change


def test_memory_bucket_reserve_and_settle():
    clock = FakeClock()
    b = MemoryTokenBuckets(clock)
    r = b.reserve("acme", 60, 100, 10.0)                 # a new bucket starts full
    assert r.admitted and r.tokens == 40 and r.retry_after_s == 0
    r = b.reserve("acme", 50, 100, 10.0)
    assert not r.admitted and r.tokens == 40 and r.retry_after_s == pytest.approx(1.0)
    clock.now += 1.0
    r = b.reserve("acme", 50, 100, 10.0)
    assert r.admitted and r.tokens == pytest.approx(0.0)
    assert r.reset_s == pytest.approx(10.0)
    r = b.settle("acme", 30, 100, 10.0)                  # 30 reserved but unused
    assert r.tokens == pytest.approx(30.0)
    r = b.settle("acme", 500, 100, 10.0)                 # never above the burst
    assert r.tokens == 100
    r = b.reserve("acme", 101, 100, 10.0)                # can never fit
    assert not r.admitted and math.isinf(r.retry_after_s) and r.tokens == 100
    other = b.reserve("globex", 100, 100, 10.0)          # buckets are per org
    assert other.admitted


def test_token_limiter_reserves_then_settles_with_real_usage():
    limiter = TokenLimiter(LimitsConfig())
    tier = _tier(rate=0.001, burst=1000)
    res = limiter.reserve("acme", tier, 600)
    assert res.result.tokens == pytest.approx(400, abs=0.1)
    with pytest.raises(APIError) as err:
        limiter.reserve("acme", tier, 500)
    assert err.value.status == 429 and err.value.type == "tokens"
    assert err.value.code == "rate_limit_exceeded"
    assert int(err.value.headers["retry-after"]) >= 1
    limiter.settle(res, 150)                  # used 150 of 600: 450 come back
    limiter.settle(res, 150)                  # settling twice changes nothing
    again = limiter.reserve("acme", tier, 800)
    assert again.result.tokens == pytest.approx(50, abs=0.1)


@pytest.mark.parametrize("seconds, text", [(0.25, "250ms"), (1.5, "1.5s"), (59, "59s"),
                                           (60, "1m0s"), (361, "6m1s"), (3723, "1h2m3s"),
                                           (-1, "0ms")])
def test_reset_durations_in_openai_format(seconds, text):
    assert format_duration(seconds) == text


# -- requests per minute (per org) -----------------------------------------------------------------

def test_requests_per_minute_per_org_with_openai_429():
    cfg = make_config([], tiers={"free": {"requests_per_minute": 3}})
    app = create_app(cfg)
    try:
        c = app.test_client()
        globex, acme = bearer(cfg, "globex"), bearer(cfg, "acme")      # free, pro
        for i in range(3):
            r = c.get("/v1/models", headers=globex)
            assert r.status_code == 200
            assert r.headers["x-ratelimit-limit-requests"] == "3"
            assert r.headers["x-ratelimit-remaining-requests"] == str(2 - i)
        r = c.get("/v1/models", headers=globex)
        assert r.status_code == 429
        err = r.get_json()["error"]
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
        assert "globex" in err["message"] and err["param"] is None
        assert r.headers["x-ratelimit-limit-requests"] == "3"
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        assert 1 <= int(r.headers["retry-after"]) <= 61
        # another org has its own counter; public endpoints are not limited
        assert c.get("/v1/models", headers=acme).status_code == 200
        assert c.get("/health", headers=globex).status_code == 200
        # a new token for the same org shares the org's counter
        assert c.get("/v1/models", headers=bearer(cfg, "globex")).status_code == 429
        metrics = c.get("/metrics", headers=METRICS_HEADERS).get_data(as_text=True)
        assert 'zen_gateway_org_rate_limited_total{limit="requests",org="globex"} 2.0' in metrics
    finally:
        close_app(app)


def test_memory_request_limits_start_no_thread_per_request():
    """limits' stock memory storage starts a new 10 ms timer thread on the first hit after the last
    one ran; ours keeps one sweeper alive, so requests a few tens of ms apart start no thread."""
    cfg = make_config([], limits={"storage_url": "memory://"}, tiers={"free": {"requests_per_minute": 50}})
    app = create_app(cfg)
    try:
        storage = app.extensions[REQUESTS_KEY].storage
        assert isinstance(storage, SweptMemoryStorage)
        sweeper = storage.timer
        c = app.test_client()
        globex = bearer(cfg, "globex")
        started = []
        real_start = threading.Thread.start

        def counting_start(thread):
            started.append(thread.name)
            real_start(thread)

        threading.Thread.start = counting_start
        try:
            for _ in range(4):
                assert c.get("/v1/models", headers=globex).status_code == 200
                time.sleep(0.03)          # past the stock timer's 10 ms
        finally:
            threading.Thread.start = real_start
        assert started == [] and storage.timer is sweeper and sweeper.is_alive()
        assert c.get("/v1/models", headers=globex).headers["x-ratelimit-remaining-requests"] == "45"
    finally:
        close_app(app)


def test_swept_memory_storage_prunes_expired_entries_and_ends_with_its_storage(monkeypatch):
    monkeypatch.setattr(SweptMemoryStorage, "SWEEP_S", 0.05)
    storage = SweptMemoryStorage()
    assert storage.acquire_entry("k", limit=5, expiry=0.1)
    assert storage.acquire_entry("k", limit=5, expiry=0.1)
    assert len(storage.events["k"]) == 2
    deadline = time.monotonic() + 3
    while storage.events.get("k"):
        assert time.monotonic() < deadline, "expired entries were never swept"
        time.sleep(0.02)
    assert storage.acquire_entry("k", limit=5, expiry=60)     # the window counts from zero again
    sweeper = storage.timer
    del storage
    gc.collect()
    sweeper.join(2)
    assert not sweeper.is_alive()


# -- token bucket through the API -----------------------------------------------------------------

def test_token_bucket_through_the_api(node):  # noqa: F811
    cfg = make_config([node.url], tiers={"free": {"tokens_per_second": 0.001, "burst_tokens": 200}})
    app = create_app(cfg)
    try:
        c = app.test_client()
        h = bearer(cfg, "globex")
        body = {"model": "zen-small", "prompt": "Say hi", "max_tokens": 100}
        r = c.post("/v1/completions", headers=h, json=body)
        assert r.status_code == 200, r.get_json()
        # reserved prompt estimate + 100, then settled with the real usage (14 tokens + prompt)
        assert r.headers["x-ratelimit-limit-tokens"] == "200"
        usage = r.get_json()["usage"]
        remaining = int(r.headers["x-ratelimit-remaining-tokens"])
        assert remaining < 100                   # while the request ran: prompt + 100 reserved
        r = c.post("/v1/completions", headers=h, json={**body, "max_tokens": 150})
        assert r.status_code == 200               # the unused reservation came back
        assert int(r.headers["x-ratelimit-remaining-tokens"]) == pytest.approx(
            200 - usage["total_tokens"] - 2 - 150, abs=2)
        r = c.post("/v1/completions", headers=h, json={**body, "max_tokens": 190})
        assert r.status_code == 429
        err = r.get_json()["error"]
        assert err["type"] == "tokens" and err["code"] == "rate_limit_exceeded"
        assert r.headers["x-ratelimit-limit-tokens"] == "200"
        assert int(r.headers["retry-after"]) > 1
        assert "x-ratelimit-limit-requests" in r.headers
        # more than the whole burst can never be admitted: do not retry
        r = c.post("/v1/completions", headers=h, json={**body, "max_tokens": 1000})
        assert r.status_code == 429 and r.headers["x-should-retry"] == "false"
        assert "burst" in r.get_json()["error"]["message"]
    finally:
        close_app(app)


def test_failed_dispatch_gives_the_reservation_back(node):  # noqa: F811
    cfg = make_config([node.url], tiers={"free": {"tokens_per_second": 0.001, "burst_tokens": 200}})
    app = create_app(cfg)
    try:
        c = app.test_client()
        h = bearer(cfg, "globex")
        node.busy = True
        body = {"model": "zen-small", "prompt": "Say hi", "max_tokens": 150}
        for stream in (False, True, False):
            r = c.post("/v1/completions", headers=h, json={**body, "stream": stream})
            assert r.status_code == 503
            assert r.headers["x-ratelimit-remaining-tokens"] == "200"   # its 152 given back: the answer says so
            r.close()
        node.busy = False
        assert c.post("/v1/completions", headers=h, json=body).status_code == 200
    finally:
        close_app(app)


@pytest.fixture
def one_request_bucket(node):  # noqa: F811
    """(client, headers) of an org whose bucket holds one request's reservation (2 prompt tokens + 150) and
    refills at 0.001 tokens/s: any charge refuses the next such request."""
    cfg = make_config([node.url], tiers={"free": {"tokens_per_second": 0.001, "burst_tokens": 152}})
    app = create_app(cfg)
    yield app.test_client(), bearer(cfg, "globex")
    close_app(app)


def test_a_stream_that_never_got_a_token_gives_the_reservation_back(node, one_request_bucket):  # noqa: F811
    """Its 200 went out when the node took it, but the node failed before the first token (and no
    other took over): it costs the org nothing, like a request refused before its stream."""
    c, h = one_request_bucket
    node.fail_after_tokens = 0
    body = {"model": "zen-small", "prompt": "Say hi", "max_tokens": 150, "stream": True}
    for _ in range(3):
        r = c.post("/v1/completions", headers=h, json=body)
        assert r.status_code == 200 and "no_node_available" in r.get_data(as_text=True)
        r.close()
    node.fail_after_tokens = None
    r = c.post("/v1/completions", headers=h, json=body)
    assert r.status_code == 200 and r.get_data(as_text=True).endswith("data: [DONE]\n\n")
    r.close()
    metrics = c.get("/metrics", headers=METRICS_HEADERS).get_data(as_text=True)
    assert 'zen_gateway_org_errors_total{org="globex",status="503"} 3.0' in metrics


def test_a_client_that_leaves_before_its_first_token_pays_its_prompt(node, one_request_bucket):  # noqa: F811
    """The node took the request and may have computed its prompt: leaving before the first token does not
    make a long prompt free (the node failing it before its first token still costs nothing, above)."""
    c, h = one_request_bucket
    node.first_token_delay_s = 0.5
    body = {"model": "zen-small", "prompt": "Say hi", "max_tokens": 150, "stream": True}   # 2 + 150
    r = c.post("/v1/completions", headers=h, json=body)
    assert r.status_code == 200
    next(r.response)                                  # the headers: the node has the request
    r.close()                                         # the client leaves
    node.first_token_delay_s = 0.0
    assert c.post("/v1/completions", headers=h, json={**body, "stream": False}).status_code == 429
    assert c.post("/v1/completions", headers=h, json={**body, "stream": False, "max_tokens": 148}
                  ).status_code == 200               # the 2 prompt tokens were charged, nothing more


def test_an_answer_cut_short_after_tokens_is_charged_for_them(node, one_request_bucket):  # noqa: F811
    """Not streamed, the node failed after 3 tokens: the org pays the prompt's estimate and those 3, as a
    stream cut short does (not nothing: a client could have had its tokens for free)."""
    c, h = one_request_bucket
    body = {"model": "zen-small", "prompt": "Say hi", "max_tokens": 150}   # 2 + 150: the whole burst
    node.fail_after_tokens = 3
    assert c.post("/v1/completions", headers=h, json=body).status_code == 502
    node.fail_after_tokens = None
    r = c.post("/v1/completions", headers=h, json=body)
    assert r.status_code == 429, r.text
    assert c.post("/v1/completions", headers=h, json={**body, "max_tokens": 145}).status_code == 200


def test_a_refund_goes_to_the_bucket_that_holds_the_reservation(monkeypatch):
    limiter = TokenLimiter(LimitsConfig(storage_url="embedded://", failure_policy="open", retry_s=0.01))
    tier = _tier(rate=0.001, burst=1000)
    assert limiter.reserve("acme", tier, 1000).shared   # the shared bucket is empty now

    def down(*args, **kwargs):
        raise lmdb.DiskError("disk I/O error")
    with monkeypatch.context() as m:
        m.setattr(limiter._shared, "reserve", down)
        local = limiter.reserve("acme", tier, 900)      # the failure policy: the per-process bucket
    assert not local.shared
    time.sleep(0.02)                                     # past retry_s: the shared store answers again
    limiter.settle(local, 0)                             # its 900 go back where they were taken
    with pytest.raises(APIError):
        limiter.reserve("acme", tier, 100)               # the shared bucket was not credited


# -- Redis ----------------------------------------------------------------------------------------

def test_redis_bucket_matches_the_arithmetic(redis_url):  # noqa: F811
    b = RedisTokenBuckets(redis_url, timeout_s=1.0)
    r = b.reserve("acme", 60, 100, 0.001)
    assert r.admitted and r.tokens == pytest.approx(40, abs=0.01)
    r = b.reserve("acme", 50, 100, 0.001)
    assert not r.admitted and r.retry_after_s == pytest.approx(10_000, rel=0.01)
    assert b.settle("acme", 30, 100, 0.001).tokens == pytest.approx(70, abs=0.01)
    assert b.settle("acme", 300, 100, 0.001).tokens == pytest.approx(100)
    r = b.reserve("acme", 101, 100, 0.001)
    assert not r.admitted and math.isinf(r.retry_after_s)


def test_a_redis_bucket_in_debt_is_kept_until_it_has_refilled(redis_url):  # noqa: F811
    b = RedisTokenBuckets(redis_url, timeout_s=1.0, prefix="zen:test-debt:")
    assert b.reserve("acme", 1000, 1000, 10.0).admitted
    b.settle("acme", -2000, 1000, 10.0)                 # 3000 below full: 300 s to refill, kept 60 s more
    assert 355_000 <= b._redis.pttl("zen:test-debt:acme") <= 360_000


def test_redis_storage_for_both_limits(redis_url):  # noqa: F811
    cfg = make_config([], limits={"storage_url": redis_url},
                      tiers={"free": {"requests_per_minute": 2}})
    apps = [create_app(cfg), create_app(cfg)]          # two "workers" sharing Redis
    try:
        h = bearer(cfg, "globex")
        codes = [apps[i % 2].test_client().get("/v1/models", headers=h).status_code
                 for i in range(4)]
        assert codes == [200, 200, 429, 429]
    finally:
        for a in apps:
            close_app(a)


@pytest.mark.parametrize("policy, status", [("open", 200), ("closed", 503)])
def test_redis_down_follows_the_failure_policy(policy, status, caplog):
    dead = f"redis://127.0.0.1:{free_port()}/0"
    cfg = make_config([], limits={"storage_url": dead, "failure_policy": policy,
                                  "redis_timeout_s": 0.2})
    app = create_app(cfg)
    try:
        c = app.test_client()
        r = c.get("/v1/models", headers=bearer(cfg, "acme"))
        assert r.status_code == status, r.get_json()
        if status == 503:
            assert r.get_json()["error"]["code"] == "service_unavailable"
    finally:
        close_app(app)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_token_bucket_redis_down_policies():
    dead = f"redis://127.0.0.1:{free_port()}/0"
    records = _Records()
    logging.getLogger("zen.gateway").addHandler(records)
    for policy, status in (("open", 200), ("closed", 503)):
        limiter = TokenLimiter(LimitsConfig(storage_url=dead, failure_policy=policy,
                                            redis_timeout_s=0.2))
        if status == 200:
            res = limiter.reserve("acme", _tier(), 10)
            assert res.result.admitted
        else:
            with pytest.raises(APIError) as err:
                limiter.reserve("acme", _tier(), 10)
            assert err.value.status == 503
    logging.getLogger("zen.gateway").removeHandler(records)
    down = [r.getMessage() for r in records.records if getattr(r, "event", "") == "limits_storage_down"]
    assert any("policy open" in m for m in down) and any("policy closed" in m for m in down)


def test_storage_health_logs_only_changes():
    from app.limits import StorageHealth
    records = _Records()
    logging.getLogger("zen.gateway").addHandler(records)
    try:
        health = StorageHealth("closed", name="Redis")
        health.answered()                              # up from the start: nothing to say
        assert health.down_for() is None
        for _ in range(5):
            health.failed(ConnectionError("refused"))  # one line for the whole outage
        assert health.down_for() is not None and health.down_for() >= 0
        health.answered()
        health.answered()
    finally:
        logging.getLogger("zen.gateway").removeHandler(records)
    events = [(r.levelname, r.event) for r in records.records if getattr(r, "event", "").startswith("limits_storage")]
    assert events == [("ERROR", "limits_storage_down"), ("WARNING", "limits_storage_recovered")]
    assert "failing closed" in records.records[0].getMessage()
    assert health.down_for() is None
