"""The router: a live view of every engine node, and the choice of node for a request.

Each node's state σ_g = (M_g, U_g, Q_g, T_g), engine/protocol.py's NodeState, is polled from
GET {node}/state in the background (per worker process, started on first use) and expires after a short TTL; a
node whose poll fails, or that refuses a connection, is down until a poll succeeds.
A request r for model m goes to

    g* = argmin_g  α·L̂(r,g) + β·U_g + γ·1[m ∉ M_g]·C_load

where L̂ estimates queue wait + prefill + decode from the node's queue and its measured
rates, and C_load is the model's measured (or configured) cold-load time; less δ times the prefill
seconds the node's prefix cache likely saves the request (app/prefix_index.py). `[routing] policy`
(app/routing_policy.py) swaps this order for a round-robin or least-outstanding baseline. Unhealthy, draining,
not ready (still loading), stale, down, too hot, and nodes that cannot load m at all are skipped; nodes whose queue is full
are tried last. The ranked list is what failover walks (app/node_client.py).
"""
from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import urllib3

from app.catalog import ResolvedModel
from app.config import NodesConfig, RoutingConfig
from app.discovery import NodeDiscovery, Resolver, resolve_addresses, sync_views
from app.inference import PromptInput
from app.routing_policy import RoutingPolicy
from engine.protocol import SECRET_HEADER, NodeState

log = logging.getLogger("zen.gateway")

# What breaks a connection to a node, or a stream from it: urllib3's errors (the state poller),
# http.client's (requests and streams) and the socket's.
TRANSPORT_ERRORS = (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError)


# -- scoring -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Score:
    """One node's score for one request, with its terms (for logs and tests)."""

    url: str
    total: float
    latency_s: float          # L̂(r, g)
    utilization: float        # U_g
    cold_load_s: float        # C_load if m ∉ M_g, else 0
    queue_full: bool
    prefix_saved_s: float = 0.0   # prefill seconds the node's prefix cache likely saves (app/prefix_index.py)


def estimate_latency(state: NodeState, prompt_tokens: int, max_tokens: int,
                     prefill_rate: float, decode_rate: float) -> float:
    """L̂(r,g): queue wait + prefill + decode, in seconds.

    The request's own service time is prefill (prompt / prefill rate) plus decode
    (max_tokens / per-sequence decode rate). Each waiting request ahead of it is assumed
    to need as long, and the running sequences free slots in parallel, so the wait is
    waiting × service / max(1, running).
    """
    service = prompt_tokens / prefill_rate + max_tokens / decode_rate
    wait = state.queue.waiting * service / max(1, state.queue.running)
    return wait + service


def score_node(url: str, state: NodeState, model: ResolvedModel, prompt_tokens: int,
               max_tokens: int, weights: RoutingConfig,
               known_rates: Mapping[tuple[str, str], tuple[float, float]],
               known_load_s: Mapping[tuple[str, str], float], cached_tokens: float = 0.0) -> Score:
    """α·L̂ + β·U + γ·1[m ∉ M]·C_load − δ·(cached_tokens / prefill rate) for one node; a node without the
    model resident holds none of its prefix."""
    resident = state.resident(model.key)
    fallback_prefill, fallback_decode = known_rates.get(
        model.key, (weights.default_prefill_tokens_per_s, weights.default_decode_tokens_per_s))
    prefill = (resident.prefill_tokens_per_s if resident and resident.prefill_tokens_per_s > 0
               else fallback_prefill)
    decode = (resident.decode_tokens_per_s if resident and resident.decode_tokens_per_s > 0
              else fallback_decode)
    latency = estimate_latency(state, prompt_tokens, max_tokens, prefill, decode)
    cold = 0.0 if resident else known_load_s.get(model.key, model.cold_load_s)
    saved = min(cached_tokens, prompt_tokens) / prefill if resident else 0.0
    total = (weights.alpha * latency + weights.beta * state.utilization + weights.gamma * cold
             - weights.prefix_weight * saved)
    return Score(url, total, latency, state.utilization, cold, state.queue.full, saved)


def skip_reason(state: NodeState | None, fresh: bool, down: bool, model: ResolvedModel,
                max_temperature_c: float) -> str | None:
    """Why a node cannot take the request now (None: it can)."""
    if down:
        return "down"
    if state is None or not fresh:
        return "no fresh state"
    if not state.healthy:
        return "unhealthy"
    if state.draining:
        return "draining"
    if not state.ready:
        return "not ready"
    if state.temperature_c is not None and state.temperature_c > max_temperature_c:
        return "too hot"
    if not state.can_load(model.model):
        return "cannot load model"
    return None


def rank_nodes(candidates: Sequence[tuple[str, NodeState]], model: ResolvedModel,
               prompt_tokens: int, max_tokens: int, weights: RoutingConfig,
               known_rates: Mapping[tuple[str, str], tuple[float, float]] | None = None,
               known_load_s: Mapping[tuple[str, str], float] | None = None,
               cached_tokens: Mapping[str, float] | None = None) -> list[Score]:
    """Scores of the usable nodes, best first; full queues after all others."""
    cached_tokens = cached_tokens or {}
    scores = [score_node(url, st, model, prompt_tokens, max_tokens, weights, known_rates or {}, known_load_s or {},
                         cached_tokens=cached_tokens.get(url, 0.0)) for url, st in candidates]
    return sorted(scores, key=lambda s: (s.queue_full, s.total, s.url))


# -- the live view -----------------------------------------------------------------------------

@dataclass
class NodeView:
    """What the gateway knows about one node."""

    url: str
    state: NodeState | None = None
    fetched_at: float = 0.0           # monotonic time of the last good poll
    down: bool = True                 # until the first good poll
    last_error: str | None = None


class NodePool:
    """The configured nodes' states, polled in the background; ranks nodes for a request."""

    def __init__(self, nodes: NodesConfig, routing: RoutingConfig,
                 clock: Callable[[], float] = time.monotonic,
                 resolver: Resolver = resolve_addresses) -> None:
        self.config = nodes
        self.routing = routing
        self._clock = clock
        self._http = urllib3.PoolManager(num_pools=max(4, len(nodes.urls)), maxsize=2, retries=False)
        self.discovery = NodeDiscovery(nodes.urls, nodes.dns_refresh_s, resolver, clock)
        self._views = {url: NodeView(url) for url in self.discovery.known()}
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid: int | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.policy = RoutingPolicy(routing)   # [routing] policy, and the prefix index it learns
        self.on_dropped: list[Callable[[str], None]] = [self.policy.forget]   # called with a node discovery dropped

    # -- polling ---------------------------------------------------------------------------

    def _fetch(self, url: str) -> None:
        timeout = min(self.config.connect_timeout_s, max(0.2, self.config.state_ttl_s / 2))
        try:
            resp = self._http.request("GET", url + "/state", timeout=timeout,
                                      headers={SECRET_HEADER: self.config.secret})
            if resp.status != 200:
                raise ValueError(f"GET /state answered {resp.status}")
            state = NodeState.from_json(json.loads(resp.data))
        except (*TRANSPORT_ERRORS, ValueError) as exc:
            self._set_down(url, f"{exc.__class__.__name__}: {str(exc)[:200]}")
            return
        with self._lock:
            view = self._views.get(url)
            if view is None:          # dropped by discovery while it was polled
                return
            if view.down:
                log.info("node up", extra={"event": "node_up", "node": url,
                                           "node_id": state.node_id})
            view.state, view.fetched_at, view.down, view.last_error = state, self._clock(), False, None

    def _set_down(self, url: str, reason: str) -> None:
        with self._lock:
            view = self._views.get(url)
            if view is None:          # dropped by discovery: nothing to mark
                return
            was_down = view.down
            view.down, view.last_error = True, reason
        if not was_down:
            log.warning("node down", extra={"event": "node_down", "node": url, "reason": reason})

    def _dropped(self, url: str) -> None:
        for hook in self.on_dropped:
            hook(url)

    def mark_down(self, url: str, reason: str) -> None:
        """A request could not reach the node: skip it until a poll succeeds."""
        self._set_down(url, reason)

    def refresh(self) -> None:
        """Poll every node once, concurrently (after asking discovery for the current node set)."""
        if self.discovery.dynamic:
            urls = self.discovery.urls()
            with self._lock:
                sync_views(self._views, urls, NodeView, self._dropped)
        if not self._views:
            return
        if self._executor is None:
            # 16 at most, not one per node: a discovered pool grows; threads start as polls need them
            self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="zen-node-poll")
        list(self._executor.map(self._fetch, list(self._views)))

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.config.poll_interval_s):
            try:
                self.refresh()
            except Exception:  # the poller must survive anything
                log.exception("node poll failed", extra={"event": "poll_error"})

    def start(self) -> None:
        """Start the background poller in this process (again after a fork)."""
        if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
            return
        with self._refresh_lock:
            if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
                return
            self._pid = os.getpid()
            self._executor = None          # an executor inherited across fork has no threads
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll_loop, name="zen-node-poller",
                                            daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._http.clear()

    # -- views -----------------------------------------------------------------------------

    def _fresh(self, view: NodeView, now: float) -> bool:
        return view.state is not None and now - view.fetched_at <= self.config.state_ttl_s

    def snapshot(self) -> list[NodeView]:
        with self._lock:
            return [NodeView(v.url, v.state, v.fetched_at, v.down, v.last_error)
                    for v in self._views.values()]

    def _ensure_fresh(self) -> None:
        """Start polling; poll now if no node has a fresh state (first request, stale)."""
        self.start()
        now = self._clock()
        if any(not v.down and self._fresh(v, now) for v in self.snapshot()):
            return
        with self._refresh_lock:
            now = self._clock()
            if not any(not v.down and self._fresh(v, now) for v in self.snapshot()):
                self.refresh()

    def count_ready(self, refresh: bool = True) -> int:
        """Nodes that take traffic now in this worker's view; with refresh, polled now if none is fresh."""
        if refresh:
            self._ensure_fresh()
        else:
            self.start()
        now = self._clock()
        return sum(1 for v in self.snapshot()
                   if not v.down and self._fresh(v, now) and v.state is not None and v.state.takes_traffic)

    def servable_models(self) -> Callable[[str], bool] | None:
        """Whether some node up now can serve a model id (resident, or listed to load on demand); None
        while no node's state is known (nothing to judge by: the catalog is shown whole). It reads the
        polled view only: listing models starts no polling of its own."""
        states = [v.state for v in self.snapshot() if not v.down and v.state is not None]
        if not states:
            return None
        return lambda model_id: any(s.can_load(model_id) for s in states)

    def learned(self) -> tuple[dict, dict]:
        """Measured (prefill, decode) rates and load times per model, over all nodes."""
        rates: dict[tuple[str, str], list[tuple[float, float]]] = {}
        loads: dict[tuple[str, str], float] = {}
        for view in self.snapshot():
            if view.state is None:
                continue
            for m in view.state.models:
                if m.prefill_tokens_per_s > 0 and m.decode_tokens_per_s > 0:
                    rates.setdefault(m.key, []).append((m.prefill_tokens_per_s, m.decode_tokens_per_s))
                if m.load_time_s is not None and m.load_time_s > 0:
                    loads[m.key] = max(loads.get(m.key, 0.0), m.load_time_s)
        mean_rates = {k: (sum(p for p, _ in v) / len(v), sum(d for _, d in v) / len(v))
                      for k, v in rates.items()}
        return mean_rates, loads

    def rank(self, model: ResolvedModel, prompt_tokens: int, max_tokens: int,
             inputs: PromptInput | None = None) -> list[Score]:
        """Usable nodes for a request, in the order [routing] policy tries them (score: best first)."""
        self._ensure_fresh()
        now = self._clock()
        usable, fetched_at = [], {}
        for view in self.snapshot():
            reason = skip_reason(view.state, self._fresh(view, now), view.down, model,
                                 self.config.max_temperature_c)
            if reason is None:
                usable.append((view.url, view.state))
                fetched_at[view.url] = view.fetched_at
        rates, loads = self.learned()
        prefix = self.policy.prefix_of(model, inputs)
        ranked = rank_nodes(usable, model, prompt_tokens, max_tokens, self.routing, rates, loads,
                            cached_tokens=self.policy.cached_tokens(prefix, prompt_tokens))
        return self.policy.order(ranked, dict(usable), fetched_at, prefix)
