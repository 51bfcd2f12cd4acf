"""The router's load records (app/load_records.py) in each store — this process's memory, the embedded
SQLite store shared by a gateway's workers, Redis shared by replicas — and two workers' pools deciding
on them: one load for a model no node holds, not one per worker."""
from __future__ import annotations


import pytest

from app.catalog import ResolvedModel
from app.limit_store import LimitStore, StoreError
from app.load_records import (LOAD_EXPIRY_FACTOR, LOAD_EXPIRY_SLACK_S, EmbeddedLoadRecords, LoadRecord,
                              LoadRecords, LoadRecordStore, MemoryLoadRecords, RedisLoadRecords)
from app.router import NodePool, rank_nodes
from engine.protocol import NodeState
from scripts.local_processes import RedisProcess
from tests.test_gateway_router import WEIGHTS, _nodes_config
from tests.test_gateway_support import MODEL_ID, StandInNode

Q8 = ResolvedModel("zen-small-q8", MODEL_ID, "q8_0", 8192, 512, cold_load_s=3.0)
KEY = Q8.key
HOLD_S = 5.0


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def redis_url():
    server = RedisProcess().start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(params=["memory", "embedded", "redis"])
def stores(request, tmp_path):
    """A factory of stores over the same records (two of them: two workers), with one clock."""
    clock = Clock()
    if request.param == "memory":
        shared = MemoryLoadRecords(HOLD_S, clock)
        yield (lambda: shared), clock
        return
    if request.param == "embedded":
        opened = []

        def embedded() -> LoadRecordStore:
            opened.append(LimitStore(str(tmp_path), clock=clock))
            return EmbeddedLoadRecords(opened[-1], HOLD_S)
        yield embedded, clock
        for store in opened:
            store.close()
        return
    url = request.getfixturevalue("redis_url")
    made = []

    def in_redis() -> LoadRecordStore:
        made.append(RedisLoadRecords(url, HOLD_S, clock=clock))
        return made[-1]
    yield in_redis, clock
    made[0]._redis.flushdb()


def test_the_first_claim_wins_and_the_second_sees_it(stores):
    make, clock = stores
    one, two = make(), make()
    first = one.claim(KEY, "http://a", 3.0, frozenset())
    assert first.claimed and first.records == {"http://a": LoadRecord("http://a", clock.now, 3.0)}
    # another worker about to load the model on b meets a's record, which it had not seen
    second = two.claim(KEY, "http://b", 3.0, frozenset())
    assert not second.claimed and set(second.records) == {"http://a"}
    # having seen it (and still preferring b: a's wait is longer), it may load a second copy
    third = two.claim(KEY, "http://b", 3.0, frozenset({"http://a"}))
    assert third.claimed and set(third.records) == {"http://a", "http://b"}
    # a claim on a node already loading the model changes nothing
    again = one.claim(KEY, "http://a", 9.0, frozenset({"http://b"}))
    assert again.claimed and again.records["http://a"].expected_s == 3.0


def test_a_finished_load_is_resident_then_expires(stores):
    make, clock = stores
    one, two = make(), make()
    one.claim(KEY, "http://a", 3.0, frozenset())
    clock.now += 1.0
    assert one.claim(KEY, "http://a", 3.0, frozenset()).records["http://a"].remaining_s(clock.now) == 2.0
    two.finish(KEY, "http://a")
    record = one.claim(KEY, "http://a", 3.0, frozenset()).records["http://a"]
    assert record.done_at == clock.now and record.remaining_s(clock.now) == 0.0
    clock.now += HOLD_S + 0.01                      # every worker has polled the node since
    assert not one.claim(KEY, "http://b", 3.0, frozenset()).records.get("http://a")


def test_a_load_in_progress_expires_so_a_dead_node_blocks_nothing(stores):
    make, clock = stores
    one = make()
    one.claim(KEY, "http://a", 2.0, frozenset())
    clock.now += LOAD_EXPIRY_FACTOR * 2.0 + LOAD_EXPIRY_SLACK_S - 0.1
    assert "http://a" in one.claim(KEY, "http://a", 2.0, frozenset()).records
    clock.now += 0.2
    assert one.claim(KEY, "http://b", 2.0, frozenset()).records.keys() == {"http://b"}


def test_a_dropped_load_is_gone_and_models_are_apart(stores):
    make, _ = stores
    one, two = make(), make()
    one.claim(KEY, "http://a", 3.0, frozenset())
    one.claim((MODEL_ID, "f16"), "http://b", 3.0, frozenset())
    two.drop(KEY, "http://a")
    assert two.claim(KEY, "http://b", 3.0, frozenset()).claimed
    assert one.claim((MODEL_ID, "f16"), "http://a", 3.0, frozenset()).records.keys() == {"http://b"}


class FailingStore(LoadRecordStore):
    def claim(self, *args):
        raise StoreError("the limits store is locked (another process held it)")

    finish = drop = claim


def test_a_failing_shared_store_falls_back_to_this_workers_records(caplog):
    records = LoadRecords(FailingStore(), HOLD_S)
    assert records.claim(KEY, "http://a", 3.0, frozenset()).claimed
    assert not records.claim(KEY, "http://b", 3.0, frozenset()).claimed      # the local record holds
    assert sum("load_records_down" == getattr(r, "event", None) for r in caplog.records) == 1


# -- two workers' pools -------------------------------------------------------------------------------

@pytest.fixture
def two_nodes():
    warm = StandInNode(node_id="warm").start()            # zen-small (q4_1) resident
    empty = StandInNode(node_id="empty", models=[]).start()
    yield warm, empty
    warm.stop()
    empty.stop()


def _pool(nodes, records, **kw) -> NodePool:
    # a slow poll: the views stay as they were first polled (what made the duplicate loads)
    return NodePool(_nodes_config([n.url for n in nodes], poll_interval_s=60, state_ttl_s=120), WEIGHTS,
                    records=records, **kw)


def test_two_workers_route_a_model_no_node_holds_to_one_node(two_nodes, tmp_path):
    stores = [LimitStore(str(tmp_path)) for _ in range(2)]       # one file, two stores on it: two workers
    pools = [_pool(two_nodes, LoadRecords(EmbeddedLoadRecords(s, HOLD_S), HOLD_S)) for s in stores]
    try:
        first = pools[0].rank(Q8, 10, 10)
        assert first[0].needs_load and not first[0].loading
        chosen = first[0].url
        for pool in pools:    # each worker, with its own stale view, now goes where the load is
            ranked = pool.rank(Q8, 10, 10)
            assert ranked[0].url == chosen and ranked[0].loading and ranked[0].cold_load_s <= 3.0
            assert ranked[1].duplicate_load
        # the node answered with the model resident: the others route there as if it were polled so
        state = pools[0].state_of(chosen)
        pools[0].load_result(KEY, chosen, state, served=True)
        ranked = pools[1].rank(Q8, 10, 10)
        assert ranked[0].url == chosen and ranked[0].cold_load_s == 0.0
    finally:
        for pool in pools:
            pool.close()
        for store in stores:
            store.close()


def test_a_worker_whose_view_prefers_another_node_still_joins_the_load(two_nodes, tmp_path):
    """The report's duplicate: the second worker's view (polled while the first load ran) made the
    loading node look worse, so it loaded the model a second time elsewhere. The record keeps it on
    the loading node, whose remaining load serves it sooner than a new one."""
    stores = [LimitStore(str(tmp_path)) for _ in range(2)]
    pools = [_pool(two_nodes, LoadRecords(EmbeddedLoadRecords(s, HOLD_S), HOLD_S)) for s in stores]
    try:
        chosen = pools[0].rank(Q8, 10, 10)[0].url
        loading_node = next(n for n in two_nodes if n.url == chosen)
        loading_node.state = {"utilization": 0.9}      # busy while it loads
        pools[1].refresh()
        usable = [(v.url, v.state) for v in pools[1].snapshot()]
        assert rank_nodes(usable, Q8, 10, 10, WEIGHTS)[0].url != chosen     # the view alone: a second load
        ranked = pools[1].rank(Q8, 10, 10)
        assert ranked[0].url == chosen and ranked[0].loading and ranked[1].duplicate_load
    finally:
        for pool in pools:
            pool.close()
        for store in stores:
            store.close()


def test_a_claim_ranked_away_from_is_withdrawn(two_nodes):
    """A worker claims a load on one node, and the claim brings news (the load elsewhere it waited on
    has finished): it goes there instead, and the load it recorded and will not start is dropped."""
    a, b = (n.url for n in two_nodes)
    store = MemoryLoadRecords(HOLD_S)
    pool = _pool(two_nodes, LoadRecords(store, HOLD_S))
    try:
        store.claim(KEY, b, 100.0, frozenset())           # another worker's long load on b
        assert pool.rank(Q8, 10, 10)[0].url == a           # a fresh load on a is sooner
        store.drop(KEY, a)
        pool._seen[KEY].pop(a)                             # as before that claim: b's load known
        store.finish(KEY, b)                               # b's load has finished meanwhile
        ranked = pool.rank(Q8, 10, 10)
        assert ranked[0].url == b
        assert set(pool.records.claim(KEY, "http://elsewhere", 3.0, frozenset()).records) == {b}
    finally:
        pool.close()


def test_a_refused_load_is_dropped_and_the_next_choice_is_free(two_nodes):
    records = LoadRecords(None, HOLD_S)
    pool = _pool(two_nodes, records)
    try:
        chosen = pool.rank(Q8, 10, 10)[0].url
        pool.load_result(KEY, chosen, None)              # the node did not answer: no load there
        pool.mark_down(chosen, "test")
        ranked = pool.rank(Q8, 10, 10)
        assert [s.url for s in ranked] != [chosen] and not ranked[0].loading
    finally:
        pool.close()


def test_a_record_the_node_contradicts_later_is_stale(two_nodes):
    wall = Clock()
    records = LoadRecords(MemoryLoadRecords(HOLD_S, wall), HOLD_S)
    pool = _pool(two_nodes, records, wall_clock=wall)
    try:
        chosen = pool.rank(Q8, 10, 10)[0].url
        assert pool.rank(Q8, 10, 10)[0].loading
        wall.now += 5.0
        pool.refresh()     # a poll well after the request reached the node: neither loading nor resident
        assert not any(s.loading for s in pool.rank(Q8, 10, 10)), chosen
    finally:
        pool.close()


def test_the_nodes_own_loading_report_counts_without_a_record(two_nodes):
    warm, empty = two_nodes
    empty.state = {"loading": [{"id": MODEL_ID, "quantization": "q8_0", "elapsed_s": 1.0, "expected_s": 3.0}]}
    pool = _pool(two_nodes, LoadRecords(None, HOLD_S))
    try:
        best = pool.rank(Q8, 10, 10)[0]
        assert best.url == empty.url and best.loading and best.cold_load_s == pytest.approx(2.0, abs=0.2)
    finally:
        pool.close()


def test_a_state_brief_updates_the_view_at_once(two_nodes):
    warm, empty = two_nodes
    pool = _pool(two_nodes, LoadRecords(None, HOLD_S))
    try:
        assert pool.rank(Q8, 10, 10)[0].needs_load
        polled = pool.state_of(empty.url)
        brief = NodeState.from_json({**empty.state_body(), "models": [
            {"id": MODEL_ID, "quantization": "q8_0", "load_time_s": 2.5}]}).to_header()
        pool.observe(empty.url, NodeState.from_header(brief, polled))
        best = pool.rank(Q8, 10, 10)[0]
        assert best.url == empty.url and not best.needs_load
        assert pool.state_of(empty.url).available_models == polled.available_models
    finally:
        pool.close()


# -- through the gateway: the node's answers update the view and settle the records ---------------

@pytest.fixture
def gateway_two_nodes(two_nodes):
    from app import close_app, create_app
    from tests.test_gateway_support import make_config
    warm, empty = two_nodes
    config = make_config([warm.url, empty.url], nodes={"poll_interval_s": 60.0, "state_ttl_s": 120.0})
    app = create_app(config)
    yield app, config, warm, empty
    close_app(app)


def _post(app, config, alias: str, stream: bool = False):
    from tests.test_gateway_support import bearer
    r = app.test_client().post("/v1/chat/completions", headers=bearer(config), json={
        "model": alias, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream})
    r.get_data()
    return r


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_updates_the_view_without_a_poll(gateway_two_nodes, stream):
    app, config, warm, empty = gateway_two_nodes
    pool = app.extensions["zen.nodes"].pool
    assert _post(app, config, "zen-small", stream).status_code == 200     # the first use polls
    polls = warm.state_polls
    warm.state = {"utilization": 0.75}
    assert _post(app, config, "zen-small", stream).status_code == 200
    assert pool.state_of(warm.url).utilization == 0.75 and warm.state_polls == polls


def _records(pool) -> dict:
    """Every record of q8, as another worker that has seen none would meet them."""
    return pool.records.claim(KEY, "http://elsewhere", 3.0, frozenset()).records


def test_a_load_the_node_took_is_recorded_as_resident_there(gateway_two_nodes):
    app, config, warm, empty = gateway_two_nodes
    pool = app.extensions["zen.nodes"].pool
    assert _post(app, config, "zen-small-q8").status_code == 200
    records = _records(pool)
    served = [n for n in (warm, empty) if any(p["quantization"] == "q8_0" for p in n.received)]
    assert len(served) == 1 and set(records) == {served[0].url} and records[served[0].url].done_at is not None


def test_a_node_that_drops_the_request_loses_its_record_and_the_next_one_loads(gateway_two_nodes):
    app, config, warm, empty = gateway_two_nodes
    pool = app.extensions["zen.nodes"].pool
    first = pool.rank(Q8, 10, 10)[0].url
    pool.records.drop(KEY, first)
    pool._seen.clear()
    dropping = warm if first == warm.url else empty
    dropping.drop_requests = 1      # reads the request and closes the connection: a node that died
    assert _post(app, config, "zen-small-q8").status_code == 200
    records = _records(pool)
    assert first not in records and len(records) == 1 and next(iter(records.values())).done_at is not None


def test_a_tokenizer_call_settles_the_load_it_claimed(gateway_two_nodes):
    from tests.test_gateway_support import bearer
    app, config, warm, empty = gateway_two_nodes
    pool = app.extensions["zen.nodes"].pool
    r = app.test_client().post("/tokenize", headers=bearer(config), json={"model": "zen-small-q8", "prompt": "hi"})
    assert r.status_code == 200, r.get_json()
    records = _records(pool)
    served = [n for n in (warm, empty) if any(p.get("quantization") == "q8_0" for p in n.received)]
    assert len(served) == 1 and set(records) == {served[0].url} and records[served[0].url].done_at is not None
