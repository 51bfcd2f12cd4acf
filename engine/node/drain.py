"""Drain: the node's graceful shutdown. Once it begins the node admits nothing new, the generations in
flight get a grace period to finish, and those still open at its end are ended (NodeShutdown)."""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("engine.node")

END_WAIT_S = 5.0     # after the grace period: how long the ended generations get to answer and close
RETRY_AFTER_S = 2    # what a refused request is told: another node takes it (the gateway fails over)


class NodeShutdown(Exception):
    """The node's grace period ran out while this generation was still running."""


class Drain:
    """Counts the generations in flight; refuses new ones once draining; tells when the grace is over."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self.in_flight = 0
        self.draining = False
        self.deadline: float | None = None   # monotonic end of the grace period, once draining
        self.started = threading.Event()     # set when draining begins: what waits for a model gives up

    def enter(self) -> bool:
        """Count one more generation in flight; False (nothing counted) once draining."""
        with self._cond:
            if self.draining:
                return False
            self.in_flight += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self.in_flight -= 1
            if self.in_flight <= 0:
                self._cond.notify_all()

    def begin(self, grace_s: float) -> bool:
        """Stop admitting; the generations in flight have grace_s to finish. False if already draining."""
        with self._cond:
            if self.draining:
                return False
            self.draining = True
            self.deadline = time.monotonic() + grace_s
            self.started.set()
            return True

    @property
    def expired(self) -> bool:
        """Whether the grace period is over: what is still running is ended."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def wait_idle(self, deadline: float) -> bool:
        """Wait until nothing is in flight or the monotonic deadline passes; whether nothing is."""
        with self._cond:
            return self._cond.wait_for(lambda: self.in_flight <= 0, max(0.0, deadline - time.monotonic()))

    def run(self, grace_s: float) -> None:
        """The whole drain (blocking): begin, wait for the generations in flight within the grace period,
        then give the ones ended at its end a moment to answer their clients and close."""
        self.begin(grace_s)
        log.info("node draining", extra={"event": "node_draining", "in_flight": self.in_flight, "grace_s": grace_s})
        if not self.wait_idle(self.deadline):
            log.warning("grace period over: ending the generations still running",
                        extra={"event": "node_shutdown", "in_flight": self.in_flight})
            self.wait_idle(time.monotonic() + END_WAIT_S)
        log.info("node drained", extra={"event": "node_drained", "in_flight": self.in_flight})
