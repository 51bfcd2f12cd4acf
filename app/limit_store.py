"""The embedded limits store: one LMDB file shared by every worker process of a gateway.

It also holds the router's records of model loads in progress (app/load_records.py), so that every
worker routes on the loads the others started.

With `[limits] storage_url = "embedded://"` (the shipped default) both limits live here: the
requests-per-minute windows (EmbeddedStorage, a `limits` storage, so the configured strategy keeps
its meaning) and the token buckets (EmbeddedTokenBuckets). Every operation, a read too, is one
transaction under an exclusive lock: a `flock` on a lock file beside the database across processes,
a mutex across the threads of one process. A read-modify-write that no other process or thread
interleaves with, so N workers admit what one would. LMDB's own locking is off: the lock is ours so
that a wait for another process has a deadline, past which the call fails (the failure policy).

LMDB rather than SQLite: an operation here is a B-tree lookup and a copy-on-write of a page or two,
with no SQL to run, and the gateway pays it on every request with caches the node's kernels left cold
(docs/limits.md).

The file lives in LIMITS_DIR_ENV, a directory the gunicorn master creates at start (in /dev/shm where
it exists: memory, no disk writes) and every worker inherits; without it (an app built outside
gunicorn, a test) the store makes a private temporary directory and removes it when closed. The
store spans the processes of one host; replicas on several hosts share limits through Redis.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import struct
import tempfile
import threading
import time
import weakref
from array import array
from bisect import bisect_left
from contextlib import contextmanager
from typing import Iterator

import limits.storage
import lmdb
from limits.storage.base import MovingWindowSupport, SlidingWindowCounterSupport, TimestampedSlidingWindow

from app.token_buckets import BucketResult, TokenBuckets, apply_to_bucket, bucket_ttl_s
from engine.memory_dir import memory_dir

LIMITS_DIR_ENV = "ZEN_LIMITS_DIR"
DB_NAME = "limits.mdb"
LOCK_NAME = "limits.lock"
DIR_PREFIX = "zen-gateway-limits-"
LOCK_WAIT_S = 2.0        # past this wait for another process's transaction, the call fails (the failure policy)
SWEEP_S = 10.0           # how often a process deletes expired entries (they are never read: only space)
MAP_SIZE = 1 << 30       # address space each process maps; the file grows with what is written

# Every value starts with the time it expires at (what the sweep reads), then its kind's fields.
_EXPIRES = struct.Struct("<d")
_COUNTER = struct.Struct("<dq")           # expires_at, value
_WINDOW = struct.Struct("<dd")            # expires_at, window length; then the entries' times, oldest first
_BUCKET = struct.Struct("<ddd")           # expires_at, tokens, updated
COUNTER, WINDOW, BUCKET, LOADS = b"c:", b"w:", b"b:", b"l:"   # key prefixes
LIMIT_PREFIXES = (COUNTER, WINDOW, BUCKET)


class StoreError(lmdb.Error):
    """The store could not be opened, or another process held it for longer than LOCK_WAIT_S."""


def new_limits_dir() -> str:
    """A fresh directory for a gateway's store (what the gunicorn master calls at start)."""
    return tempfile.mkdtemp(prefix=DIR_PREFIX, dir=memory_dir())


class _Files:
    """A process's open database and lock file for one directory, shared by its stores there (LMDB
    forbids opening one file twice in a process)."""

    def __init__(self, directory: str) -> None:
        self.lock_fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self.env = lmdb.open(os.path.join(directory, DB_NAME), map_size=MAP_SIZE, subdir=False, lock=False,
                                 sync=False, metasync=False, readahead=False, max_dbs=0)
        except BaseException:
            os.close(self.lock_fd)
            raise
        self.thread_lock = threading.Lock()
        self.users = 0
        self.next_sweep = 0.0

    def close(self) -> None:
        self.env.close()
        os.close(self.lock_fd)


_OPEN: dict[str, _Files] = {}
_OPEN_LOCK = threading.Lock()
# A forked child must not use its parent's files: the lock file's open file is the parent's (a flock
# there would be the parent's lock), and LMDB's map is a copy. The child's stores open their own: the
# parent's database is closed in the child first (LMDB opens a file once per process; with its locking
# off that releases nothing of the parent's), its lock files are kept open and unused.
_INHERITED_LOCK_FDS: list[int] = []


def _after_fork_in_child() -> None:
    global _OPEN_LOCK
    for files in _OPEN.values():
        _INHERITED_LOCK_FDS.append(files.lock_fd)
        files.env.close()
    _OPEN.clear()
    _OPEN_LOCK = threading.Lock()     # another thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


class LimitStore:
    """The LMDB file: opened once per process (a forked child opens its own) and shared by the process's
    threads, `transaction()` for atomic read-modify-writes."""

    def __init__(self, directory: str | None = None, clock=time.time) -> None:
        owned = directory is None
        self.directory = new_limits_dir() if owned else directory
        os.makedirs(self.directory, exist_ok=True)      # an operator's ZEN_LIMITS_DIR need not exist yet
        self.clock = clock
        self._files: _Files | None = None
        self._pid = os.getpid()
        # A private directory goes with the store (also when it is dropped without close()).
        self._finalizer = weakref.finalize(self, _remove_dir, self.directory if owned else None, os.getpid())

    def _open(self) -> _Files:
        files = self._files
        if files is not None and self._pid == os.getpid():
            return files
        with _OPEN_LOCK:
            if self._files is None or self._pid != os.getpid():   # another thread may have opened it
                files = _OPEN.get(self.directory)
                if files is None:
                    try:
                        files = _OPEN[self.directory] = _Files(self.directory)
                    except OSError as exc:      # the lock file: an error of the store, as LMDB's own are
                        raise StoreError(f"the limits store could not be opened: {exc}") from exc
                files.users += 1
                self._files, self._pid = files, os.getpid()
            return self._files

    @contextmanager
    def _locked(self) -> Iterator[_Files]:
        """This process's turn on the file, then the file's across processes: LOCK_WAIT_S in all, the wait
        for other threads included (a store locked by another process fails each caller within it, not
        each after the callers queued before it)."""
        files = self._open()
        deadline = time.monotonic() + LOCK_WAIT_S
        if not files.thread_lock.acquire(timeout=LOCK_WAIT_S):
            raise StoreError("the limits store is locked (this process's other callers held it)")
        try:
            pause = 50e-6
            while True:
                try:
                    fcntl.flock(files.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StoreError("the limits store is locked (another process held it)") from None
                time.sleep(pause)
                pause = min(pause * 2, 2e-3)
            try:
                yield files
            finally:
                fcntl.flock(files.lock_fd, fcntl.LOCK_UN)
        finally:
            files.thread_lock.release()

    @contextmanager
    def transaction(self) -> Iterator[tuple[lmdb.Transaction, float]]:
        """(write transaction, now), committed at the end: no other reader or writer until it ends. `now` is
        read once the lock is held, so times go up in the order the transactions commit."""
        with self._locked() as files:
            with files.env.begin(write=True) as txn:   # aborted on an exception
                now = self.clock()
                yield txn, now
                if now >= files.next_sweep:
                    files.next_sweep = now + SWEEP_S
                    _sweep(txn, now)

    @contextmanager
    def reading(self) -> Iterator[tuple[lmdb.Transaction, float]]:
        """(read transaction, now): a consistent view, under the same lock (LMDB's reader table is off)."""
        with self._locked() as files:
            with files.env.begin(write=False) as txn:
                yield txn, self.clock()

    def clear_all(self) -> int:
        """Forget every limit; how many entries went."""
        with self.transaction() as (txn, _):
            return _delete_where(txn, lambda key, value: key[:2] in LIMIT_PREFIXES)

    def close(self) -> None:
        files, self._files = self._files, None
        if files is not None and self._pid == os.getpid():
            with _OPEN_LOCK:
                files.users -= 1
                if files.users == 0 and _OPEN.get(self.directory) is files:
                    del _OPEN[self.directory]
                    files.close()
        self._finalizer()


def _delete_where(txn: lmdb.Transaction, doomed) -> int:
    keys = [bytes(key) for key, value in txn.cursor() if doomed(key, value)]
    for key in keys:
        txn.delete(key)
    return len(keys)


def _sweep(txn: lmdb.Transaction, now: float) -> None:
    """Delete what expired: a window whose newest entry left it, a counter or bucket past its time, a
    model's load records all past theirs."""
    _delete_where(txn, lambda key, value: _EXPIRES.unpack_from(value)[0] < now)


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
        return lmdb.Error

    # counters (fixed window, sliding window counter)

    @staticmethod
    def _counter(txn: lmdb.Transaction, key: str, now: float) -> tuple[int, float] | None:
        """(value, expires_at) of a counter that has not expired."""
        raw = txn.get(COUNTER + key.encode())
        if raw is None:
            return None
        expires_at, value = _COUNTER.unpack(raw)
        return (value, expires_at) if expires_at > now else None

    @classmethod
    def _add(cls, txn: lmdb.Transaction, key: str, expiry: float, amount: int, now: float) -> int:
        """The counter plus `amount`; a counter that had expired starts again with a new expiry."""
        live = cls._counter(txn, key, now)
        value, expires_at = (live[0] + amount, live[1]) if live else (amount, now + expiry)
        txn.put(COUNTER + key.encode(), _COUNTER.pack(expires_at, value))
        return value

    def incr(self, key: str, expiry: float, amount: int = 1) -> int:
        with self.store.transaction() as (txn, now):
            return self._add(txn, key, expiry, amount, now)

    def get(self, key: str) -> int:
        with self.store.reading() as (txn, now):
            live = self._counter(txn, key, now)
        return live[0] if live else 0

    def get_expiry(self, key: str) -> float:
        with self.store.reading() as (txn, now):
            raw = txn.get(COUNTER + key.encode())
        return _COUNTER.unpack(raw)[0] if raw is not None else now

    # moving window: the times of the admitted units, oldest first, as MemoryStorage keeps them; a hit
    # drops those that left the window, so a window holds at most `limit`

    @staticmethod
    def _window(txn: lmdb.Transaction, key: str, expiry: float, now: float) -> tuple[array, int]:
        """The entries still in the window (within `expiry` of now), and how many have left it."""
        entries = array("d")
        raw = txn.get(WINDOW + key.encode())
        if raw is not None:
            entries.frombytes(raw[_WINDOW.size:])
        left = bisect_left(entries, now - expiry)
        return entries[left:], left

    def acquire_entry(self, key: str, limit: int, expiry: int, amount: int = 1) -> bool:
        if amount > limit:
            return False
        with self.store.transaction() as (txn, now):
            entries, left = self._window(txn, key, expiry, now)
            admitted = len(entries) + amount <= limit
            if admitted:
                entries.extend([now] * amount)
            if entries and (admitted or left):
                txn.put(WINDOW + key.encode(), _WINDOW.pack(entries[-1] + expiry, expiry) + entries.tobytes())
            elif left:
                txn.delete(WINDOW + key.encode())
            return admitted

    def get_moving_window(self, key: str, limit: int, expiry: int) -> tuple[float, int]:
        with self.store.reading() as (txn, now):
            entries, _ = self._window(txn, key, expiry, now)
        return (entries[0], len(entries)) if entries else (now, 0)

    # sliding window counter

    def _sliding_window(self, txn: lmdb.Transaction, key: str, expiry: int,
                        now: float) -> tuple[int, float, int, float]:
        previous_key, current_key = self.sliding_window_keys(key, expiry, now)
        previous, current = ((live or (0, 0.0))[0] for live in (self._counter(txn, previous_key, now),
                                                                  self._counter(txn, current_key, now)))
        previous_ttl = 0.0 if previous == 0 else (1 - (((now - expiry) / expiry) % 1)) * expiry
        current_ttl = (1 - ((now / expiry) % 1)) * expiry + expiry
        return previous, previous_ttl, current, current_ttl

    def acquire_sliding_window_entry(self, key: str, limit: int, expiry: int, amount: int = 1) -> bool:
        if amount > limit:
            return False
        with self.store.transaction() as (txn, now):
            previous, previous_ttl, current, _ = self._sliding_window(txn, key, expiry, now)
            if math.floor(previous * previous_ttl / expiry + current) + amount > limit:
                return False
            # A window's counter lives two windows: it is the previous one during the next.
            self._add(txn, self.sliding_window_keys(key, expiry, now)[1], 2 * expiry, amount, now)
            return True

    def get_sliding_window(self, key: str, expiry: int) -> tuple[int, float, int, float]:
        with self.store.reading() as (txn, now):
            return self._sliding_window(txn, key, expiry, now)

    def clear_sliding_window(self, key: str, expiry: int) -> None:
        for window_key in self.sliding_window_keys(key, expiry, self.store.clock()):
            self.clear(window_key)

    # administration

    def clear(self, key: str) -> None:
        with self.store.transaction() as (txn, _):
            txn.delete(COUNTER + key.encode())
            txn.delete(WINDOW + key.encode())

    def check(self) -> bool:
        with self.store.reading() as (txn, _):
            txn.get(COUNTER)   # the file opens, its lock is taken and its root page reads
        return True

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
        key_bytes = BUCKET + (self._prefix + key).encode()
        with self.store.transaction() as (txn, now):
            raw = txn.get(key_bytes)
            tokens, last = _BUCKET.unpack(raw)[1:] if raw is not None else (float(capacity), now)
            result = apply_to_bucket(tokens, last, now, amount, capacity, rate, reserve)
            txn.put(key_bytes, _BUCKET.pack(now + bucket_ttl_s(result.tokens, capacity, rate), result.tokens, now))
            return result


# -- model loads (app/load_records.py) -------------------------------------------------------------------

def read_loads(txn: lmdb.Transaction, model: str) -> dict[str, list]:
    """A model's load records: node -> [started_at, expected_s, done_at, expires_at]."""
    raw = txn.get(LOADS + model.encode())
    return json.loads(raw[_EXPIRES.size:]) if raw is not None else {}


def write_loads(txn: lmdb.Transaction, model: str, records: dict[str, list]) -> None:
    """The model's records, kept until the last of them expires."""
    if records:
        expires_at = max(r[3] for r in records.values())
        txn.put(LOADS + model.encode(), _EXPIRES.pack(expires_at) + json.dumps(records).encode())
    else:
        txn.delete(LOADS + model.encode())
