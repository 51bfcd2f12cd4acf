"""Nodes that fail requests other nodes then serve, passed over for a while.

A node can answer its state as healthy and still fail every request (a 5xx, or a stream that breaks
before its first token): the gateway hands each request on to the next node, but the failing one, idle,
keeps ranking first, and every request pays its round trip. After THRESHOLD such failures in a row a
node is passed over for BASE_S, twice as long each time it is again (MAX_S at most), as Envoy's outlier
detection and LiteLLM's cooldowns do. Only a failure that another node then served counts: a request
that fails everywhere (a poison request) says nothing of the node, so such requests cannot take every
node out. Each gateway worker keeps its own view, as it keeps its own node states.
"""
from __future__ import annotations

import logging
import threading
from time import monotonic

log = logging.getLogger("zen.gateway")

THRESHOLD = 3
BASE_S = 10.0
MAX_S = 300.0


class NodeFaults:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: dict[str, int] = {}   # failures in a row that another node then served
        self._times: dict[str, int] = {}      # how often a node was passed over since it last served
        self._until: dict[str, float] = {}    # passed over until this monotonic time

    def served(self, node: str, failed: list[str]) -> None:
        """`node` served a request after the nodes of `failed` failed it."""
        if not failed and node not in self._failures and node not in self._times:
            return   # the common case, without the lock
        with self._lock:
            # its pause, if it has one, runs out: a request it took before the pause may serve meanwhile
            self._failures.pop(node, None)
            self._times.pop(node, None)
            for url in failed:
                self._failures[url] = self._failures.get(url, 0) + 1
                if self._failures[url] >= THRESHOLD:
                    self._failures[url] = 0
                    times = self._times[url] = self._times.get(url, 0) + 1
                    pause = min(MAX_S, BASE_S * 2 ** (times - 1))
                    self._until[url] = monotonic() + pause
                    log.warning("node passed over: it failed requests that other nodes served", extra={
                        "event": "node_passed_over", "node": url, "seconds": pause})

    def forget(self, node: str) -> None:
        """Discovery dropped the node (pods come and go): nothing more is kept of it."""
        with self._lock:
            for held in (self._failures, self._times, self._until):
                held.pop(node, None)

    def usable(self, urls: list[str]) -> list[str]:
        """`urls` without the nodes passed over now, in order; all of them if none would be left."""
        if not self._until:
            return urls
        now = monotonic()
        kept = [u for u in urls if self._until.get(u, 0.0) <= now]
        return kept or urls
