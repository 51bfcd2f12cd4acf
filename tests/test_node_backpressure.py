"""Backpressure over real HTTP: a bounded waiting queue (503 with Retry-After beyond it), and a client
that leaves while its request still waits frees its slot without touching the running request."""
from __future__ import annotations

from tests.node_fixtures import (  # noqa: F401 (start_node, tiny_models: fixtures)
    assert_openai_error, generate, metric, next_event, node_state, open_stream, scrape, start_node, tiny_models,
    wait_for)

SECRET = "backpressure-test-secret"


def post(url, body):
    return generate(url, body, SECRET)


def state(url):
    return node_state(url, SECRET)


def test_queue_full_503_and_leaving_while_waiting(start_node, tiny_models):
    url = start_node([tiny_models["a"] + "=tiny-a"], SECRET, max_num_seqs=1, max_waiting=1)
    long_gen = {"model": "tiny-a", "prompt_token_ids": [9], "org": "stayer",
                "sampling": {"max_tokens": 4000, "ignore_eos": True}}   # outlasts the steps below many times over
    conn_a, resp_a = open_stream(url, long_gen, SECRET)
    first = next_event(resp_a)
    assert first["type"] == "token"
    # B waits behind A (one sequence runs at a time): the queue (bound 1) is now full
    conn_b, resp_b = open_stream(url, {"model": "tiny-a", "prompt_token_ids": [7, 8], "org": "leaver",
                                       "sampling": {"max_tokens": 5}}, SECRET)
    wait_for(lambda: state(url)["queue"]["waiting"] == 1, what="B waiting")
    # A runs and has its first token: only B is admitted without one (what max_waiting bounds), a standard
    # request of 2 prompt tokens
    assert state(url)["queue"] == {"waiting": 1, "running": 1, "admitted": 1, "max_waiting": 1, "max_running": 1,
                                   "admitted_by_class": [0, 1, 0], "admitted_tokens_by_class": [0, 2, 0]}
    r = post(url, {"model": "tiny-a", "prompt": "c", "sampling": {"max_tokens": 2}})
    err = assert_openai_error(r, 503, "queue_full")
    assert int(r.headers["Retry-After"]) >= 1 and err["type"] == "server_error"
    assert state(url)["queue"]["max_waiting"] == 1
    # B's client leaves before B ever ran: its slot is freed, A runs on
    conn_b.close()
    wait_for(lambda: state(url)["queue"]["waiting"] == 0, what="B's slot freed")
    # D may wait at most 0.2 s: it is never scheduled while A runs, so it ends with a 503 the gateway retries
    r = post(url, {"model": "tiny-a", "prompt": "d", "queue_timeout_s": 0.2, "org": "hasty",
                   "sampling": {"max_tokens": 2}})
    assert_openai_error(r, 503, "queue_timeout")
    events = [first]
    while events[-1]["type"] != "done":
        events.append(next_event(resp_a))
    conn_a.close()
    assert events[-1]["choices"] == [{"index": 0, "finish_reason": "length"}]
    assert events[-1]["usage"]["completion_tokens"] == 4000
    assert sum(1 for e in events if e["type"] == "token") == 4000
    s = state(url)
    assert s["queue"] == {"waiting": 0, "running": 0, "admitted": 0, "max_waiting": 1, "max_running": 1,
                          "admitted_by_class": [0, 0, 0], "admitted_tokens_by_class": [0, 0, 0]}
    assert s["kv_cache_usage"] == 0.0
    m = wait_for(lambda: (lambda m: m if metric(m, "zen_node_generation_tokens_total") >= 4000 else None)(scrape(url)),
                 what="A's tokens counted")
    assert metric(m, "zen_node_request_success_total", finished_reason="abort") == 1            # B
    assert metric(m, "zen_node_generation_tokens_total") == 4000                                 # A's: B made none
    assert metric(m, "zen_node_requests_rejected_total", reason="queue_full") == 1
    assert metric(m, "zen_node_requests_rejected_total") == 1   # D was taken: a timeout, not a refusal
    assert metric(m, "zen_node_request_success_total", finished_reason="timeout") == 1          # D
    # with the queue empty again, requests are taken
    assert post(url, {"model": "tiny-a", "prompt": "d", "sampling": {"max_tokens": 2}}).status_code == 200


def test_an_org_beyond_its_share_of_the_queue_is_a_429_while_another_org_is_taken(start_node, tiny_models):
    """--org-waiting-share 0.5 of --max-waiting 4: one org's sequences wait two at most."""
    url = start_node([tiny_models["a"] + "=tiny-a"], SECRET, max_num_seqs=1, max_waiting=4,
                     extra_args=("--org-waiting-share", "0.5"))
    running = open_stream(url, {"model": "tiny-a", "prompt_token_ids": [9], "org": "stayer",
                                "sampling": {"max_tokens": 4000, "ignore_eos": True}}, SECRET)
    assert next_event(running[1])["type"] == "token"
    waiting = [open_stream(url, {"model": "tiny-a", "prompt_token_ids": [7, 8], "org": "big",
                                 "sampling": {"max_tokens": 2, "n": 2}}, SECRET)]
    wait_for(lambda: state(url)["queue"]["admitted"] == 2, what="big's two sequences waiting")
    r = post(url, {"model": "tiny-a", "prompt": "c", "org": "big", "sampling": {"max_tokens": 2}})
    err = assert_openai_error(r, 429, "org_queue_full")
    assert int(r.headers["Retry-After"]) >= 1 and err["type"] == "rate_limit_exceeded"
    waiting.append(open_stream(url, {"model": "tiny-a", "prompt_token_ids": [5], "org": "other",
                                     "sampling": {"max_tokens": 2}}, SECRET))
    wait_for(lambda: state(url)["queue"]["admitted"] == 3, what="other's sequence waiting")
    assert metric(scrape(url), "zen_node_requests_rejected_total", reason="org_queue_full") == 1
    for conn, _ in [*waiting, running]:
        conn.close()
    wait_for(lambda: state(url)["queue"]["admitted"] == 0 and state(url)["queue"]["running"] == 0,
             what="every stream ended")
