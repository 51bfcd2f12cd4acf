"""The embedded limits store (app/limit_store.py): several processes on one limit never over-admit, the
`limits` strategies keep their meaning on it, its token buckets follow MemoryTokenBuckets' arithmetic, and
a store that fails follows the failure policy."""
from __future__ import annotations

import multiprocessing
import os
import random

import limits
import limits.storage
import limits.strategies
import pytest

from app.config import LimitsConfig, TierConfig
from engine.protocol import APIError
from app.limit_store import (DB_NAME, LIMITS_DIR_ENV, LOCK_NAME, WINDOW, EmbeddedStorage, EmbeddedTokenBuckets,
                             LimitStore, StoreError, open_limit_store)
from app.limits import TokenLimiter
from app.token_buckets import MemoryTokenBuckets

PROCESSES = 4
STRATEGIES = ["moving-window", "fixed-window", "sliding-window-counter"]


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path):
    s = LimitStore(str(tmp_path))
    yield s
    s.close()


# -- several processes on one limit ------------------------------------------------------------------

def _hit_requests(directory, strategy, limit, attempts, start, out):
    limiter = limits.strategies.STRATEGIES[strategy](EmbeddedStorage(LimitStore(directory)))
    item = limits.RateLimitItemPerMinute(limit)
    start.wait()
    out.put(sum(limiter.hit(item, "zen", "acme", "requests") for _ in range(attempts)))


def _reserve_tokens(directory, capacity, cost, attempts, start, out):
    buckets = EmbeddedTokenBuckets(LimitStore(directory))
    start.wait()
    out.put(sum(buckets.reserve("acme", cost, capacity, 0.001).admitted for _ in range(attempts)))


def _run_processes(target, args) -> list[int]:
    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, start, out)) for _ in range(PROCESSES)]
    for p in procs:
        p.start()
    start.set()                       # all at once: their transactions contend for the lock
    counts = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return counts


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_processes_on_one_request_limit_admit_exactly_the_limit(tmp_path, strategy):
    limit, attempts = 50, 30                 # 120 attempts in all
    counts = _run_processes(_hit_requests, (str(tmp_path), strategy, limit, attempts))
    assert sum(counts) == limit, counts
    stats = limits.strategies.STRATEGIES[strategy](EmbeddedStorage(LimitStore(str(tmp_path)))) \
        .get_window_stats(limits.RateLimitItemPerMinute(limit), "zen", "acme", "requests")
    assert stats.remaining == 0


def test_processes_on_one_token_bucket_admit_exactly_the_burst(tmp_path):
    counts = _run_processes(_reserve_tokens, (str(tmp_path), 1000, 100, 5))     # 20 reservations of 100
    assert sum(counts) == 10, counts
    left = EmbeddedTokenBuckets(LimitStore(str(tmp_path))).settle("acme", 0, 1000, 0.001)
    assert left.tokens == pytest.approx(0, abs=0.5)


def _reserve_on(buckets, capacity, cost, attempts, start, out):
    start.wait()
    out.put(sum(buckets.reserve("acme", cost, capacity, 0.001).admitted for _ in range(attempts)))


def test_a_store_the_parent_opened_serves_its_forked_children_and_itself(tmp_path):
    """The gunicorn master forks workers: a store opened before the fork opens its own files in each child
    (LMDB's map and the lock's open file are not shared with the parent), and all count in one bucket."""
    buckets = EmbeddedTokenBuckets(LimitStore(str(tmp_path)))
    assert buckets.reserve("acme", 100, 1000, 0.001).admitted          # open, 900 left
    counts = _run_processes(_reserve_on, (buckets, 1000, 100, 5))       # the parent's own object
    assert sum(counts) == 9, counts
    assert not buckets.reserve("acme", 100, 1000, 0.001).admitted      # the children's reservations hold


# -- the same meaning as the library's memory storage ----------------------------------------------

@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategies_count_as_on_memory_storage(store, strategy):
    make = limits.strategies.STRATEGIES[strategy]
    embedded, memory = make(EmbeddedStorage(store)), make(limits.storage.MemoryStorage())
    item = limits.RateLimitItemPerMinute(5)
    for org in ("acme", "globex"):
        for cost in (1, 2, 1, 3, 1, 1, 1):
            assert embedded.hit(item, "zen", org, cost=cost) == memory.hit(item, "zen", org, cost=cost)
            assert (embedded.get_window_stats(item, "zen", org).remaining
                    == memory.get_window_stats(item, "zen", org).remaining)
    assert embedded.test(item, "zen", "acme") is False
    embedded.clear(item, "zen", "acme")
    assert embedded.hit(item, "zen", "acme") and embedded.get_window_stats(item, "zen", "acme").remaining == 4
    assert embedded.storage.check() and embedded.storage.reset() > 0
    assert embedded.get_window_stats(item, "zen", "globex").remaining == 5
    assert not embedded.hit(item, "zen", "globex", cost=6)


def test_moving_window_frees_each_entry_one_window_after_it(tmp_path):
    clock = FakeClock()
    limiter = limits.strategies.MovingWindowRateLimiter(EmbeddedStorage(LimitStore(str(tmp_path), clock)))
    item = limits.RateLimitItemPerMinute(3)
    for at in (0, 10, 20):
        clock.now = 1_000_000.0 + at
        assert limiter.hit(item, "acme")
    assert not limiter.hit(item, "acme")
    reset, remaining = limiter.get_window_stats(item, "acme")
    assert (reset, remaining) == (1_000_000.0 + 60, 0)     # the oldest entry leaves at 60 s
    clock.now = 1_000_000.0 + 60.5                           # the first hit has left the window
    assert limiter.hit(item, "acme") and not limiter.hit(item, "acme")


def test_fixed_window_restarts_after_its_expiry(tmp_path):
    clock = FakeClock()
    storage = EmbeddedStorage(LimitStore(str(tmp_path), clock))
    assert [storage.incr("k", 60) for _ in range(3)] == [1, 2, 3]
    assert storage.get("k") == 3 and storage.get_expiry("k") == clock.now + 60
    clock.now += 60
    assert storage.get("k") == 0 and storage.incr("k", 60) == 1


def test_expired_entries_are_swept(tmp_path):
    clock = FakeClock()
    store = LimitStore(str(tmp_path), clock)
    storage, buckets = EmbeddedStorage(store), EmbeddedTokenBuckets(store)
    storage.acquire_entry("w", 5, 60)
    storage.incr("c", 60)
    buckets.reserve("acme", 10, 100, 10.0)
    clock.now += 3600
    storage.acquire_entry("other", 5, 60)                   # a write past the sweep interval sweeps
    with store.reading() as (txn, _):
        keys = [bytes(key) for key, _ in txn.cursor()]
    assert keys == [WINDOW + b"other"]
    assert storage.get_moving_window("other", 5, 60) == (clock.now, 1)


# -- the token bucket's arithmetic ------------------------------------------------------------------

def test_embedded_bucket_matches_memory_bucket_on_one_sequence(tmp_path):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    clock = FakeClock()
    memory = MemoryTokenBuckets(clock)
    embedded = EmbeddedTokenBuckets(LimitStore(str(tmp_path), clock))
    capacity, rate = 1000, 25.0
    for _ in range(300):
        clock.now += rng.choice([0.0, 0.0, rng.uniform(0, 5), rng.uniform(0, 60)])
        org = rng.choice(["acme", "globex"])
        if rng.random() < 0.6:
            cost = rng.choice([rng.randint(1, 400), capacity + 1])
            a, b = memory.reserve(org, cost, capacity, rate), embedded.reserve(org, cost, capacity, rate)
        else:
            refund = rng.uniform(-300, 300)
            a, b = memory.settle(org, refund, capacity, rate), embedded.settle(org, refund, capacity, rate)
        assert (a.admitted, a.capacity, a.rate) == (b.admitted, b.capacity, b.rate)
        assert b.tokens == pytest.approx(a.tokens, abs=1e-6)
        assert b.retry_after_s == pytest.approx(a.retry_after_s, abs=1e-6)


def test_a_bucket_in_debt_is_kept_until_it_has_refilled(tmp_path):
    """An org that used 2000 tokens more than it reserved takes 300 s to refill a 1000-token bucket: the
    row outlives the 160 s a full bucket's would, so its debt is not forgotten by the sweep."""
    clock = FakeClock()
    memory, embedded = MemoryTokenBuckets(clock), EmbeddedTokenBuckets(LimitStore(str(tmp_path), clock))
    for buckets in (memory, embedded):
        assert buckets.reserve("acme", 1000, 1000, 10.0).admitted
        buckets.settle("acme", -2000, 1000, 10.0)
    clock.now += 200
    embedded.reserve("globex", 1, 1000, 10.0)          # a write past the sweep interval sweeps
    a, b = memory.reserve("acme", 500, 1000, 10.0), embedded.reserve("acme", 500, 1000, 10.0)
    assert not a.admitted and not b.admitted and b.tokens == pytest.approx(a.tokens, abs=1e-6)


# -- where the file lives ---------------------------------------------------------------------------

def test_a_private_store_removes_its_directory_when_closed():
    store = LimitStore()
    EmbeddedTokenBuckets(store).reserve("acme", 1, 10, 1.0)
    assert os.path.isfile(os.path.join(store.directory, DB_NAME))
    store.close()
    assert not os.path.exists(store.directory)


def test_the_store_opens_in_the_directory_the_master_made(tmp_path, monkeypatch):
    monkeypatch.setenv(LIMITS_DIR_ENV, str(tmp_path / "limits"))
    store = open_limit_store()
    EmbeddedTokenBuckets(store).reserve("acme", 1, 10, 1.0)
    store.close()
    assert (tmp_path / "limits" / DB_NAME).is_file()       # not ours to remove


@pytest.mark.parametrize("policy", ["open", "closed"])
def test_a_store_that_fails_follows_the_failure_policy(tmp_path, policy):
    (tmp_path / DB_NAME).mkdir()                          # the database cannot be opened
    store = LimitStore(str(tmp_path))
    limiter = TokenLimiter(LimitsConfig(failure_policy=policy), store=store)
    tier = TierConfig("t", 100, 10.0, 100, ("zen-small",))
    if policy == "open":
        assert limiter.reserve("acme", tier, 10).result.admitted    # per-process memory meanwhile
    else:
        with pytest.raises(APIError) as err:
            limiter.reserve("acme", tier, 10)
        assert err.value.status == 503


def test_a_store_another_process_locks_fails_each_waiting_thread_within_the_wait(tmp_path, monkeypatch):
    """8 threads of one worker meet a store that another process holds locked: each call fails within
    LOCK_WAIT_S of its start, not after the calls queued before it each waited that long."""
    import fcntl
    import threading
    import time

    from app import limit_store
    monkeypatch.setattr(limit_store, "LOCK_WAIT_S", 0.25)
    store = LimitStore(str(tmp_path))
    buckets = EmbeddedTokenBuckets(store)
    buckets.reserve("acme", 1, 100, 1.0)                  # the file exists, this process's files open
    other = os.open(os.path.join(store.directory, LOCK_NAME), os.O_RDWR)   # another process's lock
    fcntl.flock(other, fcntl.LOCK_EX)
    took = []

    def call():
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="locked"):
            buckets.reserve("acme", 1, 100, 1.0)
        took.append(time.monotonic() - t0)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.close(other)
    assert len(took) == 8 and max(took) < 0.25 * 3      # queued one behind another: up to 8 x 0.25 s
    assert buckets.reserve("acme", 1, 100, 1.0).admitted
