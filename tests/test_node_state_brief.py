"""What a node tells the router besides GET /state: its state in brief on every /v1/ answer (a header,
and a field of a stream's last event), the loads in progress with their elapsed and expected times, the
admitted work by latency class, and the decode step's time fitted against the batch size."""
from __future__ import annotations

import json
import logging
import time

import pytest

from engine.node.admission import Admission, QueueFull
from engine.node.app import create_app as create_node_app
from engine.node.config import ModelSpec, NodeConfig
from engine.node.loop import DecodeStepFit
from engine.node.registry import _LoadJob
from engine.protocol import SECRET_HEADER, STATE_FIELD, STATE_HEADER, LatencyClass, NodeState
from tests.node_fixtures import tiny_models  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def node_app(tiny_models):  # noqa: F811
    app = create_node_app(NodeConfig(models=[ModelSpec(tiny_models["a"], "tiny-a"),
                                             ModelSpec(tiny_models["b"], "tiny-b")],
                                     backend="cpu", kv_cache_bytes=4 << 20, max_num_seqs=16, preload=["tiny-a"]))
    node = app.extensions["zen_node"]
    assert node.ready.wait(120)
    yield app
    node.close()


def _auth(app) -> dict:
    return {SECRET_HEADER: app.extensions["zen_node"].config.secret}


def _brief(resp, base: NodeState) -> NodeState:
    return NodeState.from_header(resp.headers[STATE_HEADER], base)


def test_a_json_answer_carries_the_state(node_app):
    client = node_app.test_client()
    polled = NodeState.from_json(client.get("/state", headers=_auth(node_app)).json)
    r = client.post("/v1/generate", headers=_auth(node_app), json={
        "model": "tiny-a", "prompt": "hello", "sampling": {"max_tokens": 3}})
    assert r.status_code == 200
    state = _brief(r, polled)
    assert state.resident(("tiny-a", "f32")) is not None and state.healthy and state.ready and not state.draining
    assert state.queue.max_running == 16 and state.queue.admitted == 0
    assert state.available_models == ("tiny-a", "tiny-b")      # from the polled state it is read over


def test_a_stream_carries_it_as_it_starts_and_in_its_last_event(node_app):
    client = node_app.test_client()
    r = client.post("/v1/generate", headers=_auth(node_app), buffered=True, json={
        "model": "tiny-a", "prompt": "hello", "stream": True, "sampling": {"max_tokens": 3}})
    assert r.status_code == 200 and STATE_HEADER in r.headers
    events = [json.loads(line[6:]) for line in r.get_data().split(b"\n") if line.startswith(b"data: ")]
    done = events[-1]
    assert done["type"] == "done"
    state = NodeState.from_brief(done[STATE_FIELD], None)
    model = state.resident(("tiny-a", "f32"))
    assert model is not None and model.prefill_tokens_per_s > 0 and model.decode_step_s > 0


def test_a_tokenizer_answer_carries_it_with_the_model_it_loaded(node_app):
    client = node_app.test_client()
    r = client.post("/tokenize", headers=_auth(node_app), json={"model": "tiny-b", "prompt": "hello"})
    assert r.status_code == 200
    assert _brief(r, None).resident(("tiny-b", "f32")) is not None
    r = client.post("/detokenize", headers=_auth(node_app), json={"model": "tiny-b", "tokens": [1, 2]})
    assert r.status_code == 200 and STATE_HEADER in r.headers


def test_errors_carry_it_and_a_caller_without_the_secret_gets_none(node_app):
    client = node_app.test_client()
    r = client.post("/v1/generate", headers=_auth(node_app), json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and NodeState.from_header(r.headers[STATE_HEADER], None).healthy
    r = client.post("/v1/generate", json={"model": "tiny-a", "prompt": "x"})
    assert r.status_code == 401 and STATE_HEADER not in r.headers
    assert STATE_HEADER not in client.get("/health").headers


def test_a_load_in_progress_is_reported_with_its_times(node_app):
    registry = node_app.extensions["zen_node"].registry
    key = ("tiny-b", "f32")
    registry.last_load_s[key] = 3.5
    with registry._lock:     # a load two seconds in (the job alone: no thread, nothing to wait for)
        registry._loading[key] = _LoadJob(key, 0, time.monotonic() - 2.0)
    try:
        state = NodeState.from_json(node_app.test_client().get("/state", headers=_auth(node_app)).json)
        loading = state.loading_of(key)
        assert loading is not None and loading.expected_s == 3.5 and 2.0 <= loading.elapsed_s < 30
    finally:
        with registry._lock:
            registry._loading.pop(key)
            registry.last_load_s.pop(key)


def test_admission_counts_work_by_latency_class():
    admission = Admission(max_waiting=10)
    a = admission.reserve(2, LatencyClass.BATCH)
    assert admission.by_class_snapshot() == ((0, 0, 2), (0, 0, 0))   # waiting for its model: no prompt yet
    a.admitted(("m", "q"), 100)
    b = admission.reserve(1, LatencyClass.REALTIME)
    b.admitted(("m", "q"), 7)
    assert admission.by_class_snapshot() == ((1, 0, 2), (7, 0, 200))
    a.started()                                    # one of the batch request's sequences has its token
    assert admission.by_class_snapshot() == ((1, 0, 1), (7, 0, 100))
    a.close()
    b.close()
    assert admission.by_class_snapshot() == ((0, 0, 0), (0, 0, 0)) and admission.waiting == 0


def test_an_org_holds_at_most_its_share_of_the_queue():
    """Share 0.5 of 8: an org's sequences wait 4 at most (a larger request only while it has none waiting);
    another org still finds room, and the queue's own bound holds over both."""
    admission = Admission(max_waiting=8, org_share=0.5)
    big = admission.reserve(3, org="a")
    with pytest.raises(QueueFull) as e:
        admission.reserve(2, org="a")
    assert e.value.code == "org_queue_full" and admission.by_org == {"a": 3}
    small = admission.reserve(1, org="a")
    other = admission.reserve(4, org="b")
    with pytest.raises(QueueFull) as e:
        admission.reserve(1, org="c")
    assert e.value.code == "queue_full"
    big.started()
    small.close()
    assert admission.by_org == {"a": 2, "b": 4} and admission.waiting == 6
    big.close()
    other.started()
    other.started()
    alone = admission.reserve(6, org="a")   # more than its share, with none of its own waiting
    assert admission.waiting == 8 and admission.by_org == {"a": 6, "b": 2}
    alone.close()
    other.close()
    assert admission.by_org == {} and admission.waiting == 0
    assert Admission(max_waiting=3, org_share=0.1).max_per_org == 1
    # the prompts of one client request (a group) are one request for the share: a later one is taken
    # while only its own group waits, and another request of the org is not
    parts = [admission.reserve(3, org="a", group="a/r1") for _ in range(2)]
    with pytest.raises(QueueFull):
        admission.reserve(1, org="a", group="a/r2")
    for ticket in parts:
        ticket.close()
    assert admission.by_org == {} and admission.by_group == {} and admission.waiting == 0


def test_the_decode_step_line_is_fitted_from_steps_at_several_batch_sizes():
    fit = DecodeStepFit()
    assert fit.line() == (0.0, 0.0)
    for _ in range(20):
        for batch in (1, 4, 8, 16):
            fit.add(batch, 0.010 + 0.002 * batch)
    base, per_seq = fit.line()
    assert base == pytest.approx(0.010, rel=1e-3) and per_seq == pytest.approx(0.002, rel=1e-3)
    one = DecodeStepFit()
    for _ in range(5):
        one.add(4, 0.02)
    assert one.line() == pytest.approx((0.02, 0.0))     # one batch size: no slope to see


def test_a_slow_first_decode_step_counts_as_much_as_those_after_it():
    fit = DecodeStepFit()
    fit.add(1, 0.010)                   # a cold first step, ten times the others
    for _ in range(9):
        fit.add(1, 0.001)
    assert fit.line() == pytest.approx((0.0019, 0.0))   # the mean of the ten
    for _ in range(200):
        fit.add(1, 0.001)
    assert fit.line()[0] == pytest.approx(0.001, rel=1e-3)


def test_a_refusal_is_logged_with_its_request_and_org(node_app, caplog):
    """The node's refusals leave a line: a warning for its own (a full queue: 503 queue_full), info for
    the client's (a request without a prompt: 400)."""
    client = node_app.test_client()
    headers = {**_auth(node_app), "X-Request-Id": "req-refused-1"}
    admission = node_app.extensions["zen_node"].admission
    held = admission.reserve(admission.max_waiting)   # the queue is full
    try:
        with caplog.at_level(logging.INFO, logger="engine.node"):
            r = client.post("/v1/generate", headers=headers, json={
                "model": "tiny-a", "prompt": "hello", "org": "acme", "request_id": "req-refused-1",
                "sampling": {"max_tokens": 3}})
            bad = client.post("/v1/generate", headers=headers, json={"model": "tiny-a"})
    finally:
        held.close()
    assert r.status_code == 503 and bad.status_code == 400
    refused = [rec for rec in caplog.records if getattr(rec, "event", None) == "refused"]
    assert [(rec.levelno, rec.status, rec.code, rec.request_id, rec.org) for rec in refused] == [
        (logging.WARNING, 503, "queue_full", "req-refused-1", "acme"),
        (logging.INFO, 400, "missing_required_parameter", "req-refused-1", None)]


def test_a_special_token_the_text_leaves_out_is_marked_and_takes_no_text_offset(node_app):
    """<|im_start|> (special, no stop) forced by logit_bias: its logprob entries say `skipped`, the text
    holds none of it, and the completions' text_offset does not move past it."""
    from app.responses import chat_logprob_content, completion_logprobs
    r = node_app.test_client().post("/v1/generate", headers=_auth(node_app), json={
        "model": "tiny-a", "prompt": "hello", "sampling": {"max_tokens": 3, "logprobs": 0, "logit_bias": {"1": 100}}})
    choice = r.json["choices"][0]
    assert choice["token_ids"] == [1, 1, 1] and choice["text"] == ""
    assert [e.get("skipped") for e in choice["logprobs"]] == [True, True, True]
    assert completion_logprobs(choice["logprobs"], 0)["text_offset"] == [0, 0, 0]
    assert chat_logprob_content(choice["logprobs"], 0) == []   # a chat's logprobs are its content's tokens


def test_the_token_that_ends_the_text_is_marked_skipped(node_app):
    """A stop token, and a token that completes a stop string with none of its text output, are marked
    `skipped` (a chat's logprobs leave them out); the tokens before them are not."""
    from app.responses import chat_logprob_content
    client = node_app.test_client()

    def generate(**sampling):
        r = client.post("/v1/generate", headers=_auth(node_app), json={
            "model": "tiny-a", "prompt": "hello", "sampling": {"max_tokens": 8, "logprobs": 0, "ignore_eos": True,
                                                               "seed": 7, **sampling}})
        return r.json["choices"][0]

    tok = node_app.extensions["zen_node"].registry.resident()[0].engine.tokenizer
    free = generate()
    ids = free["token_ids"]
    stop_id = next(t for i, t in enumerate(ids) if i > 0 and ids.index(t) == i and t not in tok.special_token_ids)
    by_id = generate(stop_token_ids=[stop_id])
    assert by_id["token_ids"] == ids[:ids.index(stop_id) + 1] and by_id["finish_reason"] == "stop"
    assert [bool(e.get("skipped")) for e in by_id["logprobs"]] == [False] * ids.index(stop_id) + [True]
    assert len(chat_logprob_content(by_id["logprobs"], 0)) == ids.index(stop_id)
    piece = tok.decode([stop_id])   # a stop string that this token alone completes (seeded: the same tokens)
    assert piece and piece not in tok.decode(ids[:ids.index(stop_id)])
    by_text = generate(stop=[piece])
    assert by_text["token_ids"] == by_id["token_ids"] and by_text["finish_reason"] == "stop"
    assert [bool(e.get("skipped")) for e in by_text["logprobs"]] == [False] * ids.index(stop_id) + [True]
