"""The gateway <-> node wire types: light to import, and what one side writes the other reads back."""
from __future__ import annotations

import subprocess
import sys

import pytest

from engine.protocol import (APIError, GenerateRequest, LatencyClass, ModelState, NodeState, QueueState,
                             error_type_for, is_loopback_host)
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


def test_node_state_round_trip():
    state = NodeState("n", True, (ModelState("m", "q4_1", running=2, decode_tokens_per_s=30.0),),
                      ("m",), 0.5, QueueState(waiting=1, running=2, admitted=1, max_waiting=4), ready=True,
                      loading=(("m", "f16"),))
    assert NodeState.from_json(state.to_json()) == state


def test_error_types_follow_the_status():
    assert [error_type_for(s) for s in (400, 401, 429, 503)] == [
        "invalid_request_error", "invalid_request_error", "rate_limit_exceeded", "server_error"]
