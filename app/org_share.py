"""One org's share of a gateway worker's threads: its generations in flight in this worker at once.

A generation holds a thread of its worker until its answer is written (a stream: until it ends), and the
threads are every org's: an org that opened as many streams as the workers have threads left none for
the others, however low its requests per minute. Each worker lets one org hold at most
`[server] org_thread_share` of its threads; beyond that the request is a 429 at once. The count is the
worker's own (a thread is a worker's), not the limits store's: nothing to leak when a worker dies.
"""
from __future__ import annotations

import math
import threading
from collections import Counter
from typing import Callable

from app.config import ConfigError, ServerConfig, count_from_env
from app.limits import retry_headers
from engine.protocol import APIError

CONCURRENCY_KEY = "zen.org_share"


def worker_threads(server: ServerConfig) -> int:
    """The threads of this worker: GATEWAY_THREADS as config/gunicorn.conf.py reads it, else the config's
    (a value gunicorn would refuse is the config's: outside gunicorn nothing else reads it)."""
    try:
        return count_from_env("GATEWAY_THREADS", server.threads)
    except ConfigError:
        return server.threads


class OrgThreadShare:
    """In-flight generations per org in this worker, each org's bounded by its share of the threads."""

    def __init__(self, server: ServerConfig) -> None:
        self.threads = worker_threads(server)
        self.most = max(1, math.floor(server.org_thread_share * self.threads))
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def acquire(self, org: str) -> Callable[[], None]:
        """Take a place for one of `org`'s generations (a 429 when it holds its share already); returns
        its release, which may be called more than once."""
        with self._lock:
            if self._held[org] >= self.most:
                raise APIError(429, f"Too many concurrent requests for this organization: at most {self.most} "
                                    "at once on this gateway worker; retry once one has finished",
                               type="requests", code="concurrency_limit_exceeded", headers=retry_headers(1.0))
            self._held[org] += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
                self._held[org] -= 1
                if not self._held[org]:
                    del self._held[org]
        return release

    def held(self, org: str) -> int:
        with self._lock:
            return self._held[org]
