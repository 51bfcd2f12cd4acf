"""KV-cache exhaustion behind a real gateway: a node started with a small KV pool (1 MiB: 128 blocks of
16 tokens for the tiny model) gets long prompts whose total is several times the pool at once. The
scheduler preempts sequences (their blocks go back to the pool) and recomputes them later: every
request finishes with all its tokens, none is lost or cut short, greedy outputs are the same as when
each request runs alone, and the pool is empty afterwards.

The node exposes no preemption counter (see the report), so the pressure is shown from outside: the
demand is several times the pool, the pool was seen full while the requests ran, and fewer requests
ran at once than were sent."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.node_fixtures import metric, scrape
from tests.serving_fixtures import serving_stack, tiny_models, wait_until  # noqa: F401 (fixtures)

pytestmark = pytest.mark.fault
KV_BYTES = "1MiB"
BLOCK_TOKENS = 16
REQUESTS = 8
PROMPT_TOKENS = 1000
MAX_TOKENS = 150


def prompt_ids(i: int) -> list[int]:
    """A distinct long prompt per request (distinct first block: no prefix-cache sharing)."""
    return [3 + (i * 7919 + j * 31) % 200 for j in range(PROMPT_TOKENS)]


def complete(url: str, headers: dict, i: int, stream: bool) -> dict:
    body = {"model": "zen-tiny", "prompt": prompt_ids(i), "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    if not stream:
        r = requests.post(url + "/v1/completions", json=body, headers=headers, timeout=(10, 240))
        assert r.status_code == 200, r.text
        b = r.json()
        return {"text": b["choices"][0]["text"], "finish": b["choices"][0]["finish_reason"], "usage": b["usage"]}
    text, finish, usage = [], None, None
    with requests.post(url + "/v1/completions", json={**body, "stream": True,
                                                     "stream_options": {"include_usage": True}},
                       headers=headers, stream=True, timeout=(10, 240)) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            assert "error" not in event, event
            if event.get("usage"):
                usage = event["usage"]
            for c in event["choices"]:
                text.append(c["text"])
                finish = c["finish_reason"] or finish
    return {"text": "".join(text), "finish": finish, "usage": usage}


def test_long_prompts_beyond_the_pool_all_finish(serving_stack, tiny_models):  # noqa: F811
    stack = serving_stack(nodes=[[tiny_models["a"] + "=tiny-a"]],
                          node_options={"kv_cache_bytes": KV_BYTES, "max_num_seqs": 16})
    headers = stack.auth("loadco")
    blocks = stack.node_state()["models"][0]["kv_cache_blocks"]
    per_request = -(-(PROMPT_TOKENS + MAX_TOKENS) // BLOCK_TOKENS)
    assert per_request <= blocks < REQUESTS * per_request / 3, (blocks, per_request)   # fits alone, not together

    # Reference: each request alone (greedy), one after the other.
    alone = [complete(stack.url, headers, i, stream=False) for i in range(REQUESTS)]
    assert all(a["usage"]["completion_tokens"] == MAX_TOKENS for a in alone)

    # All at once, half streaming; watch the pool while they run.
    usage_seen, running_seen, stop = [], [], threading.Event()

    def watch():
        while not stop.is_set():
            try:
                s = stack.node_state()
                usage_seen.append(s["kv_cache_usage"])
                running_seen.append(s["queue"]["running"])
            except requests.RequestException:
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(REQUESTS) as ex:
            together = list(ex.map(lambda i: complete(stack.url, headers, i, stream=bool(i % 2)), range(REQUESTS),
                                   timeout=300))
    finally:
        stop.set()
        watcher.join(5)
    elapsed = time.monotonic() - started

    for i, (a, t) in enumerate(zip(alone, together)):
        assert t["finish"] == "length", (i, t["finish"])
        assert t["usage"]["completion_tokens"] == MAX_TOKENS, (i, t["usage"])
        assert t["usage"]["prompt_tokens"] == PROMPT_TOKENS, (i, t["usage"])
        assert t["text"] == a["text"], f"request {i}: the recomputed output differs from the output alone"
    assert max(running_seen) < REQUESTS, running_seen
    wait_until(lambda: stack.node_state()["kv_cache_usage"] == 0 and stack.node_state()["queue"]["running"] == 0,
               30, "the pool to be empty")
    scraped = scrape(stack.nodes[0].url)
    finished = metric(scraped, "zen_node_request_success_total", finished_reason="length")
    assert finished >= 2 * REQUESTS
    # the pool ran out: full only in moments between admissions, which a poll of /state may miss
    assert metric(scraped, "zen_node_num_preemptions_total", model="tiny-a") >= 1, "nothing was preempted"
    print(f"{REQUESTS} x ({PROMPT_TOKENS} + {MAX_TOKENS}) tokens on a pool of {blocks} blocks "
          f"({per_request} per request) in {elapsed:.1f} s; pool peak {max(usage_seen):.2f}, "
          f"at most {max(running_seen)} running")


def test_a_sequence_larger_than_the_pool_is_refused_not_spun(serving_stack, tiny_models):  # noqa: F811
    """prompt 1000 + max_tokens 1500 on a 2048-token pool: preemption could never make room for it, so
    it is refused at once (400 context_length_exceeded) instead of being recomputed forever; the same
    prompt with a max_tokens that fits is served, and the pool is empty after both."""
    stack = serving_stack(nodes=[[tiny_models["a"] + "=tiny-a"]], node_options={"kv_cache_bytes": KV_BYTES})
    headers = stack.auth("loadco")
    capacity = stack.node_state()["models"][0]["kv_cache_blocks"] * BLOCK_TOKENS
    try:
        r = requests.post(stack.url + "/v1/completions", headers=headers, timeout=(10, 20),
                          json={"model": "zen-tiny", "prompt": prompt_ids(0), "max_tokens": 1500,
                                "ignore_eos": True})
    except requests.ReadTimeout:
        pytest.fail("no answer in 20 s: the sequence is recomputed in a loop")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and str(capacity) in err["message"], err
    fits = capacity - PROMPT_TOKENS - 1
    r = requests.post(stack.url + "/v1/completions", headers=headers, timeout=(10, 120),
                      json={"model": "zen-tiny", "prompt": prompt_ids(0), "max_tokens": fits, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == fits
    wait_until(lambda: stack.node_state()["kv_cache_usage"] == 0, 30, "the pool to be empty")
