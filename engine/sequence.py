"""Sequence: one generated continuation of a request, with its tokens, KV blocks and timestamps."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.protocol import LatencyClass
from engine.request import EngineRequest


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) of the most likely alternatives
    # the text leaves it out: a stop token, one completing a stop string with none of its own text output,
    # or a special token the text skips (skip_special_tokens)
    skipped: bool = False


@dataclass
class SequenceTimes:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None


class Sequence:
    """Tokens it has (prompt + output) versus tokens whose K/V are computed: the scheduler closes the gap.

    The block table is owned here; the blocks themselves belong to the block pool."""

    def __init__(self, seq_id: int, request: EngineRequest, index: int, seed: int):
        self.seq_id = seq_id
        self.request = request
        self.index = index                      # choice index among the request's n sequences
        self.seed = seed
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_cached_prompt_tokens = 0       # prompt tokens the first admission found in the prefix cache
        self.block_table: list[int] = []        # block ids, in order
        # sliding-window models: one table per group of local layers, -1 where a block left the window
        self.window_tables: list[list[int]] = []
        self.block_hashes: list[bytes] = []     # digests of the full blocks of token_ids, in order
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.finish_message: str | None = None
        self.logprobs: list[TokenLogprob] = []
        self.times = SequenceTimes(arrival=request.arrival_time)
        self.num_preemptions = 0
        self.admitted_at: float | None = None   # last admission to the running set (preemption order)
        # time in the queue, which ages a request (its running time does not): before the last admission,
        # and the start of the present wait (arrival, or the last preemption)
        self.queued_s = 0.0
        self.queued_at = request.arrival_time
        self.prefill_leader: "Sequence | None" = None  # n > 1: wait until this one has prefilled
        self.grammar = None                     # engine.grammar.Grammar of a constrained sequence

    # ---- counts
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens to compute before the next sample: 1 while decoding, more while (re)filling a prompt."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def latency_class(self) -> LatencyClass:
        return self.request.latency_class

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefilled(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def append_token(self, token_id: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.token_ids.append(int(token_id))
        if self.times.first_token is None:
            self.times.first_token = now
        self.times.token_times.append(now)

    def finish(self, reason: str, message: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_message = message
        self.times.finished = time.monotonic()
