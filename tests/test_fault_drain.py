"""Graceful shutdown behind a real gateway (gunicorn): SIGTERM to a node's gunicorn master in the middle of
streams, and SIGTERM to the gateway's.

Node A serves tiny-a; node B has tiny-a too but not resident, and the routing weights make a cold load
cost far more than anything else: every stream goes to A until A drains. On SIGTERM to A: the streams
that fit in the grace period finish with all their tokens, the ones longer than it end with a clean
error event then [DONE] (never a cut connection), new requests go to B and succeed, and A's process
exits within the grace period plus gunicorn's margin. A gateway's SIGTERM lets its open stream finish."""
from __future__ import annotations

import json
import signal
import sys
import threading
import time

import pytest
import requests

from engine.node.serve import DRAIN_MARGIN_S
from tests.serving_fixtures import (NODE_SECRET, ServingStack, gateway_config, launch_gateway, launch_node,
                                    tiny_models, wait_until)  # noqa: F401 (tiny_models: fixture)

pytestmark = pytest.mark.fault
GRACE_S = 1.5                 # a tenth of the long streams' decode, several times the short ones'
SHORT_TOKENS = 200            # a few hundred milliseconds on the tiny model: fits the grace period
LONG_TOKENS = 4000            # seconds of decoding even alone: outlives the grace period
SHORT_STREAMS = 4
LONG_STREAMS = 2
DEADLINE_S = 90.0             # the longest any client may wait for its stream to end
RESIDENT_FIRST = {"alpha": 0.001, "beta": 0.0, "gamma": 1000.0}   # a cold load outweighs everything


@pytest.fixture
def stack(tmp_path, request):
    s = ServingStack(str(tmp_path))
    failed_before = request.session.testsfailed
    yield s
    if request.session.testsfailed > failed_before:
        print(s.logs(), file=sys.stderr)
    s.stop()


def stream(url: str, headers: dict, max_tokens: int, out: dict, key) -> None:
    """One streaming completion through the gateway; its status and data payloads (or the exception) in
    out[key]."""
    try:
        with requests.post(url + "/v1/completions", headers=headers, stream=True, timeout=(10, 60), json={
                "model": "zen-tiny", "prompt": f"stream {key}", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}) as r:
            out[key] = {"status": r.status_code, "events": []}
            if r.status_code != 200:
                out[key]["body"] = r.text[:500]
                return
            out[key]["events"] = events = []
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
                if data == b"[DONE]":
                    break
    except Exception as exc:  # noqa: BLE001 - a broken client connection is a failure of the test
        out[key] = {**out.get(key, {}), "exception": repr(exc)}


def has_token(result: dict) -> bool:
    return any(isinstance(e, dict) and e.get("choices") for e in list(result.get("events", [])))


def completed(result: dict, tokens: int) -> bool:
    """Every token, its finish_reason and usage, then [DONE]."""
    events = result.get("events", [])
    if result.get("status") != 200 or "exception" in result or events[-1:] != ["[DONE]"]:
        return False
    body = events[:-1]
    finishes = [e["choices"][0]["finish_reason"] for e in body if e.get("choices")]
    got = sum(1 for e in body if e.get("choices") and e["choices"][0]["finish_reason"] is None)
    usage = body[-1].get("usage") if body else None
    return got == tokens and finishes[-1] == "length" and bool(usage) and usage["completion_tokens"] == tokens


def ended_with_error(result: dict) -> bool:
    """Some tokens, then one error event in OpenAI's shape, then [DONE]."""
    events = result.get("events", [])
    if result.get("status") != 200 or "exception" in result or events[-1:] != ["[DONE]"] or len(events) < 2:
        return False
    err = events[-2].get("error") if isinstance(events[-2], dict) else None
    return (has_token(result) and err is not None and set(err) == {"message", "type", "param", "code"}
            and "shut down" in err["message"] and not any("error" in e for e in events[:-2]))


def test_node_sigterm_drains_its_streams_and_the_gateway_moves_on(stack, tiny_models):  # noqa: F811
    a_model, b_model = tiny_models["a"] + "=tiny-a", tiny_models["b"] + "=tiny-b"
    opts = {"log_dir": stack.log_dir, "kv_cache_bytes": "48MiB", "threads": 32}
    stack.nodes.append(launch_node([a_model], NODE_SECRET, extra_args=("--drain-grace-s", str(GRACE_S)), **opts))
    stack.nodes.append(launch_node([b_model, a_model], NODE_SECRET, preload=["tiny-b"], **opts))
    node_a, node_b = stack.nodes
    stack.gateway = launch_gateway(gateway_config({"routing": RESIDENT_FIRST}), node_urls=[node_a.url, node_b.url],
                                   log_dir=stack.log_dir)
    headers = stack.auth("loadco")
    requests.post(node_a.url + "/v1/generate", timeout=60, headers={"X-Node-Secret": NODE_SECRET},   # compile
                  json={"model": "tiny-a", "prompt": "warm", "sampling": {"max_tokens": 4}}).raise_for_status()

    out: dict = {}
    plan = [("short", i, SHORT_TOKENS) for i in range(SHORT_STREAMS)] + [("long", i, LONG_TOKENS)
                                                                         for i in range(LONG_STREAMS)]
    threads = [threading.Thread(target=stream, args=(stack.url, headers, n, out, (kind, i)), daemon=True)
               for kind, i, n in plan]
    for t in threads:
        t.start()
    wait_until(lambda: all(has_token(out.get((k, i), {})) for k, i, _ in plan), 60, "every stream's first token")
    node_a.proc.send_signal(signal.SIGTERM)
    term_at = time.monotonic()

    # gunicorn's master passes the signal on to the worker: a request that reached A before is served.
    wait_until(lambda: stack.node_state(0)["draining"], 5, "node A to say it drains")
    # New requests, sent while A drains, go to B (which loads tiny-a) and succeed.
    after: dict = {}
    for j in range(3):
        stream(stack.url, headers, 8, after, j)
        assert completed(after[j], 8), after[j]

    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads), "a client is still waiting: the stream hangs"
    for i in range(SHORT_STREAMS):
        assert completed(out[("short", i)], SHORT_TOKENS), out[("short", i)].get("events", [])[-3:]
    for i in range(LONG_STREAMS):
        result = out[("long", i)]
        # the test's own premise: on a machine that decodes LONG_TOKENS within the grace period, no stream
        # is left for the drain to end
        assert not completed(result, LONG_TOKENS), (
            f"a long stream finished within the {GRACE_S} s grace period: this machine decodes too fast "
            f"for the test's sizes (raise LONG_TOKENS or lower GRACE_S)")
        assert ended_with_error(result), {**result, "events": result.get("events", [])[-3:]}

    node_a.proc.wait(GRACE_S + DRAIN_MARGIN_S)
    exited_after = time.monotonic() - term_at
    assert exited_after < GRACE_S + DRAIN_MARGIN_S, exited_after
    assert node_b.alive()
    requests_log = [e for e in stack.gateway.log_events() if e.get("event") == "request" or e.get("msg") == "request"]
    after_ids = {e.get("node") for e in requests_log if e.get("completion_tokens") == 8}
    assert after_ids == {node_b.url}, after_ids
    node_log = node_a.log()
    assert "node_draining" in node_log and "node_drained" in node_log


def test_gateway_sigterm_lets_its_open_stream_finish(stack, tiny_models):  # noqa: F811
    stack.nodes.append(launch_node([tiny_models["a"] + "=tiny-a"], NODE_SECRET, log_dir=stack.log_dir,
                                   kv_cache_bytes="48MiB"))
    stack.gateway = launch_gateway(gateway_config(), node_urls=[stack.nodes[0].url], log_dir=stack.log_dir,
                                   workers=1)
    headers = stack.auth("loadco")
    out: dict = {}
    t = threading.Thread(target=stream, args=(stack.url, headers, 2000, out, "s"), daemon=True)
    t.start()
    wait_until(lambda: has_token(out.get("s", {})), 60, "the stream's first token")
    stack.gateway.proc.send_signal(signal.SIGTERM)
    t.join(DEADLINE_S)
    assert not t.is_alive()
    assert completed(out["s"], 2000), out["s"].get("events", [])[-3:]
    stack.gateway.proc.wait(40)
    wait_until(lambda: not stack.gateway.alive(), 5, "the gateway to exit")
    with pytest.raises(requests.ConnectionError):
        requests.get(stack.url + "/health", timeout=2)
