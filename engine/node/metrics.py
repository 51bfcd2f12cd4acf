"""Node metrics for Prometheus, under the `zen_node_` prefix and named as vLLM names its own.

Request histograms and token counters carry the labels model and latency_class, and never an org: a
node's /metrics is open, and per-org figures are the gateway's, behind its metrics token.
Per-step figures (batch size, prefix-cache queries and hits) come from the engine loops' step
listeners. Gauges of the current state (queue, KV cache, resident models, accelerator) are read
when /metrics is scraped, from a snapshot function the node provides, so they are never stale.
Every app has its own CollectorRegistry (not the global default), so tests can build several.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily

PREFIX = "zen_node_"
REQUEST_LABELS = ("model", "latency_class")

# Latency buckets (seconds): vLLM's, extended so each family reaches past 480 s.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 480.0, 960.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class ModelSnapshot:
    """One resident model's live figures, as the node reads them for a scrape."""
    model: str
    quantization: str
    running: int
    waiting: int
    kv_cache_usage: float
    prefix_query_tokens: int
    prefix_hit_tokens: int
    bytes: int
    load_time_s: float
    utilization: float
    kv_window_saved_bytes: int = 0   # local layers' K/V out of the sliding window, not held (Gemma 3)


@dataclass
class NodeSnapshot:
    models: list[ModelSnapshot] = field(default_factory=list)
    accelerator: object = None             # telemetry.TelemetrySample
    memory_budget_bytes: int = 0
    queue_waiting: int = 0
    max_waiting: int = 0
    last_load_s: dict = field(default_factory=dict)   # (model, quantization) -> seconds of its last load


@dataclass
class FinishedSequence:
    """What the node learned about one finished sequence (times are time.monotonic())."""
    model: str
    latency_class: str
    finish_reason: str
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    token_times: list[float]
    finished: float


class NodeMetrics:
    def __init__(self, snapshot: Callable[[], NodeSnapshot] | None = None):
        self.registry = CollectorRegistry()
        self.snapshot = snapshot or NodeSnapshot
        r, p = self.registry, PREFIX

        def hist(name, doc, buckets, labels=REQUEST_LABELS):
            return Histogram(p + name, doc, labels, buckets=buckets, registry=r)

        self.time_to_first_token = hist("time_to_first_token_seconds", "Time from arrival to the first token.",
                                        TTFT_BUCKETS)
        self.inter_token_latency = hist("inter_token_latency_seconds", "Time between consecutive output tokens.",
                                        ITL_BUCKETS)
        self.e2e_request_latency = hist("e2e_request_latency_seconds", "Time from arrival to the last token.",
                                        REQUEST_BUCKETS)
        # parts of the time to first token, with its buckets: a millisecond or a few each on a short prompt
        self.request_queue_time = hist("request_queue_time_seconds", "Time waiting before first scheduled.",
                                       TTFT_BUCKETS)
        self.request_prefill_time = hist("request_prefill_time_seconds",
                                         "Time from first scheduled to the first token.", TTFT_BUCKETS)
        self.request_decode_time = hist("request_decode_time_seconds", "Time from the first to the last token.",
                                        REQUEST_BUCKETS)
        self.iteration_batch_size = hist("iteration_batch_size", "Sequences computed in one engine step.",
                                         BATCH_BUCKETS, labels=("model", "quantization"))
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of requests served.", REQUEST_LABELS,
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", REQUEST_LABELS, registry=r)
        self.request_success = Counter(p + "request_success", "Finished sequences by finish reason.",
                                       REQUEST_LABELS + ("finished_reason",), registry=r)
        self.requests_rejected = Counter(p + "requests_rejected", "Requests refused, by reason: generations "
                                         "refused before running and any endpoint's errors (a wrong node "
                                         "secret: invalid_node_secret).", ("reason",), registry=r)
        self.prefix_cache_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the "
                                            "prefix cache.", ("model", "quantization"), registry=r)
        self.prefix_cache_hits = Counter(p + "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                         ("model", "quantization"), registry=r)
        self.num_preemptions = Counter(p + "num_preemptions", "Sequences preempted (their KV blocks taken back; "
                                       "recomputed later).", ("model", "quantization"), registry=r)
        self.model_loads = Counter(p + "model_loads", "Model loads (start-up and cold loads).",
                                   ("model", "quantization"), registry=r)
        self.model_evictions = Counter(p + "model_evictions", "Models evicted to make room or unloaded.",
                                       ("model", "quantization"), registry=r)
        self.model_load_duration = Histogram(p + "model_load_duration_seconds", "Duration of model loads.",
                                             ("model", "quantization"), buckets=REQUEST_BUCKETS, registry=r)
        ProcessCollector(namespace="zen_node", registry=r)
        r.register(_StateCollector(self))

    # ---- requests
    def observe_finished(self, s: FinishedSequence) -> None:
        labels = (s.model, s.latency_class)
        self.request_success.labels(*labels, s.finish_reason).inc()
        self.e2e_request_latency.labels(*labels).observe(max(0.0, s.finished - s.arrival))
        if s.first_scheduled is not None:
            self.request_queue_time.labels(*labels).observe(max(0.0, s.first_scheduled - s.arrival))
        if s.first_token is not None:
            self.time_to_first_token.labels(*labels).observe(max(0.0, s.first_token - s.arrival))
            if s.first_scheduled is not None:
                self.request_prefill_time.labels(*labels).observe(max(0.0, s.first_token - s.first_scheduled))
            last = s.token_times[-1] if s.token_times else s.first_token
            self.request_decode_time.labels(*labels).observe(max(0.0, last - s.first_token))
            itl = self.inter_token_latency.labels(*labels)
            for a, b in zip(s.token_times, s.token_times[1:]):
                itl.observe(max(0.0, b - a))

    def count_tokens(self, model: str, latency_class: str, prompt: int, generated: int) -> None:
        labels = (model, latency_class)
        if prompt:
            self.prompt_tokens.labels(*labels).inc(prompt)
        if generated:
            self.generation_tokens.labels(*labels).inc(generated)

    def rejected(self, reason: str) -> None:
        self.requests_rejected.labels(reason).inc()

    # ---- models
    def model_loaded(self, model: str, quantization: str, seconds: float) -> None:
        self.model_loads.labels(model, quantization).inc()
        self.model_load_duration.labels(model, quantization).observe(seconds)

    def model_evicted(self, model: str, quantization: str) -> None:
        self.model_evictions.labels(model, quantization).inc()

    def step_listener(self, model: str, quantization: str):
        """A callable for EngineLoop.step_listeners: batch size per step, prefix-cache queries and hits,
        preemptions."""
        batch = self.iteration_batch_size.labels(model, quantization)
        queries = self.prefix_cache_queries.labels(model, quantization)
        hits = self.prefix_cache_hits.labels(model, quantization)
        preemptions = self.num_preemptions.labels(model, quantization)
        seen = [0, 0, 0]   # the engine's cumulative counts at the previous step

        def on_step(engine, step_seconds, deltas) -> None:
            if engine.last_batch_size:
                batch.observe(engine.last_batch_size)
            q, h = engine.pool.prefix_query_tokens, engine.pool.prefix_hit_tokens
            if q > seen[0]:
                queries.inc(q - seen[0])
            if h > seen[1]:
                hits.inc(h - seen[1])
            if engine.num_preemptions > seen[2]:
                preemptions.inc(engine.num_preemptions - seen[2])
            seen[0], seen[1], seen[2] = q, h, engine.num_preemptions

        return on_step

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Gauges read at scrape time from the node's snapshot."""

    def __init__(self, metrics: NodeMetrics):
        self.metrics = metrics

    def describe(self):
        return []   # collected lazily: no snapshot at registration

    def collect(self):
        snap = self.metrics.snapshot()
        p = PREFIX
        ml = ["model", "quantization"]
        running = GaugeMetricFamily(p + "num_requests_running", "Sequences in the running batch.", labels=ml)
        waiting = GaugeMetricFamily(p + "num_requests_waiting", "Sequences waiting in the engine's queue.",
                                    labels=ml)
        kv = GaugeMetricFamily(p + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", labels=ml)
        hit_rate = GaugeMetricFamily(p + "prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens) since "
                                     "the model was loaded.", labels=ml)
        resident_bytes = GaugeMetricFamily(p + "model_resident_bytes", "Weights + KV cache of a resident model.",
                                           labels=ml)
        load_time = GaugeMetricFamily(p + "model_load_time_seconds", "Duration of the model's last load.",
                                      labels=ml)
        util = GaugeMetricFamily(p + "engine_utilization_ratio", "Share of recent time the model's engine "
                                 "loop spent computing steps (0..1).", labels=ml)
        window_saved = GaugeMetricFamily(p + "kv_cache_window_saved_bytes", "KV-cache bytes the running "
                                         "sequences do not hold because their local layers' positions left the "
                                         "sliding window.", labels=ml)
        for m in snap.models:
            key = [m.model, m.quantization]
            running.add_metric(key, m.running)
            waiting.add_metric(key, m.waiting)
            kv.add_metric(key, m.kv_cache_usage)
            hit_rate.add_metric(key, m.prefix_hit_tokens / m.prefix_query_tokens if m.prefix_query_tokens else 0.0)
            resident_bytes.add_metric(key, m.bytes)
            util.add_metric(key, m.utilization)
            window_saved.add_metric(key, m.kv_window_saved_bytes)
        for (model, quant), seconds in sorted(snap.last_load_s.items()):
            load_time.add_metric([model, quant], seconds)
        yield from (running, waiting, kv, hit_rate, resident_bytes, load_time, util, window_saved)
        yield GaugeMetricFamily(p + "models_resident", "Models resident on this node.", value=len(snap.models))
        yield GaugeMetricFamily(p + "memory_budget_bytes", "Memory the resident models may take.",
                                value=snap.memory_budget_bytes)
        yield GaugeMetricFamily(p + "queue_waiting", "Sequences accepted by the node that have not produced a "
                                "token yet (bounded by max_waiting).", value=snap.queue_waiting)
        yield GaugeMetricFamily(p + "queue_max_waiting", "Bound of the node's waiting queue.",
                                value=snap.max_waiting)
        a = snap.accelerator
        if a is None:
            return
        dev = ["device"]
        for name, doc, value in (
                ("accelerator_memory_used_bytes", "Accelerator (or host) memory in use.", a.memory_used_bytes),
                ("accelerator_memory_total_bytes", "Accelerator (or host) memory.", a.memory_total_bytes),
                ("accelerator_utilization_ratio", "Accelerator (or host CPU) busy fraction (0..1).", a.utilization),
                ("accelerator_power_watts", "Accelerator (or CPU package) power draw.", a.power_w),
                ("accelerator_temperature_celsius", "Accelerator (or CPU package) temperature.", a.temperature_c)):
            if value is None:
                continue   # the platform does not expose it: absent, never invented
            g = GaugeMetricFamily(p + name, doc, labels=dev)
            g.add_metric([a.device], float(value))
            yield g
