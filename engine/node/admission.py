"""Admission: the node's bounded waiting queue, and the Ticket each admitted request holds."""
from __future__ import annotations

import threading

from engine.protocol import LatencyClass


class Admission:
    """The node's bounded waiting queue: sequences accepted that have not produced a token yet, also
    counted by latency class with their prompt tokens (what the router's latency estimate reads)."""

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self.waiting = 0
        self.by_model: dict[tuple[str, str], int] = {}
        self.by_class = [0] * len(LatencyClass)
        self.tokens_by_class = [0] * len(LatencyClass)

    def would_refuse(self, n: int) -> bool:
        return self.waiting > 0 and self.waiting + n > self.max_waiting

    def admit(self, key: tuple[str, str], n: int, latency_class: LatencyClass = LatencyClass.STANDARD,
              prompt_tokens: int = 0) -> "Ticket | None":
        """A ticket for n sequences of `prompt_tokens` each, or None when the queue is full (a request
        larger than the bound is taken only into an empty queue)."""
        with self._lock:
            if self.would_refuse(n):
                return None
            self.waiting += n
            self.by_model[key] = self.by_model.get(key, 0) + n
            self.by_class[latency_class] += n
            self.tokens_by_class[latency_class] += n * prompt_tokens
            return Ticket(self, key, n, latency_class, prompt_tokens)

    def by_class_snapshot(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(sequences, prompt tokens) waiting for a first token, per latency class."""
        with self._lock:
            return tuple(self.by_class), tuple(self.tokens_by_class)  # type: ignore[return-value]

    def _release(self, ticket: "Ticket", n: int) -> None:
        with self._lock:
            self.waiting -= n
            self.by_model[ticket.key] -= n
            if not self.by_model[ticket.key]:
                del self.by_model[ticket.key]
            self.by_class[ticket.latency_class] -= n
            self.tokens_by_class[ticket.latency_class] -= n * ticket.prompt_tokens


class Ticket:
    """n sequences of one request, counted as waiting until each produces its first delta."""

    def __init__(self, admission: Admission, key, n: int, latency_class: LatencyClass = LatencyClass.STANDARD,
                 prompt_tokens: int = 0):
        self.admission, self.key, self.pending = admission, key, n
        self.latency_class, self.prompt_tokens = latency_class, prompt_tokens

    def started(self) -> None:
        """One sequence produced its first delta: it no longer waits."""
        if self.pending > 0:
            self.pending -= 1
            self.admission._release(self, 1)

    def close(self) -> None:
        if self.pending > 0:
            n, self.pending = self.pending, 0
            self.admission._release(self, n)

