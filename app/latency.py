"""L̂(r, g): how long request r would take on node g, from what the node reports of its queue and rates.

    L̂ = prefill + wait for a batch slot + decode

- prefill: the prompt tokens the node must compute before r's first token — those of the requests
  admitted ahead of r, then r's own — at the node's measured prefill rate. Ahead of r are only the
  requests of its latency class or a more urgent one: the node's scheduler orders by class, so a
  realtime request overtakes queued standard and batch work (QueueState.ahead_of).
- decode: max_tokens decode steps, each as long as the node's measured step at the batch r would join
  (running + those ahead + r), from the node's fitted line step_s = base + per_seq * batch.
- a batch slot: when that batch is larger than the engine's (max_running), r waits for the surplus to
  drain, about one decode of r's length per max_running sequences ahead.

Rates the node has not measured yet (the model is not resident there, or has served nothing) come from
the other nodes' measurements of the model, else from the configured defaults.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple

from app.config import RoutingConfig
from engine.protocol import LatencyClass, ModelState, NodeState


class ServiceRates(NamedTuple):
    """What the estimate divides by: prefill tokens per second, and the decode step's line in the batch."""

    prefill_tokens_per_s: float
    decode_step_s: float
    decode_step_per_seq_s: float = 0.0

    @classmethod
    def measured(cls, m: ModelState) -> "ServiceRates | None":
        """The model's own rates on a node, None while it has not measured both."""
        if m.prefill_tokens_per_s <= 0:
            return None
        if m.decode_step_s > 0 or m.decode_step_per_seq_s > 0:
            return cls(m.prefill_tokens_per_s, m.decode_step_s, m.decode_step_per_seq_s)
        if m.decode_tokens_per_s > 0:   # a per-stream rate only: the step at the batch it was measured at
            return cls(m.prefill_tokens_per_s, 1.0 / m.decode_tokens_per_s)
        return None

    @classmethod
    def defaults(cls, weights: RoutingConfig) -> "ServiceRates":
        return cls(weights.default_prefill_tokens_per_s, 1.0 / weights.default_decode_tokens_per_s)

    def step_s(self, batch: int) -> float:
        return self.decode_step_s + self.decode_step_per_seq_s * batch


def mean_rates(rates: list[ServiceRates]) -> ServiceRates:
    n = len(rates)
    return ServiceRates(*(sum(r[i] for r in rates) / n for i in range(len(ServiceRates._fields))))


def rates_for(resident: ModelState | None, key: tuple[str, str],
              known_rates: Mapping[tuple[str, str], ServiceRates], weights: RoutingConfig) -> ServiceRates:
    """The node's own measured rates of the model, else the other nodes', else the defaults."""
    own = ServiceRates.measured(resident) if resident is not None else None
    return own or known_rates.get(key) or ServiceRates.defaults(weights)


def estimate_latency(state: NodeState, prompt_tokens: int, max_tokens: int, rates: ServiceRates,
                     latency_class: LatencyClass = LatencyClass.STANDARD) -> float:
    """L̂(r, g) in seconds (the module's docstring has the model)."""
    queue = state.queue
    ahead, ahead_tokens = queue.ahead_of(latency_class)
    prefill_s = (ahead_tokens + prompt_tokens) / rates.prefill_tokens_per_s
    # those ahead that are not running yet join the batch with r (a sequence in its prefill runs)
    batch = queue.running + min(ahead, queue.waiting) + 1
    slot_wait_s = 0.0
    if queue.max_running and batch > queue.max_running:
        surplus = batch - queue.max_running
        batch = queue.max_running
        slot_wait_s = surplus / queue.max_running * max_tokens * rates.step_s(batch)
    return prefill_s + slot_wait_s + max_tokens * rates.step_s(batch)
