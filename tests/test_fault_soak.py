"""Soak: several thousand requests through a real gateway (gunicorn, 2 workers) into a real engine node
(the tiny model, so that it is fast) at moderate concurrency, a fifth of them cancelled by their client
mid-stream. Resident memory of the gateway (its workers together) and of the node (its worker, the
process that owns the engine) stays flat: under 5% growth from the end of the warm-up to the end of the
run; every KV block is free at the end and both still serve.

Bounded: WARMUP + REQUESTS requests, CONCURRENCY at a time, every one of them run: how fast they run is
no concern of this test (DEADLINE_S only ends a run that hangs). RSS is read with psutil; each figure is
the median of several samples taken while idle. Marked `fault` only (not also `slow`), so that CI runs
it once."""
from __future__ import annotations

import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.serving_fixtures import node_worker_pid, rss_bytes, serving_stack, tiny_models, wait_until  # noqa: F401

pytestmark = pytest.mark.fault
WARMUP = 1500          # allocator arenas and caches settle over the first ~thousand requests
REQUESTS = 3000
CONCURRENCY = 16
DEADLINE_S = 900.0     # a guard against a hang, far past a run's time on a busy 2-core machine
MAX_GROWTH = 0.05


def rss_median(pids: list[int], samples: int = 7) -> int:
    values = []
    for _ in range(samples):
        values.append(rss_bytes(pids))
        time.sleep(0.2)
    return int(statistics.median(values))


class Client:
    """One client thread's session and its request mix."""

    def __init__(self, url: str, headers: dict, seed: int):
        self.url, self.rng = url, random.Random(seed)
        self.session = requests.Session()
        self.session.headers.update(headers)

    def one(self, i: int) -> str:
        rng = self.rng
        body = {"model": "zen-tiny", "prompt": " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "x"])
                                                         for _ in range(rng.randint(1, 40))),
                "max_tokens": rng.randint(4, 48), "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": i}
        kind = rng.random()
        if kind < 0.2:                               # a stream the client cancels mid-way
            with self.session.post(self.url + "/v1/chat/completions" if i % 2 else self.url + "/v1/completions",
                                   json={**(body if i % 2 == 0 else {**{k: v for k, v in body.items() if k != "prompt"},
                                                                     "messages": [{"role": "user",
                                                                                   "content": body["prompt"]}]}),
                                         "stream": True, "max_tokens": 400, "ignore_eos": True},
                                   stream=True, timeout=(10, 60)) as r:
                if r.status_code != 200:
                    return f"status {r.status_code}"
                stop_after = rng.randint(0, 30)
                for n, _ in enumerate(r.iter_lines()):
                    if n >= stop_after:
                        break
            return "cancelled"
        if kind < 0.6:                               # a stream read to the end
            with self.session.post(self.url + "/v1/completions", stream=True, timeout=(10, 60),
                                   json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
                if r.status_code != 200:
                    return f"status {r.status_code}"
                lines = [line for line in r.iter_lines() if line.startswith(b"data:")]
            return "ok" if lines and lines[-1].strip() == b"data: [DONE]" else "stream without [DONE]"
        r = self.session.post(self.url + "/v1/completions", json=body, timeout=(10, 60))
        return "ok" if r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1 else \
            f"status {r.status_code}"


def run_phase(url: str, headers: dict, count: int, deadline_s: float, seed: int) -> dict:
    counter = iter(range(count))
    lock = threading.Lock()
    outcomes: dict[str, int] = {}
    stop_at = time.monotonic() + deadline_s

    def worker(w: int) -> None:
        client = Client(url, headers, seed * 1000 + w)
        try:
            while time.monotonic() < stop_at:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                try:
                    result = client.one(i)
                except requests.RequestException as exc:
                    result = f"exception {exc.__class__.__name__}"
                with lock:
                    outcomes[result] = outcomes.get(result, 0) + 1
        finally:
            client.session.close()

    with ThreadPoolExecutor(CONCURRENCY) as ex:
        list(ex.map(worker, range(CONCURRENCY)))
    return outcomes


def test_soak_memory_flat_and_blocks_free(serving_stack, tiny_models):  # noqa: F811
    stack = serving_stack(nodes=[[tiny_models["a"] + "=tiny-a"]], node_options={"threads": 32})
    headers = stack.auth("loadco")
    node_pid = node_worker_pid(stack.nodes[0])
    gateway_pids = stack.gateway.worker_pids()

    warm = run_phase(stack.url, headers, WARMUP, DEADLINE_S, seed=1)
    assert sum(warm.values()) == WARMUP and set(warm) <= {"ok", "cancelled"}, warm
    wait_until(lambda: stack.node_state()["queue"]["running"] == 0, 30, "the warm-up to drain")
    node_base, gateway_base = rss_median([node_pid]), rss_median(gateway_pids)

    started = time.monotonic()
    outcomes = run_phase(stack.url, headers, REQUESTS, DEADLINE_S, seed=2)
    elapsed = time.monotonic() - started
    done = sum(outcomes.values())
    failures = {k: v for k, v in outcomes.items() if k not in ("ok", "cancelled")}
    assert not failures, outcomes
    assert done == REQUESTS, f"only {done} requests in {elapsed:.0f} s: {outcomes}"
    assert outcomes.get("cancelled", 0) >= done * 0.1, outcomes

    def drained():
        s = stack.node_state()
        return (s["kv_cache_usage"] == 0 and s["queue"]["running"] == 0 and s["queue"]["waiting"] == 0) or None
    wait_until(drained, 60, "every KV block free and nothing running at the end")
    node_end, gateway_end = rss_median([node_pid]), rss_median(gateway_pids)
    assert sorted(stack.gateway.worker_pids()) == sorted(gateway_pids), "a gateway worker was restarted"
    assert node_worker_pid(stack.nodes[0]) == node_pid, "the node's worker was restarted"

    report = (f"{done} requests in {elapsed:.0f} s ({done / elapsed:.0f}/s) {outcomes}; RSS node "
              f"{node_base / 2**20:.1f} -> {node_end / 2**20:.1f} MiB, gateway workers "
              f"{gateway_base / 2**20:.1f} -> {gateway_end / 2**20:.1f} MiB")
    print(report)
    assert node_end <= node_base * (1 + MAX_GROWTH), report
    assert gateway_end <= gateway_base * (1 + MAX_GROWTH), report
    r = requests.post(stack.url + "/v1/completions", headers=headers, timeout=30,
                      json={"model": "zen-tiny", "prompt": "still there?", "max_tokens": 3})
    assert r.status_code == 200
