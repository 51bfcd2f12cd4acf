"""Continuous batching: which sequences compute how many tokens in the next engine step.

One loop serves prefill, chunked prefill, prefix hits and decode alike: every sequence has a gap
between the tokens it has and the tokens whose K/V are computed, and a step closes part of each gap
within a token budget. Order is by priority — latency class, then arrival — with an aging guard so
batch work is never starved; within a class, an org with fewer sequences running or queued ahead of
it starts first, so one org's request of many prompts takes turns with other orgs' requests. When blocks run out, the lowest-priority, most recently admitted
sequence is preempted: its blocks go back to the pool and it is recomputed later, never dropped. A
request of a higher class preempts one of a lower class for batch slots or blocks, even one already
scheduled in this step (its tokens go back to the budget).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.protocol import LatencyClass
from engine.sequence import Sequence, SequenceStatus


# Tokens computed in one step (prefill chunks + decodes): every running decode waits for the step, so
# a smaller budget keeps inter-token latency down at no prefill cost (docs/performance.md).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64               # sequences in the running batch
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS   # tokens computed in one step
    starvation_s: float = 5.0            # each this long in the queue lifts a request one latency class
    max_waiting: int = 1024              # bound of the waiting queue (the node answers 503 beyond it)

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:   # else decodes alone fill every step
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({self.max_num_seqs}): a full batch's decodes would use the whole "
                             "step, and no waiting request, however urgent, could start")


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)
    timed_out: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    # ---- queue changes
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str, message: str | None = None) -> None:
        """Leave the queues, give the blocks back (at once: also for aborts in any state)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.finish(reason, message)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- policy
    def priority(self, seq: Sequence, now: float) -> tuple:
        # the lift counts time in the queue only: while a sequence runs it keeps the class it was admitted
        # with, and a preempted one does not count the time it ran
        waited = seq.queued_s + (now - seq.queued_at if seq.status is SequenceStatus.WAITING else 0.0)
        lift = int(waited // self.config.starvation_s) if self.config.starvation_s > 0 else 0
        cls = max(int(LatencyClass.REALTIME), int(seq.latency_class) - lift)
        return (cls, seq.request.arrival_time, seq.seq_id)

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        now = time.monotonic() if now is None else now
        out = SchedulerOutput()
        self._expire_waiting(now, out)
        budget = self.config.max_num_batched_tokens

        # Running sequences: decodes before prefill chunks, each group in priority order, so a long
        # prompt never starves the streams in progress. While requests wait that could start, the
        # prompts already running take at most half the budget together: a short prompt behind long
        # ones starts at the next step, not after their whole prefill.
        self.running.sort(key=lambda s: (s.num_pending_tokens > 1, self.priority(s, now)))
        prefill_room = max(1, budget // 2) if self._others_could_start(now) else budget
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_pending_tokens
            n = min(remaining, budget) if remaining == 1 else min(remaining, budget, prefill_room)
            if n == 0:
                break   # decodes come first, so only prompts are left: they continue next step
            while not self.kv.allocate_slots(seq, n):
                victim = self._victim(seq, now, out, lower_class_only=False)
                if self.running.index(victim) < i:   # scheduled before seq: the list shifts under i
                    i -= 1
                budget += self._preempt(victim, out, now)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, n))
                budget -= n
                if remaining > 1:
                    prefill_room -= n
                i += 1
                continue
            # seq itself was preempted; the list shifted under i

        # Waiting sequences join while budget, batch slots and blocks allow.
        if not out.preempted:
            self.waiting = self._fair_order(now)
            for seq in list(self.waiting):
                if budget <= 0:
                    break
                if self._held_for_leader(seq):
                    continue
                if len(self.running) >= self.config.max_num_seqs:
                    cached, num_cached = self.kv.find_cached_prefix(seq)
                    if not self._room_possible(seq, min(seq.num_tokens - num_cached, budget), cached, now):
                        break   # a slot alone would not admit it: preempt none for nothing
                    freed = self._make_room(seq, now, out)
                    if freed is None:
                        break
                    budget += freed
                cached, num_cached = self.kv.find_cached_prefix(seq)
                n = min(seq.num_tokens - num_cached, budget)
                admitted = self.kv.allocate_slots(seq, n, cached)
                if not admitted and not self._room_possible(seq, n, cached, now):
                    break   # preempting every lower class would not free enough: preempt none for nothing
                while not admitted and (freed := self._make_room(seq, now, out)) is not None:
                    budget += freed
                    n = min(seq.num_tokens - num_cached, budget)
                    admitted = self.kv.allocate_slots(seq, n, cached)
                if not admitted:
                    break
                seq.num_computed_tokens = num_cached
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = SequenceStatus.RUNNING
                seq.admitted_at = now
                seq.queued_s += now - seq.queued_at
                if seq.times.first_scheduled is None:   # a preempted one's own freed blocks are no prefix hit
                    seq.times.first_scheduled = now
                    seq.num_cached_prompt_tokens = num_cached
                    self.kv.pool.record_prefix_query(seq.num_tokens, num_cached)
                out.scheduled.append((seq, n))
                budget -= n

        assert out.num_tokens <= self.config.max_num_batched_tokens
        assert len({s.seq_id for s, _ in out.scheduled}) == len(out.scheduled)
        return out

    # ---- helpers
    def _fair_order(self, now: float) -> list[Sequence]:
        """The waiting sequences in the order they may start: by latency class, then by how many sequences
        of the same org run or come before in the queue (none for a preempted one: a stream already under
        way resumes first), then by priority (arrival)."""
        held = Counter(s.request.org for s in self.running)
        keyed = []
        for pri, seq in sorted(((self.priority(s, now), s) for s in self.waiting), key=lambda k: k[0]):
            org = seq.request.org
            keyed.append(((pri[0], 0 if seq.num_preemptions else held[org]) + pri[1:], seq))
            held[org] += 1
        keyed.sort(key=lambda k: k[0])
        return [seq for _, seq in keyed]

    def _others_could_start(self, now: float) -> bool:
        """Whether a waiting request could start this step beside the running prompts: a batch slot
        is free and one waits that is not held back (an n > 1 sibling waiting for its leader's
        prompt) and ranks at least as high as the best running prompt."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        prompts = [self.priority(s, now)[0] for s in self.running if s.num_pending_tokens > 1]
        if not prompts:
            return False
        best = min(prompts)
        return any(not self._held_for_leader(seq) and self.priority(seq, now)[0] <= best for seq in self.waiting)

    def _held_for_leader(self, seq: Sequence) -> bool:
        """n > 1: a sibling waits until the first sequence's prompt is computed, to share its blocks
        through the prefix cache; without the cache there is nothing to share, so it does not wait."""
        leader = seq.prefill_leader
        return (leader is not None and self.kv.enable_prefix_caching and not leader.is_finished
                and not leader.is_prefilled)

    def _expire_waiting(self, now: float, out: SchedulerOutput) -> None:
        for seq in list(self.waiting):
            timeout = seq.request.queue_timeout_s
            leader = seq.prefill_leader   # n > 1: the request has started once its first sequence has
            started = seq.times.first_scheduled is not None or (leader is not None and
                                                                 leader.times.first_scheduled is not None)
            if timeout is not None and not started and now - seq.request.arrival_time > timeout:
                self.finish(seq, "timeout", f"request waited {now - seq.request.arrival_time:.1f} s in the queue, "
                                            f"past its {timeout:g} s deadline")
                out.timed_out.append(seq)

    def _victim(self, seq: Sequence, now: float, out: SchedulerOutput, lower_class_only: bool) -> Sequence | None:
        """The running sequence to preempt so that seq runs: the lowest-priority, most recently admitted of
        those not scheduled this step and those scheduled of a strictly lower class than seq (a realtime
        request does not wait for batch decodes to finish). lower_class_only: None unless that one is of
        a strictly lower class."""
        cls = self.priority(seq, now)[0]
        scheduled = {s.seq_id for s, _ in out.scheduled}
        candidates = [s for s in self.running
                      if s.seq_id not in scheduled or self.priority(s, now)[0] > cls]
        if not candidates:
            return None
        victim = max(candidates, key=lambda s: (self.priority(s, now)[0], s.admitted_at or 0.0, s.seq_id))
        if lower_class_only and self.priority(victim, now)[0] <= cls:
            return None
        return victim

    def _preempt(self, seq: Sequence, out: SchedulerOutput, now: float) -> int:
        """Back to the queue, its blocks to the pool; the tokens it was scheduled for this step (0 if none),
        which come back to the step's budget."""
        scheduled = [n for s, n in out.scheduled if s is seq]
        out.scheduled = [(s, n) for s, n in out.scheduled if s is not seq]
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        seq.queued_at = now
        self.waiting.append(seq)
        out.preempted.append(seq)
        return sum(scheduled)

    def _room_possible(self, seq: Sequence, n: int, cached: list[int], now: float) -> bool:
        """Whether preempting every running sequence of a strictly lower class than seq (what _make_room
        may take) would free the blocks seq needs for n tokens."""
        cls = self.priority(seq, now)[0]
        victims = [s for s in self.running if self.priority(s, now)[0] > cls]
        return (self.kv.free_blocks_needed(seq, n, cached)
                <= self.kv.pool.num_free_blocks + self.kv.blocks_freed_by(victims))

    def _make_room(self, seq: Sequence, now: float, out: SchedulerOutput) -> int | None:
        """Preempt one running sequence of a strictly lower class than seq: the tokens it gives back to the
        step's budget, or None when there is none."""
        victim = self._victim(seq, now, out, lower_class_only=True)
        return None if victim is None else self._preempt(victim, out, now)
