"""The router: node state parsing, the latency estimate L̂ (latency class, queue, measured rates), the
score α·L̂ + β·U + γ·1[m∉M]·C_load on crafted node states with loads in progress, which nodes are
skipped, and the live pool against stand-in nodes."""
from __future__ import annotations

import time

import pytest

from app.catalog import ResolvedModel
from app.config import NodesConfig, RoutingConfig
from app.latency import ServiceRates, estimate_latency
from app.router import NodePool, rank_nodes, skip_reason
from engine.protocol import LatencyClass, NodeState
from tests.test_gateway_support import MODEL_ID, NODE_SECRET, StandInNode

SMALL = ResolvedModel("zen-small", MODEL_ID, "q4_1", 8192, 512, cold_load_s=2.0)
WEIGHTS = RoutingConfig(alpha=1.0, beta=1.0, gamma=1.0, default_prefill_tokens_per_s=500.0,
                        default_decode_tokens_per_s=20.0)


def state(*, resident=True, waiting=0, running=0, max_waiting=64, utilization=0.1,
          healthy=True, temperature=None, prefill=1000.0, decode=50.0, available=(MODEL_ID,),
          quant="q4_1", admitted=None, ready=True, draining=False, by_class=None, tokens_by_class=(0, 0, 0),
          max_running=64, step=(0.0, 0.0), loading=()):
    models = [{"id": MODEL_ID, "version": "v1", "quantization": quant, "bytes": 100,
               "load_time_s": 0.5, "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode,
               "decode_step_s": step[0], "decode_step_per_seq_s": step[1],
               "running": running, "waiting": waiting}] if resident else []
    admitted = waiting if admitted is None else admitted
    return NodeState.from_json({
        "node_id": "n", "healthy": healthy, "ready": ready, "draining": draining, "models": models, "available_models": list(available),
        "utilization": utilization, "loading": list(loading),
        "queue": {"waiting": waiting, "running": running, "max_waiting": max_waiting, "admitted": admitted,
                  "max_running": max_running, "admitted_by_class": list(by_class or (0, admitted, 0)),
                  "admitted_tokens_by_class": list(tokens_by_class)},
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


def test_parse_state_bounds_a_nodes_garbage_numbers_and_shapes():
    """1e308 tokens queued or a rate of 1e-320 tokens/s must not overflow the router's estimates or make
    them NaN (every request failed with a 500); fields of the wrong type are empty."""
    huge = state(tokens_by_class=(1e308, 1e308, 1e308), waiting=1e308, running=1e308, prefill=1e-320,
                 decode=1e-320, step=(1e308, 1e308))
    good = state()
    ranked = rank_nodes([("http://huge", huge), ("http://good", good)], SMALL, 100, 50, WEIGHTS,
                        cached_tokens={"http://huge": 100.0})
    assert [s.url for s in ranked] == ["http://good", "http://huge"]
    assert all(s.total == s.total and s.total < float("inf") for s in ranked)
    m = huge.resident((MODEL_ID, "q4_1"))
    assert m.prefill_tokens_per_s == 0.0 and m.decode_step_s <= 86_400 and huge.queue.waiting < 2**31
    brief = NodeState.from_header(good.to_header().replace('"q":[', '"q":[1e308,'), good)
    assert brief.queue.waiting < 2**31
    odd = NodeState.from_json({"healthy": True, "models": 1, "available_models": 7, "loading": "x"})
    assert odd.models == () and odd.available_models == () and odd.loading == ()
    with pytest.raises(ValueError):
        NodeState.from_header("[" * 100_000, good)


RATES = ServiceRates(1000.0, 1 / 50)     # 1000 prefill tokens/s, a 20 ms decode step at any batch


def test_latency_estimate_is_prefill_plus_decode_on_an_idle_node():
    assert estimate_latency(state(), 100, 50, RATES) == pytest.approx(100 / 1000 + 50 / 50)


def test_latency_estimate_counts_only_the_work_ahead_of_the_latency_class():
    """Admitted work is served by class, then arrival: a realtime request overtakes the queued standard
    and batch work (its prompt alone is prefilled before it), a batch request waits for all of it."""
    s = state(waiting=8, running=2, admitted=8, by_class=(0, 3, 5), tokens_by_class=(0, 300, 5000))
    realtime = estimate_latency(s, 100, 50, RATES, LatencyClass.REALTIME)
    standard = estimate_latency(s, 100, 50, RATES, LatencyClass.STANDARD)
    batch = estimate_latency(s, 100, 50, RATES, LatencyClass.BATCH)
    assert realtime == pytest.approx(100 / 1000 + 50 / 50)
    assert standard == pytest.approx((300 + 100) / 1000 + 50 / 50)
    assert batch == pytest.approx((5300 + 100) / 1000 + 50 / 50)
    assert realtime < standard < batch


def test_latency_estimate_uses_the_decode_step_at_the_batch_it_joins():
    """The node's fitted step line: 10 ms + 2 ms per sequence; the request joins the 2 running and the
    3 standard requests ahead of it (a batch of 6), a realtime one only the running (a batch of 3)."""
    rates = ServiceRates(1000.0, 0.010, 0.002)
    s = state(waiting=3, running=2, admitted=3, by_class=(0, 3, 0), tokens_by_class=(0, 0, 0))
    assert estimate_latency(s, 0, 100, rates) == pytest.approx(100 * (0.010 + 0.002 * 6))
    assert estimate_latency(s, 0, 100, rates, LatencyClass.REALTIME) == pytest.approx(100 * (0.010 + 0.002 * 3))


def test_latency_estimate_waits_for_a_slot_in_a_full_batch():
    full = state(waiting=0, running=4, admitted=0, max_running=4)
    decode = 50 / 50
    # one sequence over the engine's batch of 4: a quarter of a decode's length to wait for a slot
    assert estimate_latency(full, 0, 50, RATES) == pytest.approx(decode + decode / 4)
    assert estimate_latency(state(running=3, admitted=0, max_running=4), 0, 50, RATES) == pytest.approx(decode)


def test_measured_rates_prefer_the_step_line_over_the_stream_rate():
    m = state(prefill=800.0, decode=40.0, step=(0.01, 0.001)).models[0]
    assert ServiceRates.measured(m) == ServiceRates(800.0, 0.01, 0.001)
    m = state(prefill=800.0, decode=40.0).models[0]
    assert ServiceRates.measured(m) == ServiceRates(800.0, 1 / 40)
    assert ServiceRates.measured(state(prefill=0.0).models[0]) is None


def test_a_request_in_its_prefill_counts_once():
    """The node counts a sequence in its prefill as running, not also as waiting (it once did: the
    estimate doubled its service time); admitted, the sequences without a first token that max_waiting
    bounds, is a count of its own and decides whether the queue is full."""
    busy = state(waiting=0, running=1, admitted=1, max_waiting=2, tokens_by_class=(0, 0, 0))
    rates = ServiceRates(1000.0, 0.0, 0.01)
    # the batch it joins: the one running (in its prefill, also admitted) and itself
    assert estimate_latency(busy, 100, 50, rates) == pytest.approx(100 / 1000 + 50 * 0.02)
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
    busy_warm = state(waiting=10, running=2, tokens_by_class=(0, 5000, 0))   # 5 s of prefill ahead
    idle_cold = state(resident=False)
    ranked = rank_nodes([("busy", busy_warm), ("idle", idle_cold)], SMALL, 100, 50, WEIGHTS)
    assert ranked[0].url == "idle"
    # measured rates and load times from other nodes replace the defaults for the cold node
    ranked = rank_nodes([("busy", busy_warm), ("idle", idle_cold)], SMALL, 100, 50, WEIGHTS,
                        known_rates={SMALL.key: RATES}, known_load_s={SMALL.key: 0.5})
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
                        SMALL, 10, 10, no_cold, known_rates={SMALL.key: RATES})
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


def test_a_load_in_progress_counts_its_remaining_time_not_a_full_cold_load():
    """A node loading the model is "holding it soon": its cold term is what is left of the load."""
    a, b = state(resident=False, utilization=0.5), state(resident=False, utilization=0.0)
    ranked = rank_nodes([("a", a), ("b", b)], SMALL, 10, 10, WEIGHTS, loads_in_progress={"a": 0.5})
    assert [s.url for s in ranked] == ["a", "b"]
    assert ranked[0].loading and ranked[0].cold_load_s == 0.5 and ranked[0].needs_load
    assert ranked[1].cold_load_s == 2.0 and ranked[1].duplicate_load


def test_no_second_load_while_the_first_serves_sooner():
    """Even where utilization favours another node, a second cold load goes after the node already
    loading the model — while that node's wait (L̂ + what is left of its load) is not longer."""
    loading = state(resident=False, utilization=1.0)
    idle = state(resident=False, utilization=0.0)
    ranked = rank_nodes([("loading", loading), ("idle", idle)], SMALL, 10, 10, WEIGHTS,
                        loads_in_progress={"loading": 1.9})
    assert ranked[0].url == "loading" and ranked[1].duplicate_load
    assert ranked[1].total < ranked[0].total       # the score alone would have loaded a second copy


def test_a_second_load_when_the_loading_node_would_serve_later():
    swamped = state(resident=False, waiting=40, admitted=40, tokens_by_class=(0, 40_000, 0))   # 80 s of prefill
    idle = state(resident=False)
    ranked = rank_nodes([("swamped", swamped), ("idle", idle)], SMALL, 10, 10, WEIGHTS,
                        loads_in_progress={"swamped": 1.0})
    assert ranked[0].url == "idle" and not ranked[0].duplicate_load


def test_a_resident_model_is_no_load_in_progress():
    ranked = rank_nodes([("warm", state())], SMALL, 10, 10, WEIGHTS, loads_in_progress={"warm": 1.0})
    assert not ranked[0].needs_load and not ranked[0].loading and ranked[0].cold_load_s == 0


def test_the_latency_class_reaches_the_score():
    queued = state(waiting=5, admitted=5, by_class=(0, 0, 5), tokens_by_class=(0, 0, 5000))
    realtime = rank_nodes([("n", queued)], SMALL, 100, 10, WEIGHTS, latency_class=LatencyClass.REALTIME)[0]
    batch = rank_nodes([("n", queued)], SMALL, 100, 10, WEIGHTS, latency_class=LatencyClass.BATCH)[0]
    assert batch.latency_s - realtime.latency_s == pytest.approx(5000 / 1000)


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


def test_a_burst_between_two_polls_spreads_over_equal_nodes():
    """The score counts what this worker sent a node since its state was polled as queued there: twenty
    requests in one poll interval do not all go to the node that was best at the poll."""
    a, b = StandInNode(node_id="a").start(), StandInNode(node_id="b").start()
    pool = NodePool(_nodes_config([a.url, b.url], poll_interval_s=50, state_ttl_s=100), WEIGHTS)
    try:
        pool.rank(SMALL, 200, 200)                                          # the poll
        firsts = [pool.rank(SMALL, 200, 200)[0].url for _ in range(20)]
        assert abs(firsts.count(a.url) - firsts.count(b.url)) <= 1
        pool.refresh()                    # new states of both: what was sent before them is in them
        assert all(pool.policy.with_sent(v.url, v.state, v.fetched_at) is v.state for v in pool.snapshot())
    finally:
        pool.close()
        a.stop()
        b.stop()


def test_a_request_ranked_on_an_older_state_counts_in_the_newer_ones_count():
    """A thread that ranked before a node's newer state came counts its request against that state (it
    replaced the count with a fresh one: the burst since the newer state was forgotten)."""
    from app.routing_policy import RoutingPolicy
    policy, node = RoutingPolicy(WEIGHTS), state()
    old, new = [rank_nodes([("http://a", node)], SMALL, 10, 10, WEIGHTS)[0]], 2.0
    for _ in range(3):
        policy.order(old, {"http://a": node}, {"http://a": new}, None)
    policy.order(old, {"http://a": node}, {"http://a": 1.0}, None)        # the late thread's older state
    assert policy.outstanding("http://a", node, new) == 4


def test_a_node_discovery_dropped_is_forgotten_by_the_faults_too():
    """Pods come and go under one name: what a worker held against a dropped node's address goes with it;
    a paused node that serves a request it took before its pause stays paused."""
    from app.node_faults import THRESHOLD, NodeFaults
    faults = NodeFaults()
    for _ in range(THRESHOLD):
        faults.served("http://b", ["http://a"])
    assert faults.usable(["http://a", "http://b"]) == ["http://b"]
    faults.forget("http://a")
    assert faults.usable(["http://a", "http://b"]) == ["http://a", "http://b"] and not faults._until
    for _ in range(THRESHOLD):
        faults.served("http://b", ["http://a"])
    faults.served("http://a", [])
    assert faults.usable(["http://a", "http://b"]) == ["http://b"]


def test_nodes_left_out_are_not_ranked_nor_counted_and_a_tokenizer_call_counts_nothing():
    """`keep` (the nodes passed over for their faults) filters before the ranking: what the ranking records
    for its first node (the requests sent there) goes to the node that is tried, not to one passed over."""
    a, b = StandInNode(node_id="a").start(), StandInNode(node_id="b").start()
    a.state, b.state = {"utilization": 0.0}, {"utilization": 0.9}   # a ranks first when it may
    pool = NodePool(_nodes_config([a.url, b.url], poll_interval_s=50, state_ttl_s=100), WEIGHTS)
    try:
        assert pool.rank(SMALL, 200, 200)[0].url == a.url                   # the poll; one sent to a
        views = {v.url: v for v in pool.snapshot()}

        def sent(url: str) -> int:
            since = pool.policy._sent_since(url, views[url].fetched_at)
            return 0 if since is None else sum(since.requests)
        without_a = lambda urls: [u for u in urls if u != a.url]  # noqa: E731
        assert [s.url for s in pool.rank(SMALL, 200, 200, keep=without_a)] == [b.url]
        assert sent(a.url) == 1 and sent(b.url) == 1
        pool.rank(SMALL, 1, 1, generation=False)
        assert sent(a.url) == 1 and sent(b.url) == 1
    finally:
        pool.close()
        a.stop()
        b.stop()


def test_pool_refuses_without_the_node_secret():
    node = StandInNode(secret="other").start()
    pool = NodePool(_nodes_config([node.url]), WEIGHTS)
    try:
        assert pool.rank(SMALL, 1, 1) == []
        assert "401" in pool.snapshot()[0].last_error
    finally:
        pool.close()
        node.stop()


def test_concurrent_callers_share_one_refresh_of_silent_nodes():
    """Nodes that accept connections but never answer: callers that queued behind a refresh use it
    instead of each polling again (the Nth would wait N poll timeouts, /health too)."""
    import socket
    import threading
    holes = [socket.socket() for _ in range(2)]
    for s in holes:
        s.bind(("127.0.0.1", 0))
        s.listen(64)                               # never accepted, never answered
    timeout = 0.5                                  # one poll's timeout (connect_timeout_s)
    pool = NodePool(_nodes_config([f"http://127.0.0.1:{s.getsockname()[1]}" for s in holes],
                                  connect_timeout_s=timeout, state_ttl_s=60, poll_interval_s=60),
                    WEIGHTS)
    refreshes = []
    refresh = pool.refresh
    pool.refresh = lambda: (refreshes.append(1), refresh())[1]
    start, took = threading.Barrier(6), []

    def one():
        start.wait()
        t0 = time.monotonic()
        assert pool.rank(SMALL, 10, 10) == []
        took.append(time.monotonic() - t0)
    threads = [threading.Thread(target=one) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(took) == 6 and len(refreshes) == 1
        assert max(took) < 1.5 * timeout + 0.25    # serially refreshing, the last took 6x the timeout
    finally:
        pool.close()
        for s in holes:
            s.close()
