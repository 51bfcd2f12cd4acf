"""Admission: the node's bounded waiting queue, and the Ticket each admitted request holds."""
from __future__ import annotations

import threading


class Admission:
    """The node's bounded waiting queue: sequences accepted that have not produced a token yet."""

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self.waiting = 0
        self.by_model: dict[tuple[str, str], int] = {}

    def would_refuse(self, n: int) -> bool:
        return self.waiting > 0 and self.waiting + n > self.max_waiting

    def admit(self, key: tuple[str, str], n: int) -> "Ticket | None":
        """A ticket for n sequences, or None when the queue is full (a request larger than the bound
        is taken only into an empty queue)."""
        with self._lock:
            if self.would_refuse(n):
                return None
            self.waiting += n
            self.by_model[key] = self.by_model.get(key, 0) + n
            return Ticket(self, key, n)

    def _release(self, key: tuple[str, str], n: int) -> None:
        with self._lock:
            self.waiting -= n
            self.by_model[key] -= n
            if not self.by_model[key]:
                del self.by_model[key]


class Ticket:
    """n sequences of one request, counted as waiting until each produces its first delta."""

    def __init__(self, admission: Admission, key, n: int):
        self.admission, self.key, self.pending = admission, key, n

    def started(self) -> None:
        """One sequence produced its first delta: it no longer waits."""
        if self.pending > 0:
            self.pending -= 1
            self.admission._release(self.key, 1)

    def close(self) -> None:
        if self.pending > 0:
            n, self.pending = self.pending, 0
            self.admission._release(self.key, n)

