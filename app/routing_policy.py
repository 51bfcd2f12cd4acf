"""How the router orders the usable nodes for a request: `[routing] policy`.

  score              the router's rule (app/router.py): argmin α·L̂ + β·U + γ·1[m ∉ M]·C_load − δ·saved prefill,
                     where the saved prefill is the prompt tokens a node likely has in its prefix cache (this
                     worker's routing history, app/prefix_index.py) over its prefill rate; every routed request
                     is recorded against the node chosen, and where the model is resident L̂ counts the
                     requests this worker sent a node since its state as queued there (a burst spreads out)
  round_robin        the usable nodes in turn (per worker process), nothing else considered: a baseline
  least_outstanding  fewest sequences on the node (running + waiting in its last state, plus what this worker
                     sent it since that state was polled), ties in turn: the common load balancer's baseline

The baselines order the same scored list (so logs and traces show the score of the node chosen) and fail over
the same way; only the order differs.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from app.config import ROUTING_POLICIES as POLICIES
from app.config import RoutingConfig
from app.prefix_index import PrefixIndex, canonical_prompt
from engine.protocol import LatencyClass, NodeState

if TYPE_CHECKING:
    from app.catalog import ResolvedModel
    from app.inference import PromptInput
    from app.router import Score


@dataclass(frozen=True)
class PromptPrefix:
    """A request's prefix-block hashes and the length of the text they were cut from."""
    hashes: list[int]
    chars: int


@dataclass
class SentSince:
    """What this worker sent a node since the state it has of it was fetched: requests and their prompt
    tokens per latency class (realtime, standard, batch)."""
    fetched_at: float
    requests: list[int] = field(default_factory=lambda: [0, 0, 0])
    tokens: list[int] = field(default_factory=lambda: [0, 0, 0])


class RoutingPolicy:
    """One worker process's routing policy and what it remembers: the prefix index, whose turn it is, and the
    requests sent to each node since its state was last polled."""

    def __init__(self, routing: RoutingConfig) -> None:
        if routing.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {routing.policy!r}; one of {', '.join(POLICIES)}")
        self.name = routing.policy
        self.prefix_index = PrefixIndex(routing.prefix_block_chars, routing.prefix_index_blocks)
        self._turn = itertools.count()
        self._sent: dict[str, SentSince] = {}
        self._lock = threading.Lock()

    # -- the prefix term (score) -----------------------------------------------------------------

    def prefix_of(self, model: ResolvedModel, inputs: PromptInput | None) -> PromptPrefix | None:
        """The request's prefix blocks; None where the policy does not use them or there is no prompt."""
        if self.name != "score" or inputs is None:
            return None
        text = canonical_prompt(inputs.prompt, inputs.prompt_token_ids, inputs.messages)
        seed = f"{model.model}\x00{model.quantization}"
        return PromptPrefix(self.prefix_index.hashes(text, seed), len(text))

    def cached_tokens(self, prefix: PromptPrefix | None, prompt_tokens: int) -> dict[str, float]:
        """Per node, the prompt tokens it likely holds in its prefix cache."""
        if prefix is None:
            return {}
        return self.prefix_index.expected_cached_tokens(prefix.hashes, prefix.chars, prompt_tokens)

    def forget(self, url: str) -> None:
        """A node left the pool: it holds nothing, and nothing is outstanding there."""
        self.prefix_index.forget(url)
        with self._lock:
            self._sent.pop(url, None)

    # -- the order -------------------------------------------------------------------------------

    def order(self, ranked: Sequence[Score], states: Mapping[str, NodeState], fetched_at: Mapping[str, float],
              prefix: PromptPrefix | None, latency_class: LatencyClass = LatencyClass.STANDARD,
              prompt_tokens: int = 0, count_sent: bool = True) -> list[Score]:
        """The scored nodes in the order this policy tries them; the first is counted as sent the request
        (unless not count_sent: a call that queues nothing there)."""
        if not ranked:
            return []
        if self.name == "round_robin":
            ordered = self._in_turn(ranked)
        elif self.name == "least_outstanding":
            ordered = self._least_outstanding(ranked, states, fetched_at)
        else:
            ordered = list(ranked)
            if prefix is not None and prefix.hashes:
                self.prefix_index.record(prefix.hashes, ordered[0].url)
        if count_sent:
            self._count_sent(ordered[0].url, fetched_at.get(ordered[0].url, 0.0), latency_class, prompt_tokens)
        return ordered

    def _in_turn(self, ranked: Sequence[Score]) -> list[Score]:
        by_url = sorted(ranked, key=lambda s: s.url)
        start = next(self._turn) % len(by_url)
        return by_url[start:] + by_url[:start]

    def _least_outstanding(self, ranked: Sequence[Score], states: Mapping[str, NodeState],
                           fetched_at: Mapping[str, float]) -> list[Score]:
        turn = self._in_turn(ranked)
        position = {s.url: i for i, s in enumerate(turn)}
        return sorted(turn, key=lambda s: (self.outstanding(s.url, states[s.url], fetched_at.get(s.url, 0.0)),
                                           position[s.url]))

    def _sent_since(self, url: str, fetched_at: float) -> SentSince | None:
        with self._lock:
            sent = self._sent.get(url)
        return sent if sent is not None and sent.fetched_at == fetched_at else None

    def outstanding(self, url: str, state: NodeState, fetched_at: float) -> int:
        """Sequences on the node: its last state's running + waiting, plus those sent it since that state."""
        sent = self._sent_since(url, fetched_at)
        return state.queue.running + state.queue.waiting + (sum(sent.requests) if sent else 0)

    def with_sent(self, url: str, state: NodeState, fetched_at: float) -> NodeState:
        """The node's state with what this worker sent it since that state, as admitted and waiting there."""
        sent = self._sent_since(url, fetched_at)
        if sent is None:
            return state
        q, n = state.queue, sum(sent.requests)
        return replace(state, queue=replace(
            q, waiting=q.waiting + n, admitted=q.admitted + n,
            admitted_by_class=tuple(a + b for a, b in zip(q.admitted_by_class, sent.requests)),
            admitted_tokens_by_class=tuple(a + b for a, b in zip(q.admitted_tokens_by_class, sent.tokens))))

    def _count_sent(self, url: str, fetched_at: float, latency_class: LatencyClass, prompt_tokens: int) -> None:
        with self._lock:
            sent = self._sent.get(url)
            # a state newer than the one this request was ranked on was fetched before the request is sent:
            # the request counts there too (starting a new count for the older state would wipe that one)
            if sent is None or sent.fetched_at < fetched_at:
                sent = self._sent[url] = SentSince(fetched_at)
            sent.requests[int(latency_class)] += 1
            sent.tokens[int(latency_class)] += prompt_tokens
