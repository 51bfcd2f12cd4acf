"""The gateway <-> node wire types: light to import, and what one side writes the other reads back."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from engine.protocol import (APIError, GenerateRequest, LatencyClass, LoadingState, MemoryState, ModelState,
                             NodeState, QueueState, error_type_for, is_loopback_host)
from engine.sampling import SamplingParams
from models.inspect import check_quantization


def test_the_protocol_module_is_light():
    code = "import engine.protocol, sys; print(sorted(m for m in ('numba', 'flask', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("localhost", True), ("LocalHost.", True), ("::1", True),
    ("[::1]", True), (" 127.0.0.1 ", True), ("0.0.0.0", False), ("::", False), ("", False), (None, False),
    ("10.0.0.7", False), ("192.168.1.2", False), ("node-1.example.com", False), ("localhost.example.com", False)])
def test_is_loopback_host(host, loopback):
    assert is_loopback_host(host) is loopback


def test_latency_class_by_rank_or_label():
    assert LatencyClass("realtime") is LatencyClass(0) is LatencyClass.parse(" Realtime ")
    assert LatencyClass.BATCH.label == "batch" and LatencyClass.BATCH.rank == 2
    with pytest.raises(ValueError, match="must be one of realtime, standard, batch"):
        LatencyClass.parse("urgent")


def test_generate_request_round_trip():
    sent = GenerateRequest("acme/r1", "tiny", "q8_0", "acme", LatencyClass.REALTIME,
                           SamplingParams(max_tokens=7, stop=("a",), logit_bias={"17": 2.5}, seed=3),
                           stream=True, messages=[{"role": "user", "content": "hi"}])
    body = sent.to_json()
    assert body["latency_class"] == "realtime" and "best_of" not in body["sampling"]
    got = GenerateRequest.from_json(body, check_quantization)
    assert got == sent


def test_generate_request_errors_name_the_parameter():
    with pytest.raises(APIError) as err:
        GenerateRequest.from_json({"model": "m", "prompt": "x", "quantization": "q3_k"}, check_quantization)
    assert err.value.status == 400 and err.value.param == "quantization"
    with pytest.raises(APIError) as err:
        GenerateRequest.from_json({"model": "m", "prompt": "x", "sampling": {"temperature": -1}}, check_quantization)
    assert err.value.param == "temperature" and err.value.type == "invalid_request_error"
    for falsy in (0, False, ""):                 # no class name: an error, not the default class
        with pytest.raises(APIError) as err:
            GenerateRequest.from_json({"model": "m", "prompt": "x", "latency_class": falsy}, check_quantization)
        assert err.value.param == "latency_class"
    assert GenerateRequest.from_json({"model": "m", "prompt": "x"}, check_quantization).latency_class.label == "standard"


def _full_state() -> NodeState:
    return NodeState("n", True, (ModelState("m", "q4_1", version="v", bytes=10, load_time_s=1.5, running=2,
                                            decode_tokens_per_s=30.0, decode_step_s=0.01,
                                            decode_step_per_seq_s=0.002, kv_cache_blocks=7, max_model_len=9),),
                     ("m",), 0.5, QueueState(waiting=1, running=2, admitted=1, max_waiting=4, max_running=8,
                                             admitted_by_class=(1, 0, 0), admitted_tokens_by_class=(12, 0, 0)),
                     temperature_c=50.0, ready=True, loading=(LoadingState("m", "f16", 1.25, 3.0),),
                     memory=MemoryState(budget_bytes=100), uptime_s=5.0)


def test_node_state_round_trip():
    state = _full_state()
    assert NodeState.from_json(state.to_json()) == state


def test_state_brief_round_trip_over_the_polled_state():
    """The brief (a header, and a stream's last event) carries what changes per request; the rest
    (available models, memory, a model's version and size) comes from the state it is read over."""
    state = _full_state()
    header = state.to_header()
    assert header.isascii() and "\n" not in header
    assert NodeState.from_header(header, state) == state
    busier = replace(state, queue=replace(state.queue, admitted=3, admitted_by_class=(1, 2, 0)), loading=())
    assert NodeState.from_header(busier.to_header(), state) == busier
    bare = NodeState.from_brief(state.to_brief(), None)    # nothing polled yet: the brief alone
    assert bare.queue == state.queue and bare.loading == state.loading and bare.available_models == ()
    assert bare.models[0].decode_step_s == 0.01 and bare.models[0].version == ""


@pytest.mark.parametrize("junk", ["", "[]", "{}", '{"q": [1], "m": [], "l": []}', "not json",
                                  '{"h":1,"r":1,"d":0,"u":0,"t":null,"k":0,"q":[0,0,0,0,0,0,0,0,0,0,0],'
                                  '"m":[["m"]],"l":[]}'])
def test_a_bad_brief_is_a_value_error(junk):
    with pytest.raises(ValueError):
        NodeState.from_header(junk, _full_state())


def test_numbers_past_floats_range_in_a_state_are_junk_values():
    huge = 10 ** 400    # what json reads from 400 digits: an exact int that float() cannot hold
    state = _full_state()
    polled = state.to_json()
    polled["utilization"] = huge
    assert NodeState.from_json(polled).utilization == 0.0
    brief = state.to_brief()
    brief["u"] = huge
    brief["l"][0][2] = huge
    got = NodeState.from_brief(brief, state)
    assert got.utilization == 0.0 and got.loading[0].elapsed_s == 0.0


def test_queue_work_ahead_of_each_class():
    q = QueueState(admitted_by_class=(1, 2, 3), admitted_tokens_by_class=(10, 20, 30))
    assert [q.ahead_of(c) for c in LatencyClass] == [(1, 10), (3, 30), (6, 60)]


def test_error_types_follow_the_status():
    assert [error_type_for(s) for s in (400, 401, 429, 503)] == [
        "invalid_request_error", "invalid_request_error", "rate_limit_exceeded", "server_error"]
