"""The gateway under gunicorn with 4 workers sharing a real Redis: per-org limits hold
exactly across workers, /metrics aggregates every worker (multiprocess mode), and a stream whose client
reads nothing is ended once a write has waited write_timeout_s."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from app.config import load_config
from app.devtoken import mint_token
from tests.test_gateway_support import (METRICS_HEADERS, JWT_SECRET, NODE_SECRET, StandInNode, free_port,
                                        start_redis)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
WORKERS = 4
RPM_LIMIT = 10          # tier "tight": requests per minute
TOKEN_BURST = 1000      # tier "bucket": burst; each test request reserves 1 + 99 tokens

CONFIG = f"""
[server]
host = "127.0.0.1"
log_level = "WARNING"
threads = 32            # one worker may take every concurrent test request at once
write_timeout_s = 2.0
[auth]
algorithms = ["HS256"]
issuer = "zen-test"
default_tier = "tight"
audience = "zen-gateway"
[limits]
strategy = "moving-window"
failure_policy = "closed"
[tiers.tight]
requests_per_minute = {RPM_LIMIT}
tokens_per_second = 1000.0
models = ["zen-small"]
[tiers.bucket]
requests_per_minute = 10000
tokens_per_second = 0.001
burst_tokens = {TOKEN_BURST}
models = ["zen-small"]
[orgs.tightco]
tier = "tight"
[orgs.bucketco]
tier = "bucket"
[models.zen-small]
model = "SmolLM2-135M-Instruct"
quantization = "q4_1"
[nodes]
poll_interval_s = 0.5
state_ttl_s = 3.0
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gunicorn")
    config_path = tmp / "gateway.toml"
    config_path.write_text(CONFIG)
    metrics_dir = tmp / "prometheus"
    metrics_dir.mkdir()
    redis_port, port = free_port(), free_port()
    redis_proc = start_redis(redis_port)
    node = StandInNode().start()
    env = {**os.environ, "ZEN_CONFIG": str(config_path), "PORT": str(port),
           "JWT_SECRET": JWT_SECRET, "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
           "ZEN_NODES": node.url, "NODE_SECRET": NODE_SECRET, "GATEWAY_WORKERS": str(WORKERS),
           "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    log = open(tmp / "gunicorn.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", "config/gunicorn.conf.py",
                             "wsgi:app"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(base + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("gunicorn did not start:\n" +
                                   (tmp / "gunicorn.log").read_text()[-3000:])
            time.sleep(0.2)
        config = load_config(config_path, env=env)
        yield base, config, node, metrics_dir
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        node.stop()
        redis_proc.terminate()
        redis_proc.wait(timeout=10)


def _fire(n: int, send) -> list[requests.Response]:
    """Send n requests at once (threads released together)."""
    barrier = threading.Barrier(n)

    def one(_):
        barrier.wait()
        return send()

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(one, range(n)))


def test_requests_per_minute_hold_exactly_across_workers(stack):
    base, config, _, _ = stack
    headers = {"Authorization": "Bearer " + mint_token(config, "tightco")}
    n = 3 * RPM_LIMIT
    responses = _fire(n, lambda: requests.get(base + "/v1/models", headers=headers, timeout=30))
    codes = [r.status_code for r in responses]
    assert codes.count(200) == RPM_LIMIT, codes
    assert codes.count(429) == n - RPM_LIMIT
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert limited.headers["x-ratelimit-limit-requests"] == str(RPM_LIMIT)
    assert int(limited.headers["retry-after"]) >= 1
    # the metrics, one scrape for every worker, count them all
    text = requests.get(base + "/metrics", headers=METRICS_HEADERS, timeout=10).text
    ok = float(re.search(r'zen_gateway_org_requests_total\{endpoint="api.list_models",'
                         r'org="tightco",status="200"\} ([\d.]+)', text).group(1))
    limited = float(re.search(r'zen_gateway_org_rate_limited_total\{limit="requests",'
                              r'org="tightco"\} ([\d.]+)', text).group(1))
    assert (ok, limited) == (RPM_LIMIT, 2 * RPM_LIMIT)       # summed over the workers
    assert "zen_gateway_flask_http_request_duration_seconds_bucket" in text


def test_token_bucket_holds_exactly_across_workers(stack):
    base, config, node, metrics_dir = stack
    node.response_delay_s = 1.5        # every request is still running when the last arrives
    headers = {"Authorization": "Bearer " + mint_token(config, "bucketco")}
    body = {"model": "zen-small", "prompt": "x", "max_tokens": 99}     # reserves 1 + 99
    n = 24
    try:
        responses = _fire(n, lambda: requests.post(base + "/v1/completions", headers=headers,
                                                   json=body, timeout=60))
    finally:
        node.response_delay_s = 0.0
    codes = [r.status_code for r in responses]
    assert codes.count(200) == TOKEN_BURST // 100, codes
    assert all(r.json()["error"]["type"] == "tokens" for r in responses if r.status_code == 429)
    # settled with the real usage: each used 1 + 14 tokens of its 100, the rest came back
    r = requests.post(base + "/v1/completions", headers=headers, json=body, timeout=30)
    assert r.status_code == 200
    assert int(r.headers["x-ratelimit-remaining-tokens"]) == pytest.approx(
        TOKEN_BURST - 10 * 15 - 100, abs=2)
    text = requests.get(base + "/metrics", headers=METRICS_HEADERS, timeout=10).text
    assert 'zen_gateway_org_completion_tokens_total{model="zen-small",org="bucketco"}' in text
    pids = {m.group(1) for f in os.listdir(metrics_dir) if (m := re.search(r"_(\d+)\.db$", f))}
    assert len(pids) >= 2, pids                 # both workers served the burst, and their metrics are summed


def test_a_stream_whose_client_reads_nothing_gives_its_thread_back(stack):
    """A client that sends a long stream's request and never reads: the gateway's write waits on a full
    socket, and after write_timeout_s (2 s here) the stream ends as a client that left (499), its node
    stream closed, rather than holding the thread until the client goes."""
    import json
    import socket
    base, config, node, _ = stack
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps({"model": "zen-small", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                       "max_tokens": 4000, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}).encode()
    token = mint_token(config, "stallco")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # about 6 MB of events will not fit
    try:
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + token.encode() + b"\r\nContent-Length: " +
                     str(len(body)).encode() + b"\r\n\r\n" + body)
        pattern = re.compile(r'zen_gateway_org_requests_total\{endpoint="api.chat_completions",org="other",'
                             r'status="499"\} ([\d.]+)')
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = requests.get(base + "/metrics", headers=METRICS_HEADERS, timeout=10).text
            if pattern.search(text):
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the stalled stream was never ended")
    finally:
        sock.close()
