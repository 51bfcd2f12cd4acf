"""The router: node state parsing, the score α·L̂ + β·U + γ·1[m∉M]·C_load on crafted node
states, which nodes are skipped, and the live pool against stand-in nodes."""
from __future__ import annotations

import time

import pytest

from app.catalog import ResolvedModel
from app.config import NodesConfig, RoutingConfig
from app.router import NodePool, estimate_latency, rank_nodes, skip_reason
from engine.protocol import NodeState
from tests.test_gateway_support import MODEL_ID, NODE_SECRET, StandInNode

SMALL = ResolvedModel("zen-small", MODEL_ID, "q4_1", 8192, 512, cold_load_s=2.0)
WEIGHTS = RoutingConfig(alpha=1.0, beta=1.0, gamma=1.0, default_prefill_tokens_per_s=500.0,
                        default_decode_tokens_per_s=20.0)


def state(*, resident=True, waiting=0, running=0, max_waiting=64, utilization=0.1,
          healthy=True, temperature=None, prefill=1000.0, decode=50.0, available=(MODEL_ID,),
          quant="q4_1", admitted=None, ready=True, draining=False):
    models = [{"id": MODEL_ID, "version": "v1", "quantization": quant, "bytes": 100,
               "load_time_s": 0.5, "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode,
               "running": running, "waiting": waiting}] if resident else []
    return NodeState.from_json({
        "node_id": "n", "healthy": healthy, "ready": ready, "draining": draining, "models": models, "available_models": list(available),
        "utilization": utilization,
        "queue": {"waiting": waiting, "running": running, "max_waiting": max_waiting,
                  "admitted": waiting if admitted is None else admitted},
        "temperature_c": temperature, "power_w": None, "kv_cache_usage": 0.2,
        "memory": {"used_bytes": 1, "total_bytes": 2}})


def test_parse_state_reads_the_node_protocol():
    s = state(waiting=3, running=2, temperature=61.5)
    assert s.healthy and s.queue.waiting == 3 and s.queue.running == 2 and s.queue.max_waiting == 64
    assert s.temperature_c == 61.5 and s.utilization == 0.1
    m = s.resident((MODEL_ID, "q4_1"))
    assert m is not None and m.prefill_tokens_per_s == 1000.0 and m.load_time_s == 0.5
    assert s.resident((MODEL_ID, "f16")) is None


def test_parse_state_tolerates_junk():
    s = NodeState.from_json({"healthy": "yes", "models": [None, {"id": 3}, {"id": "m", "bytes": "x"}],
                     "utilization": 7, "queue": "full", "temperature_c": float("nan")})
    assert not s.healthy                       # only `true` is healthy
    assert [m.id for m in s.models] == ["m"]
    assert s.utilization == 1.0 and s.queue.waiting == 0 and s.temperature_c == 0.0
    with pytest.raises(ValueError):
        NodeState.from_json([1, 2])


def test_latency_estimate_is_queue_wait_plus_prefill_plus_decode():
    s = state(waiting=10, running=2)
    service = 100 / 1000 + 50 / 50                 # prefill 0.1 s + decode 1.0 s
    assert estimate_latency(s, 100, 50, 1000, 50) == pytest.approx(service + 10 * service / 2)
    assert estimate_latency(state(), 100, 50, 1000, 50) == pytest.approx(service)


def test_a_request_in_its_prefill_counts_once():
    """The node counts a sequence in its prefill as running, not also as waiting (it once did: the
    estimate doubled its service time); admitted, the sequences without a first token that max_waiting
    bounds, is a count of its own and decides whether the queue is full."""
    busy = state(waiting=0, running=1, admitted=1, max_waiting=2)
    service = 100 / 1000 + 50 / 50
    assert estimate_latency(busy, 100, 50, 1000, 50) == pytest.approx(service)
    assert busy.queue.admitted == 1 and not busy.queue.full
    assert state(waiting=0, running=2, admitted=2, max_waiting=2).queue.full


def test_resident_model_wins_when_queues_are_equal():
    ranked = rank_nodes([("cold", state(resident=False)), ("warm", state())], SMALL, 100, 50, WEIGHTS)
    assert [s.url for s in ranked] == ["warm", "cold"]
    warm, cold = ranked
    assert warm.cold_load_s == 0 and cold.cold_load_s == 2.0     # configured C_load
    assert warm.total == pytest.approx(100 / 1000 + 50 / 50 + 0.1)          # measured rates
    assert cold.total == pytest.approx(100 / 500 + 50 / 20 + 0.1 + 2.0)     # default rates


def test_long_queue_loses_to_a_cold_load():
    busy_warm = state(waiting=10, running=2)
    idle_cold = state(resident=False)
    ranked = rank_nodes([("busy", busy_warm), ("idle", idle_cold)], SMALL, 100, 50, WEIGHTS)
    assert ranked[0].url == "idle"
    # measured rates and load times from other nodes replace the defaults for the cold node
    ranked = rank_nodes([("busy", busy_warm), ("idle", idle_cold)], SMALL, 100, 50, WEIGHTS,
                        known_rates={SMALL.key: (1000.0, 50.0)}, known_load_s={SMALL.key: 0.5})
    idle = next(s for s in ranked if s.url == "idle")
    assert idle.latency_s == pytest.approx(1.1) and idle.cold_load_s == 0.5


def test_weights_change_the_choice():
    a = state(utilization=0.9)                         # resident but busy accelerator
    b = state(resident=False, utilization=0.0)
    assert rank_nodes([("a", a), ("b", b)], SMALL, 10, 10, WEIGHTS)[0].url == "a"
    heavy_u = RoutingConfig(alpha=1.0, beta=100.0, gamma=1.0)
    assert rank_nodes([("a", a), ("b", b)], SMALL, 10, 10, heavy_u)[0].url == "b"
    no_cold = RoutingConfig(alpha=1.0, beta=1.0, gamma=0.0)
    ranked = rank_nodes([("a", state(utilization=0.5)), ("b", state(resident=False, utilization=0.0))],
                        SMALL, 10, 10, no_cold, known_rates={SMALL.key: (1000.0, 50.0)})
    assert ranked[0].url == "b"


def test_other_quantization_counts_as_not_resident():
    f16 = ResolvedModel("zen-small-f16", MODEL_ID, "f16", 8192, 512, cold_load_s=4.0)
    ranked = rank_nodes([("q4", state(quant="q4_1")), ("f16", state(quant="f16"))], f16, 10, 10, WEIGHTS)
    assert ranked[0].url == "f16" and ranked[1].cold_load_s == 4.0


def test_full_queues_go_last():
    full = state(waiting=64, max_waiting=64, running=8)
    assert full.queue.full
    ranked = rank_nodes([("full", state(waiting=64, max_waiting=64, running=64)),
                         ("cold", state(resident=False, utilization=1.0))], SMALL, 10, 10, WEIGHTS)
    assert [s.url for s in ranked] == ["cold", "full"]


@pytest.mark.parametrize("kwargs, fresh, down, reason", [
    ({}, True, False, None),
    ({"healthy": False}, True, False, "unhealthy"),
    ({"draining": True, "ready": False}, True, False, "draining"),
    ({"ready": False}, True, False, "not ready"),
    ({"temperature": 91.0}, True, False, "too hot"),
    ({"temperature": 84.0}, True, False, None),
    ({}, False, False, "no fresh state"),
    ({}, True, True, "down"),
    ({"resident": False, "available": ("OtherModel",)}, True, False, "cannot load model"),
    ({"resident": False, "available": ()}, True, False, None),   # no list: assume it can load
])
def test_skip_reasons(kwargs, fresh, down, reason):
    assert skip_reason(state(**kwargs), fresh, down, SMALL, max_temperature_c=85.0) == reason


# -- the live pool --------------------------------------------------------------------------------

def _nodes_config(urls, **kw):
    base = dict(urls=tuple(urls), secret=NODE_SECRET, poll_interval_s=0.1, state_ttl_s=0.5,
                connect_timeout_s=0.5)
    base.update(kw)
    return NodesConfig(**base)


def test_pool_polls_ranks_and_marks_nodes_down():
    warm = StandInNode(node_id="warm").start()
    cold = StandInNode(node_id="cold", models=[]).start()
    dead_url = "http://127.0.0.1:9"           # nothing listens there
    pool = NodePool(_nodes_config([cold.url, warm.url, dead_url]), WEIGHTS)
    try:
        ranked = pool.rank(SMALL, 100, 50)    # first use polls synchronously
        assert [s.url for s in ranked] == [warm.url, cold.url]
        assert cold.state_polls >= 1 and warm.state_polls >= 1
        views = {v.url: v for v in pool.snapshot()}
        assert views[dead_url].down and "ConnectionError" in views[dead_url].last_error
        # a hot node is skipped at the next poll
        warm.state = {"temperature_c": 99.0}
        deadline = time.monotonic() + 5
        while pool.rank(SMALL, 100, 50)[0].url != cold.url:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        warm.state = {}
        pool.mark_down(cold.url, "test")
        assert {v.url: v.down for v in pool.snapshot()}[cold.url]
        # the background poller brings it back
        deadline = time.monotonic() + 5
        while len(pool.rank(SMALL, 100, 50)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        pool.close()
        warm.stop()
        cold.stop()


def test_pool_forgets_stale_state():
    node = StandInNode().start()
    clock = [100.0]
    pool = NodePool(_nodes_config([node.url], poll_interval_s=50, state_ttl_s=100), WEIGHTS,
                    clock=lambda: clock[0])
    try:
        assert len(pool.rank(SMALL, 1, 1)) == 1
        node.stop()                                # no more answers
        clock[0] += 101                            # its state is now older than the TTL
        assert pool.rank(SMALL, 1, 1) == []        # a re-poll fails: down
        assert pool.snapshot()[0].down
    finally:
        pool.close()


def test_pool_refuses_without_the_node_secret():
    node = StandInNode(secret="other").start()
    pool = NodePool(_nodes_config([node.url]), WEIGHTS)
    try:
        assert pool.rank(SMALL, 1, 1) == []
        assert "401" in pool.snapshot()[0].last_error
    finally:
        pool.close()
        node.stop()
