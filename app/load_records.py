"""The router's records of model loads: which node a gateway worker sent a model to that it did not
hold, so that every worker and every replica routes the next request for it there (one load, not one
per worker).

A record (model, node) says "a load of this model started on this node at started_at and should take
expected_s", or, once a worker saw the node answer with the model resident, "it is there since
done_at". Records live where the limits do: the embedded store shared by a gateway's workers,
Redis shared by every replica, or this process's memory (`memory://`). Each expires: a load in
progress after LOAD_EXPIRY_FACTOR times its expected time plus LOAD_EXPIRY_SLACK_S (a node that died
while loading blocks nothing for long), a finished one after the hold the pool gives (by then every
worker's poll shows the model resident).

`claim` is the one atomic step: it records a load on a node unless the store holds a record the caller
has not seen yet (another worker's load, or a finished one), in which case the caller ranks again
with it. When the shared store fails, the records of this process stand in until it answers.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import lmdb
import redis

from app.limit_store import LimitStore, read_loads, write_loads

log = logging.getLogger("zen.gateway")

LOAD_EXPIRY_FACTOR = 3.0
LOAD_EXPIRY_SLACK_S = 10.0
RETRY_S = 5.0                 # after a failure, the shared store is tried again this much later
ModelKey = tuple[str, str]    # (model id, quantization)


@dataclass(frozen=True)
class LoadRecord:
    """A load of a model on `node` (wall-clock times, shared across processes and hosts)."""

    node: str
    started_at: float
    expected_s: float
    done_at: float | None = None

    def remaining_s(self, now: float) -> float:
        """Seconds until the model should be resident there (0 once it is)."""
        if self.done_at is not None:
            return 0.0
        return max(0.0, self.started_at + self.expected_s - now)

    def expires_at(self, hold_s: float) -> float:
        if self.done_at is not None:
            return self.done_at + hold_s
        return self.started_at + LOAD_EXPIRY_FACTOR * self.expected_s + LOAD_EXPIRY_SLACK_S


@dataclass(frozen=True)
class Claim:
    """claim()'s answer: whether the load on the node is recorded (created: by this claim), and every
    live record of the model."""

    claimed: bool
    records: dict[str, LoadRecord]
    created: bool = False


def claim_in(records: dict[str, LoadRecord], node: str, expected_s: float, known: frozenset[str],
             now: float) -> tuple[Claim, LoadRecord | None]:
    """The claim's rule over a model's live records: (the answer, the record to write or None)."""
    if any(other != node and other not in known for other in records):
        return Claim(False, records), None
    if node in records:
        return Claim(True, records), None
    record = LoadRecord(node, now, expected_s)
    return Claim(True, {**records, node: record}, created=True), record


class LoadRecordStore:
    """Where records live; each operation is atomic where the records are shared."""

    def claim(self, model: ModelKey, node: str, expected_s: float, known: frozenset[str]) -> Claim:
        raise NotImplementedError

    def finish(self, model: ModelKey, node: str) -> None:
        """The model is resident on the node now."""
        raise NotImplementedError

    def drop(self, model: ModelKey, node: str) -> None:
        """No load of the model is going on there (it failed, was refused, or the node is gone)."""
        raise NotImplementedError


def _model_name(model: ModelKey) -> str:
    return json.dumps(list(model), separators=(",", ":"))


class MemoryLoadRecords(LoadRecordStore):
    """This process's records (`memory://`, and the stand-in while the shared store fails)."""

    def __init__(self, hold_s: float, clock: Callable[[], float] = time.time) -> None:
        self.hold_s, self.clock = hold_s, clock
        self._records: dict[ModelKey, dict[str, LoadRecord]] = {}
        self._lock = threading.Lock()

    def _live(self, model: ModelKey, now: float) -> dict[str, LoadRecord]:
        records = {n: r for n, r in self._records.get(model, {}).items() if r.expires_at(self.hold_s) >= now}
        self._records[model] = records
        return records

    def claim(self, model: ModelKey, node: str, expected_s: float, known: frozenset[str]) -> Claim:
        with self._lock:
            now = self.clock()
            answer, new = claim_in(self._live(model, now), node, expected_s, known, now)
            if new is not None:
                self._records[model][node] = new
            return answer

    def finish(self, model: ModelKey, node: str) -> None:
        with self._lock:
            now = self.clock()
            old = self._live(model, now).get(node)
            self._records[model][node] = LoadRecord(node, old.started_at if old else now,
                                                    old.expected_s if old else 0.0, now)

    def drop(self, model: ModelKey, node: str) -> None:
        with self._lock:
            self._records.get(model, {}).pop(node, None)


class EmbeddedLoadRecords(LoadRecordStore):
    """Records in the gateway's embedded store (one entry per model), one transaction per operation."""

    def __init__(self, store: LimitStore, hold_s: float) -> None:
        self.store, self.hold_s = store, hold_s

    def claim(self, model: ModelKey, node: str, expected_s: float, known: frozenset[str]) -> Claim:
        name = _model_name(model)
        with self.store.transaction() as (txn, now):
            stored = {n: r for n, r in read_loads(txn, name).items() if r[3] >= now}
            answer, new = claim_in({n: LoadRecord(n, *r[:3]) for n, r in stored.items()}, node, expected_s,
                                   known, now)
            if new is not None:
                stored[node] = [new.started_at, new.expected_s, None, new.expires_at(self.hold_s)]
                write_loads(txn, name, stored)
            return answer

    def finish(self, model: ModelKey, node: str) -> None:
        name = _model_name(model)
        with self.store.transaction() as (txn, now):
            stored = read_loads(txn, name)
            started, expected = stored[node][:2] if node in stored else (now, 0.0)
            stored[node] = [started, expected, now, now + self.hold_s]
            write_loads(txn, name, stored)

    def drop(self, model: ModelKey, node: str) -> None:
        name = _model_name(model)
        with self.store.transaction() as (txn, _):
            stored = read_loads(txn, name)
            if stored.pop(node, None) is not None:
                write_loads(txn, name, stored)


# claim in Redis: the same rule as claim_in, in Lua (it runs inside Redis, atomic). A model's records
# are one hash, field = node, value = JSON [started_at, expected_s, done_at, expires_at].
# KEYS[1] the hash; ARGV: now, node, expected_s, expires_at of a new record, then the known nodes.
_CLAIM_LUA = """
local now = tonumber(ARGV[1])
local node = ARGV[2]
local known = {}
for i = 5, #ARGV do known[ARGV[i]] = true end
local all = redis.call('HGETALL', KEYS[1])
local live = {}
local unseen = false
local mine = false
for i = 1, #all, 2 do
  local rec = cjson.decode(all[i + 1])
  if tonumber(rec[4]) < now then
    redis.call('HDEL', KEYS[1], all[i])
  else
    table.insert(live, all[i])
    table.insert(live, all[i + 1])
    if all[i] == node then mine = true elseif not known[all[i]] then unseen = true end
  end
end
if unseen then return {0, live, 0} end
if mine then return {1, live, 0} end
local rec = cjson.encode({now, tonumber(ARGV[3]), false, tonumber(ARGV[4])})
redis.call('HSET', KEYS[1], node, rec)
table.insert(live, node)
table.insert(live, rec)
local ttl = math.ceil((tonumber(ARGV[4]) - now) * 1000)
if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
return {1, live, 1}
"""


class RedisLoadRecords(LoadRecordStore):
    """Records in Redis, shared by every replica: a hash per model, claim as one Lua script."""

    PREFIX = "zen:model-loads:"

    def __init__(self, url: str, hold_s: float, timeout_s: float = 0.5,
                 clock: Callable[[], float] = time.time) -> None:
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._claim = self._redis.register_script(_CLAIM_LUA)
        self.hold_s, self.clock = hold_s, clock

    def _key(self, model: ModelKey) -> str:
        return self.PREFIX + _model_name(model)

    def claim(self, model: ModelKey, node: str, expected_s: float, known: frozenset[str]) -> Claim:
        now = self.clock()
        expires = LoadRecord(node, now, expected_s).expires_at(self.hold_s)
        claimed, flat, created = self._claim(keys=[self._key(model)], args=[now, node, expected_s, expires, *known])
        records = {}
        for field, value in zip(flat[::2], flat[1::2]):
            started, expected, done, _ = json.loads(value)
            name = field.decode() if isinstance(field, bytes) else field
            records[name] = LoadRecord(name, started, expected, done if done is not False else None)
        return Claim(bool(claimed), records, bool(created))

    def finish(self, model: ModelKey, node: str) -> None:
        now = self.clock()
        key = self._key(model)
        old = self._redis.hget(key, node)
        started, expected = json.loads(old)[:2] if old else (now, 0.0)
        pipe = self._redis.pipeline()
        pipe.hset(key, node, json.dumps([started, expected, now, now + self.hold_s]))
        ttl = int(self.hold_s) + 1
        pipe.expire(key, ttl, nx=True)    # a key without an expiry gets one; one that lives longer keeps it
        pipe.expire(key, ttl, gt=True)
        pipe.execute()

    def drop(self, model: ModelKey, node: str) -> None:
        self._redis.hdel(self._key(model), node)


STORE_ERRORS = (redis.RedisError, lmdb.Error, OSError)


class LoadRecords:
    """The records the router reads and writes: the shared store, or this process's records while the
    store fails (logged once when it fails, once when it answers again)."""

    def __init__(self, shared: LoadRecordStore | None, hold_s: float) -> None:
        self.hold_s = hold_s
        self.shared = shared
        self.local = MemoryLoadRecords(hold_s)
        self._failed_at: float | None = None

    def _call(self, op: Callable[[LoadRecordStore], object]):
        if self.shared is not None and (self._failed_at is None or time.monotonic() - self._failed_at >= RETRY_S):
            try:
                result = op(self.shared)
            except STORE_ERRORS as exc:
                if self._failed_at is None:
                    log.error("the shared store of model loads failed (%s); routing on this worker's own "
                              "records until it answers", exc.__class__.__name__,
                              extra={"event": "load_records_down"})
                self._failed_at = time.monotonic()
            else:
                if self._failed_at is not None:
                    log.warning("the shared store of model loads answers again",
                                extra={"event": "load_records_recovered"})
                    self._failed_at = None
                return result
        return op(self.local)

    def claim(self, model: ModelKey, node: str, expected_s: float, known: frozenset[str]) -> Claim:
        return self._call(lambda s: s.claim(model, node, expected_s, known))

    def finish(self, model: ModelKey, node: str) -> None:
        self._call(lambda s: s.finish(model, node))

    def drop(self, model: ModelKey, node: str) -> None:
        self._call(lambda s: s.drop(model, node))


def open_load_records(storage_url: str, store: LimitStore | None, hold_s: float,
                      redis_timeout_s: float = 0.5) -> LoadRecords:
    """The records for the limits' storage: Redis when it is Redis, the embedded store when it is that
    (`store`), else this process's alone (memory://)."""
    if storage_url.startswith(("redis://", "rediss://")):
        shared: LoadRecordStore | None = RedisLoadRecords(storage_url, hold_s, redis_timeout_s)
    elif store is not None:
        shared = EmbeddedLoadRecords(store, hold_s)
    else:
        shared = None
    return LoadRecords(shared, hold_s)
