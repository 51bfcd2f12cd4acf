"""An engine node killed (SIGKILL, the whole process group) in the middle of streams, behind a real
gateway (gunicorn) with two nodes serving the same model.

The clients of the streams on the killed node get a clean error event (OpenAI's error object)
followed by `data: [DONE]`, and their streams end; streams on the other node finish normally; new
requests (streaming and not) all go to the remaining node and succeed; the gateway reports the node
down. Every read has a deadline: nothing hangs."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import requests

from tests.serving_fixtures import read_sse, serving_stack, tiny_models, wait_until  # noqa: F401 (fixtures)

pytestmark = pytest.mark.fault
STREAMS = 12
STREAM_TOKENS = 3500          # long enough that every stream is still running when the node dies
DEADLINE_S = 120.0            # the longest any client may wait for its stream to end


def stream_request(url: str, headers: dict, i: int, out: dict, first_token: threading.Event) -> None:
    """One long streaming completion; records its events, or the exception, in out[i]."""
    try:
        with requests.post(url + "/v1/completions", headers=headers, stream=True, timeout=(10, 60),
                           json={"model": "zen-tiny", "prompt": f"stream number {i}", "max_tokens": STREAM_TOKENS,
                                 "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                                 "temperature": 0}) as r:
            out[i] = {"status": r.status_code, "events": []}
            if r.status_code != 200:
                out[i]["body"] = r.text[:500]
                return
            start = time.monotonic()
            for line in r.iter_lines():
                if time.monotonic() - start > DEADLINE_S:
                    out[i]["hung"] = True
                    return
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    out[i]["events"].append("[DONE]")
                    break
                event = json.loads(data)
                out[i]["events"].append(event)
                if event.get("choices"):
                    first_token.set()
            out[i]["ended"] = True
    except Exception as exc:  # noqa: BLE001 - a broken client connection is a failure of the test
        out[i] = {**out.get(i, {}), "exception": repr(exc)}


def started(out: dict) -> int:
    """Streams that have received a token."""
    return sum(1 for r in list(out.values())
               if any(isinstance(e, dict) and e.get("choices") for e in list(r.get("events", []))))


def classify(result: dict) -> str:
    """'complete', 'error' (a clean error event then [DONE]) or a description of what went wrong."""
    if "exception" in result or result.get("hung") or result.get("status") != 200:
        return f"bad: {result}"
    events = result["events"]
    if not events or events[-1] != "[DONE]":
        return f"bad: stream did not end with [DONE] ({len(events)} events)"
    body = [e for e in events[:-1]]
    errors = [e for e in body if "error" in e]
    if errors:
        err = errors[0]["error"]
        if len(errors) != 1 or body[-1] is not errors[0]:
            return f"bad: error event not last ({len(errors)} errors)"
        if set(err) != {"message", "type", "param", "code"} or not err["message"]:
            return f"bad: error event not in OpenAI's shape: {err}"
        return "error"
    tokens = sum(1 for e in body if e["choices"] and e["choices"][0]["finish_reason"] is None)
    usage = body[-1].get("usage")
    if tokens == STREAM_TOKENS and usage and usage["completion_tokens"] == STREAM_TOKENS:
        return "complete"
    return f"bad: {tokens} tokens, usage {usage}"


def test_node_killed_mid_stream(serving_stack, tiny_models):  # noqa: F811
    model = tiny_models["a"] + "=tiny-a"
    stack = serving_stack(nodes=[[model], [model]], node_options={"kv_cache_bytes": "48MiB"})
    headers = stack.auth("loadco")
    for i in range(len(stack.nodes)):                       # warm both nodes (first-step compilation)
        requests.post(stack.nodes[i].url + "/v1/generate", timeout=60,
                      headers={"X-Node-Secret": "serving-tests-node-secret"},
                      json={"model": "tiny-a", "prompt": "warm", "sampling": {"max_tokens": 4}}).raise_for_status()

    out: dict[int, dict] = {}
    first_token = threading.Event()
    threads = [threading.Thread(target=stream_request, args=(stack.url, headers, i, out, first_token), daemon=True)
               for i in range(STREAMS)]
    try:
        # Two waves, the second after the gateway has polled the nodes busy with the first: the router
        # then spreads the streams over both nodes (it prefers the less utilized one).
        for t in threads[: STREAMS // 2]:
            t.start()
        wait_until(lambda: started(out) == STREAMS // 2, 60, "the first wave's first tokens")
        time.sleep(1.0)
        for t in threads[STREAMS // 2:]:
            t.start()
        # Every stream has started (has its first token) before the kill.
        wait_until(lambda: started(out) == STREAMS, 60, "every stream to have its first token")
        running = [stack.node_state(i)["queue"]["running"] for i in range(2)]
        victim = 0 if running[0] >= running[1] else 1
        assert running[victim] > 0, running
        os.killpg(stack.nodes[victim].proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
    finally:
        for t in threads:
            if t.ident is not None:
                t.join(DEADLINE_S + 30)
    assert not any(t.is_alive() for t in threads), "a client is still waiting: the stream hangs"
    assert time.monotonic() - killed_at < DEADLINE_S

    outcomes = {i: classify(out.get(i, {"missing": True})) for i in range(STREAMS)}
    bad = {i: o for i, o in outcomes.items() if o.startswith("bad")}
    assert not bad, bad
    errored = [i for i, o in outcomes.items() if o == "error"]
    print(f"running per node at the kill: {running}; killed node {victim}; errored streams {len(errored)}, "
          f"completed {STREAMS - len(errored)}")
    assert 1 <= len(errored) <= running[victim], (running, outcomes)
    for i in errored:
        message = [e for e in out[i]["events"] if isinstance(e, dict) and "error" in e][0]["error"]["message"]
        assert "Traceback" not in message

    # New requests all go to the remaining node and succeed, streaming and not.
    survivor = stack.nodes[1 - victim]
    for j in range(8):
        body = {"model": "zen-tiny", "prompt": f"after the kill {j}", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        if j % 2:
            with requests.post(stack.url + "/v1/completions", headers=headers, stream=True, timeout=(10, 60),
                               json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
                assert r.status_code == 200, r.text
                events = read_sse(r, deadline_s=60)
            assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 8, events[-3:]
        else:
            r = requests.post(stack.url + "/v1/completions", headers=headers, json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8
    wait_until(lambda: all(stack.gateway.health()["nodes_up"] == 1 for _ in range(4)), 30,
               "the gateway to see one node up")
    assert survivor.alive()
    events = [e.get("event") for e in stack.gateway.log_events()]
    assert "node_down" in events or "failover" in events
    assert "stream_error" in events
