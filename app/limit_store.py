"""The embedded limits store: one SQLite file shared by every worker process of a gateway.

It also holds the router's records of model loads in progress (app/load_records.py), so that every
worker routes on the loads the others started.

With `[limits] storage_url = "embedded://"` (the shipped default) both limits live here: the
requests-per-minute windows (EmbeddedStorage, a `limits` storage, so the configured strategy keeps
its meaning) and the token buckets (EmbeddedTokenBuckets). Every change is one `BEGIN IMMEDIATE`
transaction, which holds the database's write lock from its first read to its commit: a
read-modify-write that no other process or thread interleaves with, so N workers admit what one
would. WAL mode keeps reads off that lock.

The file lives in LIMITS_DIR_ENV, a directory the gunicorn master creates at start (in /dev/shm where
it exists: memory, no disk writes) and every worker inherits; without it (an app built outside
gunicorn, a test) the store makes a private temporary directory and removes it when closed. The
store spans the processes of one host; replicas on several hosts share limits through Redis.
"""
from __future__ import annotations

import math
import os
import shutil
import sqlite3
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Iterator

import limits.storage
from limits.storage.base import MovingWindowSupport, SlidingWindowCounterSupport, TimestampedSlidingWindow

from app.token_buckets import BucketResult, TokenBuckets, apply_to_bucket, bucket_ttl_s
from engine.memory_dir import memory_dir

LIMITS_DIR_ENV = "ZEN_LIMITS_DIR"
DB_NAME = "limits.sqlite3"
DIR_PREFIX = "zen-gateway-limits-"
LOCK_WAIT_S = 2.0        # past this wait for another process's transaction, the call fails (the failure policy)
SWEEP_S = 10.0           # how often a process deletes expired rows (they are never read: only memory)

# Small pages: a commit writes each page it changed to the WAL, and an admission changes a few rows.
_SCHEMA = """
PRAGMA page_size = 1024;
CREATE TABLE IF NOT EXISTS counters (
    key TEXT PRIMARY KEY, value INTEGER NOT NULL, expires_at REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS window_entries (
    key TEXT NOT NULL, atime REAL NOT NULL, n INTEGER NOT NULL, PRIMARY KEY (key, atime, n)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS window_totals (
    key TEXT PRIMARY KEY, held INTEGER NOT NULL, newest REAL NOT NULL, expiry REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS buckets (
    key TEXT PRIMARY KEY, tokens REAL NOT NULL, updated REAL NOT NULL, expires_at REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS model_loads (
    model TEXT NOT NULL, node TEXT NOT NULL, started_at REAL NOT NULL, expected_s REAL NOT NULL,
    done_at REAL, expires_at REAL NOT NULL, PRIMARY KEY (model, node)) WITHOUT ROWID;
"""


def new_limits_dir() -> str:
    """A fresh directory for a gateway's store (what the gunicorn master calls at start)."""
    return tempfile.mkdtemp(prefix=DIR_PREFIX, dir=memory_dir())


def _is_lock_error(exc: sqlite3.OperationalError) -> bool:
    return "locked" in str(exc) or "busy" in str(exc)


_STORES: "weakref.WeakSet[LimitStore]" = weakref.WeakSet()
# SQLite's rule: a connection is neither used nor closed in a forked child (closing it there could
# checkpoint or remove the parent's WAL); the child's stores open their own and keep these unused.
_INHERITED_CONNECTIONS: list[sqlite3.Connection] = []


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._forget_parent_connection()


os.register_at_fork(after_in_child=_after_fork_in_child)


class LimitStore:
    """The SQLite file: one connection per process (a forked child opens its own), shared by the
    process's threads under a lock, and `transaction()` for atomic read-modify-writes."""

    def __init__(self, directory: str | None = None, clock=time.time) -> None:
        owned = directory is None
        self.directory = new_limits_dir() if owned else directory
        os.makedirs(self.directory, exist_ok=True)      # an operator's ZEN_LIMITS_DIR need not exist yet
        self.path = os.path.join(self.directory, DB_NAME)
        self.clock = clock
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._next_sweep = 0.0
        # A private directory goes with the store (also when it is dropped without close()).
        self._finalizer = weakref.finalize(self, _remove_dir, self.directory if owned else None, os.getpid())
        _STORES.add(self)

    def _connection(self, deadline: float) -> sqlite3.Connection:
        if self._conn is None:
            # timeout=0: lock waits are retried here at a finer grain than SQLite's busy handler (1 ms first).
            conn = sqlite3.connect(self.path, timeout=0, isolation_level=None, check_same_thread=False)
            self._retry(lambda: conn.executescript(_SCHEMA), deadline)
            self._retry(lambda: conn.execute("PRAGMA journal_mode=WAL"), deadline)
            conn.execute("PRAGMA synchronous=OFF")      # a process crash loses nothing; a power loss, limits
            self._conn = conn
        return self._conn

    def _forget_parent_connection(self) -> None:
        if self._conn is not None:
            _INHERITED_CONNECTIONS.append(self._conn)
        self._conn = None
        self._lock = threading.Lock()          # another thread of the parent may have held it at the fork

    @contextmanager
    def _locked(self) -> Iterator[float]:
        """This process's turn on the connection, and the deadline of the call: LOCK_WAIT_S in all, the wait
        for other threads included (a store locked by another process fails each caller within it, not
        each after the callers queued before it)."""
        deadline = time.monotonic() + LOCK_WAIT_S
        if not self._lock.acquire(timeout=LOCK_WAIT_S):
            raise sqlite3.OperationalError("database is locked (this process's other callers held it)")
        try:
            yield deadline
        finally:
            self._lock.release()

    @staticmethod
    def _retry(op, deadline: float):
        """`op` until it gets past another process's lock, until `deadline` at most."""
        pause = 50e-6
        while True:
            try:
                return op()
            except sqlite3.OperationalError as exc:
                if not _is_lock_error(exc) or time.monotonic() > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    @contextmanager
    def transaction(self) -> Iterator[tuple[sqlite3.Connection, float]]:
        """(connection, now) inside `BEGIN IMMEDIATE ... COMMIT`: no other writer until it ends. `now` is
        read once the lock is held, so times go up in the order the transactions commit."""
        with self._locked() as deadline:
            conn = self._connection(deadline)
            self._retry(lambda: conn.execute("BEGIN IMMEDIATE"), deadline)
            try:
                now = self.clock()
                yield conn, now
                if now >= self._next_sweep:
                    self._sweep(conn, now)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def read(self, sql: str, args: tuple) -> tuple:
        """One row of one query (its own snapshot: WAL readers do not wait for the writer)."""
        with self._locked() as deadline:
            conn = self._connection(deadline)
            return self._retry(lambda: conn.execute(sql, args).fetchone(), deadline)

    def _sweep(self, conn: sqlite3.Connection, now: float) -> None:
        """Delete what expired; a hit deletes its own key's old window entries, so here only those of keys
        no longer hit remain, and their totals go down with them."""
        self._next_sweep = now + SWEEP_S
        conn.execute("DELETE FROM counters WHERE expires_at < ?", (now,))
        conn.execute("DELETE FROM buckets WHERE expires_at < ?", (now,))
        conn.execute("DELETE FROM model_loads WHERE expires_at < ?", (now,))
        idle = "SELECT key FROM window_totals WHERE newest < ?1 - expiry"     # every entry out of its window
        conn.execute(f"DELETE FROM window_entries WHERE key IN ({idle})", (now,))
        conn.execute("DELETE FROM window_totals WHERE newest < ?1 - expiry", (now,))

    def clear_all(self) -> int:
        """Forget every limit; how many rows went."""
        with self.transaction() as (conn, _):
            return sum(conn.execute(f"DELETE FROM {table}").rowcount
                       for table in ("counters", "window_entries", "window_totals", "buckets"))

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
        self._finalizer()


def _remove_dir(directory: str | None, owner_pid: int) -> None:
    if directory is not None and os.getpid() == owner_pid:    # not from a forked child
        shutil.rmtree(directory, ignore_errors=True)


def open_limit_store() -> LimitStore:
    """The gateway's store: in the directory the gunicorn master made, else a private one."""
    return LimitStore(os.environ.get(LIMITS_DIR_ENV) or None)


# -- requests per minute: a `limits` storage --------------------------------------------------------

class EmbeddedStorage(limits.storage.Storage, MovingWindowSupport, SlidingWindowCounterSupport,
                      TimestampedSlidingWindow):
    """`limits`' storage interface over the store, for all three strategies: counters with an expiry
    (fixed window, and the sliding window counter's two windows) and timestamped entries (moving
    window). Each hit is one transaction, so the check and the count are atomic across processes;
    the arithmetic is limits' MemoryStorage's."""

    STORAGE_SCHEME = ["zen-embedded"]   # its own: limits maps URI schemes to storage classes

    def __init__(self, store: LimitStore, wrap_exceptions: bool = True) -> None:
        super().__init__(None, wrap_exceptions=wrap_exceptions)
        self.store = store

    @property
    def base_exceptions(self) -> type[Exception]:
        return sqlite3.Error

    # counters (fixed window, sliding window counter)

    @staticmethod
    def _count(conn: sqlite3.Connection, key: str, now: float) -> int:
        row = conn.execute("SELECT value FROM counters WHERE key = ? AND expires_at > ?", (key, now)).fetchone()
        return row[0] if row else 0

    @staticmethod
    def _add(conn: sqlite3.Connection, key: str, expiry: float, amount: int, now: float) -> int:
        """The counter plus `amount`; a counter that had expired starts again with a new expiry."""
        row = conn.execute("SELECT value, expires_at FROM counters WHERE key = ?", (key,)).fetchone()
        value, expires_at = ((row[0] + amount, row[1]) if row and row[1] > now else (amount, now + expiry))
        conn.execute("INSERT OR REPLACE INTO counters (key, value, expires_at) VALUES (?, ?, ?)",
                     (key, value, expires_at))
        return value

    def incr(self, key: str, expiry: float, amount: int = 1) -> int:
        with self.store.transaction() as (conn, now):
            return self._add(conn, key, expiry, amount, now)

    def get(self, key: str) -> int:
        return self.store.read("SELECT COALESCE(MAX(value), 0) FROM counters WHERE key = ? AND expires_at > ?",
                               (key, self.store.clock()))[0]

    def get_expiry(self, key: str) -> float:
        now = self.store.clock()
        row = self.store.read("SELECT MAX(expires_at) FROM counters WHERE key = ?", (key,))
        return row[0] if row[0] is not None else now

    # moving window: one entry per unit acquired (as in MemoryStorage), and each key's count of them in
    # window_totals, so that a hit costs the same with 3 entries in its window or 3000

    def acquire_entry(self, key: str, limit: int, expiry: int, amount: int = 1) -> bool:
        if amount > limit:
            return False
        with self.store.transaction() as (conn, now):
            left = conn.execute("DELETE FROM window_entries WHERE key = ? AND atime < ?", (key, now - expiry)).rowcount
            row = conn.execute("SELECT held, newest FROM window_totals WHERE key = ?", (key,)).fetchone()
            held, newest = (row[0] - left, row[1]) if row else (0, now)
            admitted = held + amount <= limit
            if admitted:
                # n tells apart entries of one instant: the count before each, which no other entry at that
                # instant had (the count only falls by entries a whole window older).
                conn.executemany("INSERT INTO window_entries (key, atime, n) VALUES (?, ?, ?)",
                                 [(key, now, held + i) for i in range(amount)])
                held, newest = held + amount, now
            if admitted or left:
                conn.execute("INSERT OR REPLACE INTO window_totals (key, held, newest, expiry) VALUES (?, ?, ?, ?)",
                             (key, held, newest, expiry))
            return admitted

    def get_moving_window(self, key: str, limit: int, expiry: int) -> tuple[float, int]:
        now = self.store.clock()
        held, left, oldest = self.store.read(
            "SELECT (SELECT held FROM window_totals WHERE key = ?1),"
            " (SELECT COUNT(*) FROM window_entries WHERE key = ?1 AND atime < ?2),"
            " (SELECT MIN(atime) FROM window_entries WHERE key = ?1 AND atime >= ?2)", (key, now - expiry))
        held = (held or 0) - left
        return (oldest, held) if held > 0 else (now, 0)

    # sliding window counter

    def _sliding_window(self, conn: sqlite3.Connection, key: str, expiry: int,
                        now: float) -> tuple[int, float, int, float]:
        previous_key, current_key = self.sliding_window_keys(key, expiry, now)
        previous, current = self._count(conn, previous_key, now), self._count(conn, current_key, now)
        previous_ttl = 0.0 if previous == 0 else (1 - (((now - expiry) / expiry) % 1)) * expiry
        current_ttl = (1 - ((now / expiry) % 1)) * expiry + expiry
        return previous, previous_ttl, current, current_ttl

    def acquire_sliding_window_entry(self, key: str, limit: int, expiry: int, amount: int = 1) -> bool:
        if amount > limit:
            return False
        with self.store.transaction() as (conn, now):
            previous, previous_ttl, current, _ = self._sliding_window(conn, key, expiry, now)
            if math.floor(previous * previous_ttl / expiry + current) + amount > limit:
                return False
            # A window's counter lives two windows: it is the previous one during the next.
            self._add(conn, self.sliding_window_keys(key, expiry, now)[1], 2 * expiry, amount, now)
            return True

    def get_sliding_window(self, key: str, expiry: int) -> tuple[int, float, int, float]:
        with self.store.transaction() as (conn, now):
            return self._sliding_window(conn, key, expiry, now)

    def clear_sliding_window(self, key: str, expiry: int) -> None:
        for window_key in self.sliding_window_keys(key, expiry, self.store.clock()):
            self.clear(window_key)

    # administration

    def clear(self, key: str) -> None:
        with self.store.transaction() as (conn, _):
            conn.execute("DELETE FROM counters WHERE key = ?", (key,))
            conn.execute("DELETE FROM window_entries WHERE key = ?", (key,))
            conn.execute("DELETE FROM window_totals WHERE key = ?", (key,))

    def check(self) -> bool:
        return self.store.read("SELECT 1", ()) == (1,)

    def reset(self) -> int | None:
        return self.store.clear_all()


# -- the token bucket ----------------------------------------------------------------------------------

class EmbeddedTokenBuckets(TokenBuckets):
    """Token buckets in the store: each operation reads the bucket, applies the shared arithmetic and
    writes it back inside one transaction."""

    def __init__(self, store: LimitStore, prefix: str = "zen:tokens:") -> None:
        self.store = store
        self._prefix = prefix

    def _apply(self, key: str, amount: float, capacity: int, rate: float, reserve: bool) -> BucketResult:
        key = self._prefix + key
        with self.store.transaction() as (conn, now):
            row = conn.execute("SELECT tokens, updated FROM buckets WHERE key = ?", (key,)).fetchone()
            tokens, last = row if row else (float(capacity), now)
            result = apply_to_bucket(tokens, last, now, amount, capacity, rate, reserve)
            conn.execute("INSERT OR REPLACE INTO buckets (key, tokens, updated, expires_at) VALUES (?, ?, ?, ?)",
                         (key, result.tokens, now, now + bucket_ttl_s(result.tokens, capacity, rate)))
            return result
