"""Admission: the node's bounded waiting queue, and the Ticket each admitted request holds."""
from __future__ import annotations

import math
import threading

from engine.protocol import ORG_QUEUE_FULL, LatencyClass


class QueueFull(Exception):
    """No room for a request: in the queue (code queue_full) or in its org's share of it (ORG_QUEUE_FULL)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Admission:
    """The node's bounded waiting queue: sequences accepted that have not produced a token yet, also
    counted by latency class with their prompt tokens (what the router's latency estimate reads), and
    by org, of which none may hold more than `org_share` of the bound."""

    def __init__(self, max_waiting: int, org_share: float = 1.0):
        self.max_waiting = max_waiting
        self.max_per_org = max(1, math.floor(org_share * max_waiting))
        self._lock = threading.Lock()
        self.waiting = 0
        self.by_model: dict[tuple[str, str], int] = {}
        self.by_org: dict[str, int] = {}
        self.by_group: dict[str, int] = {}   # the prompts of one client request (GenerateRequest.group)
        self.by_class = [0] * len(LatencyClass)
        self.tokens_by_class = [0] * len(LatencyClass)

    def _check_locked(self, n: int, org: str, group: str | None) -> None:
        """QueueFull unless n more sequences of org fit: a request larger than a bound is taken only while
        nothing else waits under it (the queue, or the org's share: the other prompts of its own client
        request, its group, do not count there)."""
        if self.waiting > 0 and self.waiting + n > self.max_waiting:
            raise QueueFull("queue_full", "the node's waiting queue is full")
        held = self.by_org.get(org, 0)
        others = held - (self.by_group.get(group, 0) if group is not None else 0)
        if others > 0 and held + n > self.max_per_org:
            raise QueueFull(ORG_QUEUE_FULL, f"this organization has {held} sequences waiting on the node, its "
                                            f"share of the queue is {self.max_per_org}")

    def reserve(self, n: int, latency_class: LatencyClass = LatencyClass.STANDARD, org: str = "",
                group: str | None = None) -> "Ticket":
        """A place in the queue for n sequences, taken before the model is found (a request waiting for a
        cold load waits in the queue too: else a burst of them would hold every thread of the node past
        the queue's bound); QueueFull when they do not fit. Ticket.admitted adds the model and prompt."""
        with self._lock:
            self._check_locked(n, org, group)
            self.waiting += n
            self.by_org[org] = self.by_org.get(org, 0) + n
            if group is not None:
                self.by_group[group] = self.by_group.get(group, 0) + n
            self.by_class[latency_class] += n
            return Ticket(self, n, latency_class, org, group)

    def by_class_snapshot(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(sequences, prompt tokens) waiting for a first token, per latency class."""
        with self._lock:
            return tuple(self.by_class), tuple(self.tokens_by_class)  # type: ignore[return-value]

    def _admitted(self, ticket: "Ticket", key: tuple[str, str], prompt_tokens: int) -> None:
        with self._lock:
            ticket.key, ticket.prompt_tokens = key, prompt_tokens
            self.by_model[ticket.key] = self.by_model.get(ticket.key, 0) + ticket.pending
            self.tokens_by_class[ticket.latency_class] += ticket.pending * ticket.prompt_tokens

    def _release(self, ticket: "Ticket", n: int) -> None:
        with self._lock:
            self.waiting -= n
            for counts, name in ((self.by_model, ticket.key), (self.by_org, ticket.org), (self.by_group, ticket.group)):
                if name is not None:
                    counts[name] -= n
                    if not counts[name]:
                        del counts[name]
            self.by_class[ticket.latency_class] -= n
            self.tokens_by_class[ticket.latency_class] -= n * ticket.prompt_tokens


class Ticket:
    """n sequences of one request, counted as waiting until each produces its first delta; the model and
    prompt are counted once known (admitted)."""

    def __init__(self, admission: Admission, n: int, latency_class: LatencyClass, org: str, group: str | None):
        self.admission, self.pending = admission, n
        self.latency_class, self.org, self.group = latency_class, org, group
        self.key: tuple[str, str] | None = None
        self.prompt_tokens = 0

    def admitted(self, key: tuple[str, str], prompt_tokens: int) -> None:
        """The model it runs on and its prompt's tokens (what the router's estimates read)."""
        assert self.key is None, "admitted once"
        self.admission._admitted(self, key, prompt_tokens)

    def started(self) -> None:
        """One sequence produced its first delta: it no longer waits."""
        if self.pending > 0:
            self.pending -= 1
            self.admission._release(self, 1)

    def close(self) -> None:
        if self.pending > 0:
            n, self.pending = self.pending, 0
            self.admission._release(self, n)

