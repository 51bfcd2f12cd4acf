"""The shipped limits configuration (`[limits]` of config/default.toml: the embedded store) under the
real gunicorn gateway with three workers: a free-tier org's requests per minute and a token bucket hold
exactly over all of them, and the rate-limit headers agree whichever worker answered. A stand-in node
answers the generations. Each answer's worker is found by the process that holds the server side of its
connection (gthread keeps it open for keep-alive), so the test sees that several processes served."""
from __future__ import annotations

import http.client
import json
import threading
import tomllib
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import psutil
import pytest

from app.devtoken import mint_token
from tests.serving_fixtures import DEFAULT_CONFIG, GatewayProcess, gateway_config, launch_gateway
from tests.test_gateway_support import NODE_SECRET, StandInNode

pytestmark = pytest.mark.slow
WORKERS = 3
TOKEN_BURST = 1000      # tier "bucket": each test request reserves 1 prompt token + 99


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    node = StandInNode().start()
    with open(DEFAULT_CONFIG, "rb") as fh:
        shipped_limits = tomllib.load(fh)["limits"]
    config = gateway_config({
        "tiers": {"bucket": {"requests_per_minute": 10_000, "tokens_per_second": 0.001,
                             "burst_tokens": TOKEN_BURST, "models": ["zen-small"]}},
        "orgs": {"bucketco": {"tier": "bucket"}},
        # The stand-in node listens with a backlog of 5: a burst's surplus connects wait for a SYN retry (1 s).
        "nodes": {"connect_timeout_s": 5.0},
    })
    config["limits"] = shipped_limits          # the shipped store, not the fixtures' memory://
    gw = launch_gateway(config, node_urls=[node.url], workers=WORKERS, threads=32, node_secret=NODE_SECRET,
                        log_dir=str(tmp_path_factory.mktemp("limits-workers")))
    try:
        assert gw.config.limits.uses_embedded
        yield gw, node
    finally:
        gw.stop()
        node.stop()


class Answer:
    """One response read whole, and the gateway worker that sent it."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes, pid: int) -> None:
        self.status, self.headers, self.body, self.pid = status, headers, body, pid

    def json(self) -> dict:
        return json.loads(self.body)


def _worker_holding(gw: GatewayProcess, client_addr: tuple[str, int]) -> int:
    for pid in gw.worker_pids():
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.raddr and (conn.raddr.ip, conn.raddr.port) == client_addr:
                return pid
    raise AssertionError(f"no gateway worker holds the connection from {client_addr}")


def send(gw: GatewayProcess, method: str, path: str, headers: dict, body: dict | None = None) -> Answer:
    """One request on a new connection; the worker is looked up while the connection is still open."""
    url = urlparse(gw.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        payload = json.dumps(body) if body is not None else None
        conn.request(method, path, body=payload, headers={**headers, "Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        pid = _worker_holding(gw, conn.sock.getsockname()[:2])
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data, pid)
    finally:
        conn.close()


def _auth(gw: GatewayProcess, org: str) -> dict:
    return {"Authorization": "Bearer " + mint_token(gw.config, org)}


def test_requests_per_minute_hold_across_workers_with_the_shipped_store(gateway):
    gateway, _ = gateway
    limit = gateway.config.tiers["free"].requests_per_minute
    assert gateway.config.orgs["globex"].tier == "free" and limit == 20
    auth = _auth(gateway, "globex")
    answers = [send(gateway, "GET", "/v1/models", auth) for _ in range(limit + 2)]
    assert [a.status for a in answers] == [200] * limit + [429] * 2, [a.status for a in answers]
    ok = answers[:limit]
    # The remaining count falls by one per admitted request, whichever worker answered it.
    remaining = [int(a.headers["x-ratelimit-remaining-requests"]) for a in ok]
    assert remaining == list(range(limit - 1, -1, -1)), list(zip(remaining, (a.pid for a in ok)))
    assert {int(a.headers["x-ratelimit-limit-requests"]) for a in ok} == {limit}
    pids = {a.pid for a in answers}
    assert len(pids) >= 2 and pids <= set(gateway.worker_pids()), pids
    for limited in answers[limit:]:
        err = limited.json()["error"]
        assert (err["type"], err["code"], err["param"]) == ("requests", "rate_limit_exceeded", None)
        assert "globex" in err["message"]
        assert limited.headers["x-ratelimit-limit-requests"] == str(limit)
        assert limited.headers["x-ratelimit-remaining-requests"] == "0"
        assert limited.headers["x-ratelimit-reset-requests"].endswith("s")
        assert 1 <= int(limited.headers["retry-after"]) <= 61


def test_token_bucket_holds_across_workers_with_the_shipped_store(gateway):
    gateway, node = gateway
    auth = _auth(gateway, "bucketco")
    body = {"model": "zen-small", "prompt": "x", "max_tokens": 99}         # reserves 1 + 99
    n = 24
    barrier = threading.Barrier(n)

    def one(_):
        barrier.wait()
        return send(gateway, "POST", "/v1/completions", auth, body)

    node.response_delay_s = 1.5     # every admitted request still holds its tokens when the last arrives
    try:
        with ThreadPoolExecutor(max_workers=n) as pool:
            answers = list(pool.map(one, range(n)))
    finally:
        node.response_delay_s = 0.0
    codes = [a.status for a in answers]
    assert codes.count(200) == TOKEN_BURST // 100, [(a.status, a.body[:300]) for a in answers]
    assert all(a.json()["error"]["type"] == "tokens" for a in answers if a.status == 429)
    assert len({a.pid for a in answers}) >= 2
    # Settled with the real usage on whichever worker: each used 1 + 14 of its 100, the rest came back.
    after = send(gateway, "POST", "/v1/completions", auth, body)
    assert after.status == 200
    assert int(after.headers["x-ratelimit-remaining-tokens"]) == pytest.approx(TOKEN_BURST - 10 * 15 - 100, abs=2)
