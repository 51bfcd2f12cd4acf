"""The router: a live view of every engine node, and the choice of node for a request.

Each node's state σ_g = (M_g, U_g, Q_g, T_g), engine/protocol.py's NodeState, is polled from
GET {node}/state in the background (per worker process, started on first use) and expires after a
short TTL; a node whose poll fails, or that refuses a connection, is down until a poll succeeds.
Between polls every answer of a node carries its state in brief (a header, and a field of a stream's
last event), which replaces the worker's view of that node (`observe`): as the answer starts where it
settles a load or refuses the request, else at the stream's end.

A request r for model m goes to

    g* = argmin_g  α·L̂(r,g) + β·U_g + γ·C_g(m)

L̂ (app/latency.py) is the prefill of the work admitted ahead of r in its latency class and r's own,
plus r's decode at the node's measured step time for the batch it joins. C_g(m) is 0 when m is
resident on g; what is left of the load when m is loading there (the node reports its loads, and
the gateway's workers record the loads they start: app/load_records.py); else C_load, the model's
measured (or configured) cold-load time. Less δ times the prefill seconds the node's prefix cache
likely saves the request (app/prefix_index.py).

One load, not one per request: when the best node does not hold m, the worker claims the load there
in the records shared by every worker (the limits' store) and replica (Redis). If another worker
recorded a load of m meanwhile, the nodes are ranked again with it, and a node that would start a
second load of m goes after every other while a load in progress serves r no later (its L̂ plus what
is left of the load is not longer than the new one's L̂ + C_load). A node's answer settles the record:
resident there (kept until every worker has polled it), or gone (refused, failed, unreachable).

`[routing] policy` (app/routing_policy.py) swaps this order for a round-robin or least-outstanding
baseline (which claim no loads). Unhealthy, draining, not ready (still loading), stale, down, too hot,
and nodes that cannot load m at all are skipped; nodes whose queue is full are tried last. The ranked
list is what failover walks (app/node_client.py).
"""
from __future__ import annotations

import http.client
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence
from urllib.parse import urlsplit

import urllib3

from app.catalog import ResolvedModel
from app.config import NodesConfig, RoutingConfig
from app.discovery import NodeDiscovery, Resolver, resolve_addresses, sync_views
from app.inference import PromptInput
from app.latency import ServiceRates, estimate_latency, mean_rates, rates_for
from app.load_records import LoadRecord, LoadRecords
from app.routing_policy import RoutingPolicy
from engine.protocol import SECRET_HEADER, LatencyClass, NodeState, json_value

log = logging.getLogger("zen.gateway")

DISCOVERY_WAIT_S = 0.5   # how long a poll waits for a DNS answer before it polls the nodes it knows
POLL_POOLS = 256   # kept connection pools of the state poller: the nodes one worker polls, at most
CLAIM_ROUNDS = 3     # a claim that meets records it had not seen ranks again with them, this often at most

# What breaks a connection to a node, or a stream from it: urllib3's errors (the state poller),
# http.client's (requests and streams) and the socket's.
TRANSPORT_ERRORS = (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError)


def load_record_hold_s(nodes: NodesConfig) -> float:
    """How long a finished load's record is kept: until every worker's view has polled the node since."""
    return max(nodes.state_ttl_s, 2 * nodes.poll_interval_s)


def record_seen_by(record: LoadRecord, slack_s: float) -> float:
    """The wall time by which the record's node must show it (the request on its way had reached it):
    a state of the node received later that shows neither the model nor its load makes it stale."""
    return (record.done_at if record.done_at is not None else record.started_at) + slack_s


# -- scoring -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Score:
    """One node's score for one request, with its terms (for logs and tests)."""

    url: str
    total: float
    latency_s: float          # L̂(r, g)
    utilization: float        # U_g
    cold_load_s: float        # 0 if m ∈ M_g; the load's remaining time if m is loading there; else C_load
    queue_full: bool
    needs_load: bool = False        # m ∉ M_g: the request waits for a load there (in progress or new)
    loading: bool = False           # a load of m is in progress there
    duplicate_load: bool = False    # a new load, while a load elsewhere would serve the request sooner
    prefix_saved_s: float = 0.0     # prefill seconds the node's prefix cache likely saves (app/prefix_index.py)

    @property
    def wait_s(self) -> float:
        """Seconds until the request is served there: L̂ plus what is left of a load."""
        return self.latency_s + self.cold_load_s


def score_node(url: str, state: NodeState, model: ResolvedModel, prompt_tokens: int,
               max_tokens: int, weights: RoutingConfig,
               known_rates: Mapping[tuple[str, str], ServiceRates],
               known_load_s: Mapping[tuple[str, str], float], *,
               latency_class: LatencyClass = LatencyClass.STANDARD,
               load_remaining_s: float | None = None, cached_tokens: float = 0.0) -> Score:
    """α·L̂ + β·U + γ·1[m ∉ M]·C_load − δ·(cached_tokens / prefill rate) for one node; with a load of m in
    progress there (load_remaining_s), its remaining time takes the place of C_load; a node without the
    model resident holds none of its prefix."""
    resident = state.resident(model.key)
    rates = rates_for(resident, model.key, known_rates, weights)
    latency = estimate_latency(state, prompt_tokens, max_tokens, rates, latency_class)
    loading = resident is None and load_remaining_s is not None
    if resident is not None:
        cold = 0.0
    elif loading:
        cold = load_remaining_s
    else:
        cold = known_load_s.get(model.key, model.cold_load_s)
    saved = min(cached_tokens, prompt_tokens) / rates.prefill_tokens_per_s if resident is not None else 0.0
    total = (weights.alpha * latency + weights.beta * state.utilization + weights.gamma * cold
             - weights.prefix_weight * saved)
    return Score(url, total, latency, state.utilization, cold, state.queue.full, resident is None, loading,
                 prefix_saved_s=saved)


def skip_reason(state: NodeState | None, fresh: bool, down: bool, model: ResolvedModel | None,
                max_temperature_c: float) -> str | None:
    """Why a node cannot take the request now (None: it can); model None: a request for any model."""
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
    if model is not None and not state.can_load(model.model):
        return "cannot load model"
    return None


def rank_nodes(candidates: Sequence[tuple[str, NodeState]], model: ResolvedModel,
               prompt_tokens: int, max_tokens: int, weights: RoutingConfig,
               known_rates: Mapping[tuple[str, str], ServiceRates] | None = None,
               known_load_s: Mapping[tuple[str, str], float] | None = None, *,
               latency_class: LatencyClass = LatencyClass.STANDARD,
               loads_in_progress: Mapping[str, float] | None = None,
               cached_tokens: Mapping[str, float] | None = None) -> list[Score]:
    """Scores of the usable nodes, best first: full queues after all others, and after the rest the
    nodes where the request would start a second load of m while a load in progress elsewhere serves
    it no later (loads_in_progress: node -> seconds left of its load of m)."""
    loads = loads_in_progress or {}
    cached = cached_tokens or {}
    scores = [score_node(url, st, model, prompt_tokens, max_tokens, weights, known_rates or {},
                         known_load_s or {}, latency_class=latency_class, load_remaining_s=loads.get(url),
                         cached_tokens=cached.get(url, 0.0))
              for url, st in candidates]
    soonest = min((s.wait_s for s in scores if s.loading), default=None)
    if soonest is not None:
        scores = [replace(s, duplicate_load=True) if s.needs_load and not s.loading and s.wait_s >= soonest
                  else s for s in scores]
    return sorted(scores, key=lambda s: (s.queue_full, s.duplicate_load, s.total, s.url))


# -- the live view -----------------------------------------------------------------------------

@dataclass
class NodeView:
    """What the gateway knows about one node."""

    url: str
    state: NodeState | None = None
    fetched_at: float = 0.0           # monotonic time of the last state (a good poll, or a node's answer)
    down: bool = True                 # until the first good poll
    last_error: str | None = None
    received_at: float = 0.0          # the same moment on the wall clock (load records are in wall time)


class NodePool:
    """The configured nodes' states, polled in the background; ranks nodes for a request."""

    def __init__(self, nodes: NodesConfig, routing: RoutingConfig,
                 clock: Callable[[], float] = time.monotonic,
                 resolver: Resolver = resolve_addresses, records: LoadRecords | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.config = nodes
        self.routing = routing
        self._clock = clock
        self._wall = wall_clock
        # loads this worker started or learned of: the shared store's (the limits' store), else its own
        self.records = records or LoadRecords(None, load_record_hold_s(nodes))
        self._seen: dict[tuple[str, str], dict[str, LoadRecord]] = {}   # the store's records, last seen
        # a pool per node polled, discovered pods too (sized by the config's entries, a dns+ name of six pods
        # dropped a pool at each poll and connected anew)
        self._http = urllib3.PoolManager(num_pools=max(POLL_POOLS, len(nodes.urls)), maxsize=2, retries=False)
        self.discovery = NodeDiscovery(nodes.urls, nodes.dns_refresh_s, resolver, clock)
        self._views = {url: NodeView(url) for url in self.discovery.known()}
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._refreshes = 0   # refreshes _ensure_fresh has run: a caller that waited for one uses it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid: int | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._discovered: threading.Event | None = None
        self.policy = RoutingPolicy(routing)   # [routing] policy, and the prefix index it learns
        self.on_dropped: list[Callable[[str], None]] = [self.policy.forget]   # called with a node discovery dropped

    # -- polling ---------------------------------------------------------------------------

    def _fetch(self, url: str) -> None:
        timeout = min(self.config.connect_timeout_s, max(0.2, self.config.state_ttl_s / 2))
        try:
            name = self.discovery.server_name(url)   # a dns+https node's certificate names the Service
            pool = self._http.connection_from_url(url, pool_kwargs={"server_hostname": name} if name else None)
            resp = pool.request("GET", urlsplit(url).path + "/state", timeout=timeout,
                                headers={SECRET_HEADER: self.config.secret})
            if resp.status != 200:
                raise ValueError(f"GET /state answered {resp.status}")
            state = NodeState.from_json(json_value(resp.data))
        except (*TRANSPORT_ERRORS, ValueError) as exc:   # unreachable, or an answer that is no state
            self._set_down(url, f"{exc.__class__.__name__}: {str(exc)[:200]}")
            return
        except Exception as exc:   # a defect in reading it: said with its traceback, and the node down
            log.exception("node state unreadable", extra={"event": "poll_error", "node": url})
            self._set_down(url, f"{exc.__class__.__name__}: {str(exc)[:200]}")
            return
        with self._lock:
            view = self._views.get(url)
            if view is None:          # dropped by discovery while it was polled
                return
            if view.down:
                log.info("node up", extra={"event": "node_up", "node": url,
                                           "node_id": state.node_id})
            view.state, view.down, view.last_error = state, False, None
            view.fetched_at, view.received_at = self._clock(), self._wall()

    def observe(self, url: str, state: NodeState) -> None:
        """A node's answer carried its state: the next decision uses it at once (a node that answered
        is up)."""
        with self._lock:
            view = self._views.get(url)
            if view is None:
                return
            view.state, view.down, view.last_error = state, False, None
            view.fetched_at, view.received_at = self._clock(), self._wall()

    def state_of(self, url: str) -> NodeState | None:
        """The last state of a node (what a brief from it is read over)."""
        view = self._views.get(url)
        return view.state if view is not None else None

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
        """Poll every node once, concurrently, after asking discovery for the current node set: for
        DISCOVERY_WAIT_S at most once it has answered, so that a slow resolver does not leave every
        node's state stale (the nodes known so far are polled meanwhile)."""
        if self.discovery.due():
            self._discovering().wait(DISCOVERY_WAIT_S if self.discovery.answered else None)
        if not self._views:
            return
        if self._executor is None:
            # 16 at most, not one per node: a discovered pool grows; threads start as polls need them
            self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="zen-node-poll")
        list(self._executor.map(self._fetch, list(self._views)))

    def _discovering(self) -> threading.Event:
        """The lookup in progress, set when it has answered: one at a time, on a daemon thread (one that
        hangs holds up neither the polls nor the worker's exit)."""
        with self._lock:
            if self._discovered is None or self._discovered.is_set():
                self._discovered = threading.Event()
                threading.Thread(target=self._discover, args=(self._discovered,), name="zen-node-discovery",
                                 daemon=True).start()
            return self._discovered

    def _discover(self, done: threading.Event) -> None:
        try:
            urls = self.discovery.urls()
            with self._lock:
                sync_views(self._views, urls, NodeView, self._dropped)
        finally:
            done.set()

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
            return [NodeView(v.url, v.state, v.fetched_at, v.down, v.last_error, v.received_at)
                    for v in self._views.values()]

    def _ensure_fresh(self) -> None:
        """Start polling; poll now if no node has a fresh state (first request, stale)."""
        seen = self._refreshes     # read before any wait (start() too): a refresh finished meanwhile serves us
        self.start()
        now = self._clock()
        if any(not v.down and self._fresh(v, now) for v in self.snapshot()):
            return
        with self._refresh_lock:
            if self._refreshes != seen:
                return
            now = self._clock()
            if not any(not v.down and self._fresh(v, now) for v in self.snapshot()):
                self.refresh()
                self._refreshes += 1

    def count_ready(self, refresh: bool = True) -> int:
        """Nodes that take traffic now in this worker's view; with refresh, polled now if none is fresh."""
        if refresh:
            self._ensure_fresh()
        else:
            self.start()
        now = self._clock()
        # the rule routing skips nodes by (a node too hot takes no request), for any model
        return sum(1 for v in self.snapshot()
                   if skip_reason(v.state, self._fresh(v, now), v.down, None, self.config.max_temperature_c) is None)

    def lists_nowhere(self, model_id: str) -> bool:
        """Whether every node is up with a fresh state and none serves the model (resident or loadable):
        a request for it is for a model not found here, not one to retry (a node down might serve it)."""
        now = self._clock()
        views = self.snapshot()
        return bool(views) and all(not v.down and v.state is not None and self._fresh(v, now)
                                   and not v.state.can_load(model_id) for v in views)

    def servable_models(self) -> Callable[[str], bool] | None:
        """Whether some node up now can serve a model id (resident, or listed to load on demand); None
        while no node's state is known (nothing to judge by: the catalog is shown whole). It reads the
        polled view only: listing models starts no polling of its own."""
        states = [v.state for v in self.snapshot() if not v.down and v.state is not None]
        if not states:
            return None
        return lambda model_id: any(s.can_load(model_id) for s in states)

    def learned(self, views: list[NodeView] | None = None) -> tuple[dict, dict]:
        """Measured service rates (ServiceRates) and load times per model, over all nodes."""
        rates: dict[tuple[str, str], list[ServiceRates]] = {}
        loads: dict[tuple[str, str], float] = {}
        for view in views if views is not None else self.snapshot():
            if view.state is None:
                continue
            for m in view.state.models:
                measured = ServiceRates.measured(m)
                if measured is not None:
                    rates.setdefault(m.key, []).append(measured)
                if m.load_time_s is not None and m.load_time_s > 0:
                    loads[m.key] = max(loads.get(m.key, 0.0), m.load_time_s)
        return {k: mean_rates(v) for k, v in rates.items()}, loads

    def rank(self, model: ResolvedModel, prompt_tokens: int, max_tokens: int,
             latency_class: LatencyClass = LatencyClass.STANDARD, inputs: PromptInput | None = None,
             keep: Callable[[list[str]], list[str]] | None = None, generation: bool = True) -> list[Score]:
        """Usable nodes for a request, in the order [routing] policy tries them (score: best first); `keep`
        filters the usable nodes' URLs first (the ones passed over for their faults); a call that is no
        generation (a tokenizer call) is not counted as one sent to the first node. With
        the score policy, when the best one does not hold the model, the load there is claimed in the
        shared records first: if another worker's load (or a finished one) was recorded meanwhile, the
        nodes are ranked again with it, so that concurrent requests for a model no node holds cause one
        load, not one per request."""
        self._ensure_fresh()
        now = self._clock()
        views = self.snapshot()
        usable, fetched_at = [], {}
        for view in views:
            reason = skip_reason(view.state, self._fresh(view, now), view.down, model,
                                 self.config.max_temperature_c)
            if reason is None:
                usable.append((view.url, view.state))
                fetched_at[view.url] = view.fetched_at
        if keep is not None:
            kept = set(keep([url for url, _ in usable]))
            usable = [(url, state) for url, state in usable if url in kept]
        prefix = self.policy.prefix_of(model, inputs)
        # what this worker sent since a node's state queues there where m is resident (elsewhere the load
        # records decide: requests waiting on one load must not make a second load look sooner)
        queued = [(url, self.policy.with_sent(url, state, fetched_at[url]) if state.resident(model.key) else state)
                  for url, state in usable]
        ranked = self._rank_claiming_loads(model, prompt_tokens, max_tokens, latency_class, views, queued, now,
                                           self.policy.cached_tokens(prefix, prompt_tokens))
        return self.policy.order(ranked, dict(usable), fetched_at, prefix, latency_class, prompt_tokens,
                                 count_sent=generation)

    def _rank_claiming_loads(self, model: ResolvedModel, prompt_tokens: int, max_tokens: int,
                             latency_class: LatencyClass, views: list[NodeView],
                             usable: list[tuple[str, NodeState]], now: float,
                             cached_tokens: Mapping[str, float]) -> list[Score]:
        rates, load_times = self.learned(views)
        expected_s = load_times.get(model.key, model.cold_load_s)
        seen = self._seen_records(model.key)
        claims = self.policy.name == "score"    # the baselines route without regard to loads
        claimed, created = None, set()
        for _ in range(CLAIM_ROUNDS):
            loads = self._loads_in_progress(model.key, views, seen, expected_s, now)
            ranked = rank_nodes(usable, model, prompt_tokens, max_tokens, self.routing, rates, load_times,
                                latency_class=latency_class, loads_in_progress=loads, cached_tokens=cached_tokens)
            if not claims or not ranked or not ranked[0].needs_load or ranked[0].url == claimed:
                break
            best = ranked[0]
            claim = self.records.claim(model.key, best.url, expected_s, frozenset(seen))
            news = {n for n, r in claim.records.items() if seen.get(n) != r and not (claim.created and n == best.url)}
            seen = self._seen[model.key] = dict(claim.records)   # its own: the store's may be live
            if claim.claimed:
                if claim.created:
                    created.add(best.url)
                    log.info("cold load", extra={"event": "cold_load", "node": best.url, "model": model.model,
                                                 "quantization": model.quantization})
                if not news:
                    break
                claimed = best.url     # ranked again with what the claim brought, to order the failover
        for url in created - {ranked[0].url if ranked else None}:
            # ranked again away from a load this call recorded: nobody starts it there
            self.records.drop(model.key, url)
            self._seen[model.key].pop(url, None)
        return ranked

    def _seen_records(self, key: tuple[str, str]) -> dict[str, LoadRecord]:
        hold_s, now = self.records.hold_s, self._wall()
        records = dict(self._seen.get(key, {}))   # a copy first: load_result pops from it on other threads
        return {n: r for n, r in records.items() if r.expires_at(hold_s) >= now}

    def _loads_in_progress(self, key: tuple[str, str], views: list[NodeView], records: dict[str, LoadRecord],
                           expected_s: float, now: float) -> dict[str, float]:
        """Node -> seconds left of its load of the model, from the nodes' states (what each is loading)
        and from the load records (what the gateway's workers sent there). A record that a later state
        of its node contradicts (neither resident nor loading there) is stale: ignored."""
        wall = self._wall()
        out: dict[str, float] = {}
        for view in views:
            st = view.state
            if st is None or st.resident(key) is not None:
                continue
            loading = st.loading_of(key)
            if loading is not None:
                took = loading.expected_s or expected_s
                out[view.url] = max(0.0, took - loading.elapsed_s - (now - view.fetched_at))
            record = records.get(view.url)
            if record is not None and (loading is not None or view.received_at <= record_seen_by(
                    record, self.config.connect_timeout_s)):
                out[view.url] = min(out.get(view.url, math.inf), record.remaining_s(wall))
        return out

    def load_result(self, key: tuple[str, str], url: str, state: NodeState | None, served: bool = False) -> None:
        """The answer of a node this worker sent a request that needed a load: the record becomes
        "resident there" when the node took the request (served) or holds the model now, stays while it
        loads it, and goes when the node does not (a refusal, a failed load) or did not answer (state
        None)."""
        if served or (state is not None and state.resident(key) is not None):
            self.records.finish(key, url)
        elif state is not None and state.loading_of(key) is not None:
            return
        else:
            self.records.drop(key, url)
        self._seen.get(key, {}).pop(url, None)
