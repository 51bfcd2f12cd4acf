"""Liveness, readiness and the drain, in process: /health vs /ready on the node (loading, draining) and on
the gateway (no ready node, draining); a draining node refuses new generations and ends the ones still
running at the end of its grace period with the node_shutdown error event, freeing their blocks; a
stream leaves the drain's count (and has its bookkeeping done) once its body has ended."""
from __future__ import annotations

import json
import threading
import time

import pytest

from app import close_app, create_app
from app.health import draining
from engine.node.app import create_app as create_node_app
from engine.node.config import ModelSpec, NodeConfig
from engine.protocol import SECRET_HEADER
from tests.node_fixtures import tiny_models  # noqa: F401 (fixture)
from tests.test_gateway_support import StandInNode, make_config

LONG_STREAM_TOKENS = 3500     # far longer than the grace period below at the tiny model's speed
GRACE_S = 0.5


@pytest.fixture
def node_app(tiny_models):  # noqa: F811
    app = create_node_app(NodeConfig(models=[ModelSpec(tiny_models["a"], "tiny-a")], backend="cpu",
                                     kv_cache_bytes=4 << 20, drain_grace_s=GRACE_S))
    node = app.extensions["zen_node"]
    assert node.ready.wait(120)
    yield app
    node.close()


def _events(chunks) -> list[dict]:
    return [json.loads(line[6:]) for chunk in chunks for line in chunk.split(b"\n") if line.startswith(b"data: ")]


def test_node_draining_refuses_new_work_and_ends_what_outlives_the_grace(node_app):
    node = node_app.extensions["zen_node"]
    client = node_app.test_client()
    auth = {SECRET_HEADER: node.config.secret}
    assert client.get("/ready").json == {"status": "ready"}
    resp = client.post("/v1/generate", headers=auth, buffered=False, json={
        "model": "tiny-a", "prompt": "a long one", "stream": True,
        "sampling": {"max_tokens": LONG_STREAM_TOKENS, "ignore_eos": True}})
    body = iter(resp.response)
    seen = []
    while not any(e["type"] == "token" for e in _events(seen)):
        seen.append(next(body))
    assert node.drain.in_flight == 1

    drained = threading.Thread(target=node.drain_gracefully)
    drained.start()
    deadline = time.monotonic() + 5
    while not node.drain.draining:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert client.get("/health").json == {"status": "ok"}          # alive while it drains
    r = client.get("/ready")
    assert r.status_code == 503 and r.json["status"] == "draining" and r.headers["Retry-After"]
    state = client.get("/state", headers=auth).json
    assert state["draining"] is True and state["ready"] is False and state["healthy"] is True
    r = client.post("/v1/generate", headers=auth, json={"model": "tiny-a", "prompt": "new", "sampling": {}})
    assert r.status_code == 503 and r.json["error"]["code"] == "node_draining" and r.headers["Retry-After"]

    seen.extend(body)    # the rest of the stream: cut at the end of the grace period
    resp.close()
    events = _events(seen)
    tokens = [e for e in events if e["type"] == "token"]
    assert 0 < len(tokens) < LONG_STREAM_TOKENS
    last = events[-1]
    assert last["type"] == "error" and last["error"]["code"] == "node_shutdown"
    assert set(last["error"]) == {"message", "type", "param", "code"} and last["error"]["type"] == "server_error"
    drained.join(15)
    assert not drained.is_alive() and node.drain.in_flight == 0
    m = node.registry.resident()[0]
    deadline = time.monotonic() + 5
    while m.engine.pool.num_free_blocks != m.engine.pool.num_blocks:   # freed before the loop's next step
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_node_drain_lets_a_short_generation_finish(tiny_models):  # noqa: F811
    app = create_node_app(NodeConfig(models=[ModelSpec(tiny_models["a"], "tiny-a")], backend="cpu",
                                     kv_cache_bytes=1 << 20, drain_grace_s=30))
    node = app.extensions["zen_node"]
    try:
        assert node.ready.wait(120)
        client = app.test_client()
        resp = client.post("/v1/generate", headers={SECRET_HEADER: node.config.secret}, buffered=False, json={
            "model": "tiny-a", "prompt": "short", "stream": True, "sampling": {"max_tokens": 40, "ignore_eos": True}})
        body = iter(resp.response)
        first = next(body)
        drained = threading.Thread(target=node.drain_gracefully)
        drained.start()
        events = _events([first, *body])
        resp.close()
        drained.join(30)
        assert not drained.is_alive()
        assert events[-1]["type"] == "done" and events[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for e in events if e["type"] == "token") == 40
    finally:
        node.close()


def test_node_idle_drain_returns_at_once(node_app):
    node = node_app.extensions["zen_node"]
    t0 = time.monotonic()
    node.drain_gracefully()
    assert time.monotonic() - t0 < 1.0 and node.drain.draining


def test_gateway_without_a_ready_node_is_alive_but_not_ready():
    app = create_app(make_config(["http://127.0.0.1:9"]))    # nothing listens there
    try:
        client = app.test_client()
        assert client.get("/health").status_code == 200
        r = client.get("/ready")
        assert r.status_code == 503 and r.json["status"] == "no_ready_node" and r.json["reason"]
        assert r.headers["Retry-After"]
    finally:
        close_app(app)


def test_gateway_ready_follows_its_nodes_readiness_and_its_own_drain():
    node = StandInNode().start()
    app = create_app(make_config([node.url]))
    try:
        client = app.test_client()
        r = client.get("/ready")
        assert r.status_code == 200 and r.json["status"] == "ready" and r.json["nodes_up"] == 1
        node.state = {"draining": True, "ready": False}             # the node began its drain
        deadline = time.monotonic() + 10
        while client.get("/ready").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.get("/ready").json["status"] == "no_ready_node"
        node.state = {}
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        draining(app).set()                                          # gunicorn's SIGTERM in this worker
        r = client.get("/ready")
        assert r.status_code == 503 and r.json["status"] == "draining"
        assert client.get("/health").status_code == 200
    finally:
        close_app(app)
        node.stop()


def test_an_unexpected_error_at_submission_gives_back_the_queue_place(node_app, monkeypatch):
    node = node_app.extensions["zen_node"]
    [m] = node.registry.resident()

    def broken_submit(request):
        raise ValueError("a defect below the node")

    monkeypatch.setattr(m.loop, "submit", broken_submit)
    r = node_app.test_client().post("/v1/generate", headers={SECRET_HEADER: node.config.secret},
                                    json={"model": "tiny-a", "prompt": "hi", "sampling": {"max_tokens": 2}})
    assert r.status_code == 500
    assert node.admission.waiting == 0 and node.drain.in_flight == 0


def test_gateway_is_not_ready_while_its_only_node_is_too_hot_to_route_to():
    """/ready counts nodes by the rule routing skips them by: a node above [nodes] max_temperature_c takes
    no request, so with only that node the gateway is not ready."""
    node = StandInNode().start()
    app = create_app(make_config([node.url]))
    try:
        client = app.test_client()
        assert client.get("/ready").status_code == 200
        node.state = {"temperature_c": 95.0}         # above the shipped 85 °C
        deadline = time.monotonic() + 10
        while client.get("/ready").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = client.get("/ready")
        assert r.json["status"] == "no_ready_node" and r.json["nodes_up"] == 0 and r.json["nodes"] == 1
        node.state = {"temperature_c": 60.0}
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.get("/ready").json["nodes_up"] == 1
    finally:
        close_app(app)
        node.stop()


@pytest.fixture
def slow_cold_load(tiny_models, monkeypatch):  # noqa: F811
    """A node with tiny-a resident and tiny-b listed, whose load takes 3 s more; max_waiting 1."""
    from engine.engine import Engine
    from engine.node import registry
    loading = threading.Event()

    def slow_engine(cfg):
        if cfg.model_id == "tiny-b":
            loading.set()
            time.sleep(3.0)
        return Engine(cfg)

    monkeypatch.setattr(registry, "Engine", slow_engine)
    app = create_node_app(NodeConfig(models=[ModelSpec(tiny_models["a"], "tiny-a"), ModelSpec(tiny_models["b"], "tiny-b")],
                                     backend="cpu", kv_cache_bytes=4 << 20, preload=["tiny-a"], max_waiting=1,
                                     drain_grace_s=30))
    node = app.extensions["zen_node"]
    assert node.ready.wait(120)
    answers = []

    def cold_request():
        r = app.test_client().post("/v1/generate", headers={SECRET_HEADER: node.config.secret},
                                   json={"model": "tiny-b", "prompt": "hi", "sampling": {"max_tokens": 2}})
        answers.append((r.status_code, (r.json or {}).get("error", {}).get("code"), time.monotonic()))

    thread = threading.Thread(target=cold_request)
    thread.start()
    assert loading.wait(30)
    yield app, node, answers, thread
    thread.join(30)
    node.close()


def test_a_request_waiting_for_a_cold_load_holds_its_place_in_the_queue(slow_cold_load):
    """The queue's bound counts the requests waiting for a load: past it, a 503 queue_full at once, not
    a thread held for the whole load."""
    app, node, answers, thread = slow_cold_load
    assert node.admission.waiting == 1
    t0 = time.monotonic()
    r = app.test_client().post("/v1/generate", headers={SECRET_HEADER: node.config.secret},
                               json={"model": "tiny-a", "prompt": "hi", "sampling": {"max_tokens": 2}})
    assert r.status_code == 503 and r.json["error"]["code"] == "queue_full" and time.monotonic() - t0 < 1.0
    thread.join(30)
    assert answers[0][:2] == (200, None) and node.admission.waiting == 0


def test_a_request_waiting_for_a_cold_load_is_sent_elsewhere_when_the_node_drains(slow_cold_load):
    """It has not started: the drain answers it 503 node_draining at once (the gateway fails over), not
    after the load, nor with a connection cut at the end of the grace period."""
    app, node, answers, thread = slow_cold_load
    began = time.monotonic()
    node.drain.begin(30)
    thread.join(30)
    status, code, answered = answers[0]
    assert (status, code) == (503, "node_draining") and answered - began < 1.0
    assert node.admission.waiting == 0 and node.drain.in_flight == 0


def test_a_streams_bookkeeping_runs_once_its_body_has_ended(node_app, caplog):
    # The body ends with its last event, so the server writes the end of the chunked body before the
    # bookkeeping: a gateway reading to that end to reuse the connection does not wait for it.
    node = node_app.extensions["zen_node"]
    client = node_app.test_client()
    resp = client.post("/v1/generate", headers={SECRET_HEADER: node.config.secret}, buffered=False, json={
        "model": "tiny-a", "prompt": "short", "stream": True, "sampling": {"max_tokens": 3, "ignore_eos": True}})
    with caplog.at_level("INFO", logger="engine.node"):
        events = _events(list(resp.response))   # the whole body, to its end
        assert events[-1]["type"] == "done"
        assert node.drain.in_flight == 1 and not [r for r in caplog.records if r.msg == "generation"]
        resp.close()
    assert node.drain.in_flight == 0
    logged = [r for r in caplog.records if r.msg == "generation"]
    assert len(logged) == 1 and logged[0].outcome == "ok" and logged[0].completion_tokens == 3
