"""A disconnect storm through a real gateway (gunicorn) into a real engine node: hundreds of streaming
requests, about half of them abandoned by their client at a random point (before the response, right
after the headers, or after a random number of tokens). Afterwards every KV block is back in the pool
(node /state: kv_cache_usage 0, nothing running or waiting), no thread is left behind, and the
gateway and the node still serve.

Threads are counted per process with psutil (/proc/<pid>/status) in the node's gunicorn worker (the
process that owns the engine) and in each gateway worker. gunicorn's gthread workers keep a pool of at
most `threads` request threads that live on once started, so the baseline is taken after a warm-up
that saturates every pool (more concurrent requests than threads); a thread leaked per request would
then show as growth above that ceiling. Bounded: REQUESTS requests, CONCURRENCY at a time, and the
whole storm must end within STORM_DEADLINE_S."""
from __future__ import annotations

import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest
import requests

from tests.node_fixtures import metric, scrape
from tests.serving_fixtures import (NODE_SECRET, node_worker_pid, read_sse, serving_stack, thread_count,  # noqa: F401
                                    tiny_models, wait_until)

pytestmark = pytest.mark.fault
REQUESTS = 300
CONCURRENCY = 24
NODE_THREADS = 40
GATEWAY_WORKERS, GATEWAY_THREADS = 2, 16
STORM_DEADLINE_S = 240.0
THREAD_SLACK = 2              # threads a process may have above its saturated baseline
ABANDONED_TOKENS = 3000


def body(rng: random.Random, i: int, abandoned: bool) -> dict:
    # An abandoned request asks for far more tokens than it reads, so that it is still generating when
    # its client goes away: unless the node aborts it, it runs on for minutes (and the drain check fails).
    return {"model": "zen-tiny", "prompt": f"storm request {i} " + "word " * rng.randint(0, 60),
            "max_tokens": ABANDONED_TOKENS if abandoned else rng.randint(40, 400), "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.8, "seed": i}


def aborted_sequences(url: str) -> float:
    samples = scrape(url)
    return metric(samples, "zen_node_request_success_total", finished_reason="abort")


def abandon_before_response(url: str, headers: dict, payload: dict) -> str:
    """Send the request on a raw socket and close it without reading anything."""
    u = urlparse(url)
    data = json.dumps(payload).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
            f"Authorization: {headers['Authorization']}\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(head + data)
    return "closed before the response"


def abandon_after(url: str, headers: dict, payload: dict, events: int) -> str:
    """Read the headers and `events` SSE events, then close the connection."""
    with requests.post(url + "/v1/completions", json=payload, headers=headers, stream=True, timeout=(10, 60)) as r:
        if r.status_code != 200:
            return f"status {r.status_code}"
        seen = 0
        for line in r.iter_lines():
            if seen >= events:
                break
            if line.startswith(b"data:"):
                seen += 1
    return f"closed after {events} events"


def read_all(url: str, headers: dict, payload: dict) -> str:
    with requests.post(url + "/v1/completions", json=payload, headers=headers, stream=True, timeout=(10, 60)) as r:
        if r.status_code != 200:
            return f"status {r.status_code}: {r.text[:200]}"
        events = read_sse(r, deadline_s=120)
    if events[-1] != "[DONE]":
        return "no [DONE]"
    usage = events[-2].get("usage") if isinstance(events[-2], dict) else None
    if not usage or usage["completion_tokens"] != payload["max_tokens"]:
        return f"bad usage {usage}"
    return "complete"


def saturate(url: str, headers: dict, n: int, path: str, payload: dict) -> None:
    """n concurrent complete requests (more than the server's threads): every pool thread is started."""
    def one(_):
        r = requests.post(url + path, json=payload, headers=headers, timeout=120)
        r.raise_for_status()
    with ThreadPoolExecutor(n) as ex:
        list(ex.map(one, range(n)))


def test_disconnect_storm_frees_every_block_and_thread(serving_stack, tiny_models):  # noqa: F811
    stack = serving_stack(nodes=[[tiny_models["a"] + "=tiny-a"]],
                          node_options={"threads": NODE_THREADS, "kv_cache_bytes": "48MiB"},
                          workers=GATEWAY_WORKERS, threads=GATEWAY_THREADS)
    node = stack.nodes[0]
    headers = stack.auth("loadco")
    node_pid = node_worker_pid(node)
    gateway_pids = stack.gateway.worker_pids()
    assert len(gateway_pids) == GATEWAY_WORKERS

    # Warm-up that saturates the thread pools: the node's (direct) and both gateway workers'.
    saturate(node.url, {"X-Node-Secret": NODE_SECRET}, NODE_THREADS + 8, "/v1/generate",
             {"model": "tiny-a", "prompt": "warm up", "sampling": {"max_tokens": 200, "ignore_eos": True}})
    # The workers accept connections competitively: with 2x their threads in all, one worker got
    # fewer than its 16 once and started the rest of its pool during the storm (a baseline 3 short).
    for _ in range(2):
        saturate(stack.url, headers, 4 * GATEWAY_WORKERS * GATEWAY_THREADS, "/v1/completions",
                 {"model": "zen-tiny", "prompt": "warm up", "max_tokens": 200, "ignore_eos": True})
    wait_until(lambda: stack.node_state()["queue"]["running"] == 0, 30, "the warm-up to finish")
    time.sleep(1.0)
    node_baseline = thread_count(node_pid)
    gateway_baseline = {pid: thread_count(pid) for pid in gateway_pids}

    rng = random.Random(20250107)
    plan = []
    for i in range(REQUESTS):
        r = rng.random()
        kind = ("before" if r < 0.1 else "after" if r < 0.5 else "complete")
        plan.append((i, kind, rng.choice([0, 1, 2, 5, 20, 80, 200]), body(rng, i, kind != "complete")))

    def run(item) -> tuple[str, str]:
        i, kind, events, payload = item
        if kind == "before":
            return kind, abandon_before_response(stack.url, headers, payload)
        if kind == "after":
            return kind, abandon_after(stack.url, headers, payload, events)
        return kind, read_all(stack.url, headers, payload)

    aborted_before = aborted_sequences(node.url)
    started = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as ex:
        results = list(ex.map(run, plan, timeout=STORM_DEADLINE_S))
    storm_s = time.monotonic() - started
    abandoned = sum(1 for kind, _ in results if kind != "complete")
    assert REQUESTS * 0.4 <= abandoned <= REQUESTS * 0.6, abandoned
    bad = [(k, r) for k, r in results if k == "complete" and r != "complete"]
    assert not bad, bad[:10]
    assert storm_s < STORM_DEADLINE_S

    # Every sequence is gone and every block back in the pool.
    def drained():
        s = stack.node_state()
        per_model = [(m["running"], m["waiting"], m["admitted"], m["kv_cache_usage"]) for m in s["models"]]
        ok = (s["kv_cache_usage"] == 0 and s["queue"]["running"] == 0 and s["queue"]["waiting"] == 0
              and s["queue"]["admitted"] == 0
              and all(x == (0, 0, 0, 0) for x in per_model))
        return ok or None
    wait_until(drained, 60, "every KV block back in the pool and no sequence left")
    aborted = aborted_sequences(node.url) - aborted_before
    assert aborted >= 0.8 * abandoned, (aborted, abandoned)

    # No thread left behind: no process above its saturated baseline.
    wait_until(lambda: thread_count(node_pid) <= node_baseline + THREAD_SLACK, 30,
               f"the node's threads back to its baseline {node_baseline} (now {thread_count(node_pid)})")
    for pid, base in gateway_baseline.items():
        wait_until(lambda: thread_count(pid) <= base + THREAD_SLACK, 30,
                   f"gateway worker {pid}'s threads back to its baseline {base} (now {thread_count(pid)})")
    assert sorted(stack.gateway.worker_pids()) == sorted(gateway_pids), "a gateway worker was restarted"
    assert node_worker_pid(node) == node_pid, "the node's worker was restarted"

    # Both still serve.
    r = requests.post(stack.url + "/v1/completions", headers=headers, timeout=60,
                      json={"model": "zen-tiny", "prompt": "still there?", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    print(f"storm: {REQUESTS} requests ({abandoned} abandoned, {aborted:.0f} sequences aborted) in {storm_s:.1f} s; node threads "
          f"{node_baseline} -> {thread_count(node_pid)}; gateway threads {gateway_baseline}")


def test_abandoned_non_streaming_requests_are_aborted(serving_stack, tiny_models):  # noqa: F811
    """Non-streaming requests whose clients go away while the node generates: every one is aborted on
    the node (none generates its 4000 tokens for nobody) and the pool empties."""
    stack = serving_stack(nodes=[[tiny_models["a"] + "=tiny-a"]], node_options={"kv_cache_bytes": "64MiB"})
    headers = stack.auth("loadco")
    node = stack.nodes[0]
    before = {reason: metric(scrape(node.url), "zen_node_request_success_total", finished_reason=reason)
              for reason in ("abort", "length")}
    u = urlparse(stack.url)
    sockets = []
    try:
        for i in range(6):
            data = json.dumps({"model": "zen-tiny", "prompt": f"never read {i}", "max_tokens": 4000,
                               "ignore_eos": True}).encode()
            s = socket.create_connection((u.hostname, u.port), timeout=10)
            s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n"
                       f"Content-Type: application/json\r\nAuthorization: {headers['Authorization']}\r\n"
                       f"Content-Length: {len(data)}\r\n\r\n").encode() + data)
            sockets.append(s)
        running = wait_until(lambda: stack.node_state()["queue"]["running"] == len(sockets) and len(sockets), 30,
                             "every request to be generating on the node")
    finally:
        for s in sockets:
            s.close()
    wait_until(lambda: stack.node_state()["queue"]["running"] == 0 and stack.node_state()["kv_cache_usage"] == 0,
               60, "the abandoned requests to end and their blocks to be freed")
    samples = scrape(node.url)
    aborted = metric(samples, "zen_node_request_success_total", finished_reason="abort") - before["abort"]
    ran_out = metric(samples, "zen_node_request_success_total", finished_reason="length") - before["length"]
    assert ran_out == 0 and aborted == running, f"aborted {aborted} of {running}, generated to the end {ran_out}"
