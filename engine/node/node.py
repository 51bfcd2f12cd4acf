"""Node: what the node's app serves from (config, registry, metrics, telemetry, admission, state), and
the one path of a generation: model, admission, the model's engine loop."""
from __future__ import annotations

import logging
import threading
import time

from engine.backends import backend_name
from engine.engine import RequestError
from engine.node.admission import Admission, QueueFull
from engine.node.config import NodeConfig
from engine.node.drain import RETRY_AFTER_S, Drain
from engine.node.generation import Generation, model_not_found, queue_full, request_error, tokenize, unavailable
from engine.node.metrics import ModelSnapshot, NodeMetrics, NodeSnapshot
from engine.node.registry import ModelNotFound, ModelRegistry, ModelUnavailable, ResidentModel
from engine.node.telemetry import Telemetry, host_memory_available
from engine.protocol import AcceleratorState, GenerateRequest, MemoryState, ModelState, NodeState, QueueState
from engine.request import EngineRequest

log = logging.getLogger("engine.node")


class Node:
    """Everything the app serves from: config, registry, metrics, telemetry, admission."""

    def __init__(self, config: NodeConfig, telemetry: Telemetry | None = None):
        self.config = config
        # a CPU-backend node reports the host, not a GPU it does not use (nor sizes its budget from one)
        self.telemetry = telemetry or Telemetry(use_nvml=backend_name(config.backend) != "cpu")
        self.admission = Admission(config.max_waiting, config.org_waiting_share)
        self.metrics = NodeMetrics(self.snapshot)
        budget = config.memory_budget_bytes or self._default_budget()
        self.registry = ModelRegistry(config.models, budget, config.engine_config,
                                      on_loaded=self._on_loaded, on_evicted=self._on_evicted)
        self.ready = threading.Event()      # set once the start-up loads have ended
        self.preload_failures: dict[str, str] = {}   # start-up models that failed to load: their errors
        self.loaded_ids: set[str] = set()            # every model loaded since start, evicted or not
        self.drain = Drain()
        self.closing = False
        self.started_at = time.time()

    def _default_budget(self) -> int:
        """Without --memory-budget: 90% of the GPU's memory, or 80% of the memory available now (the host's,
        or its container's where a limit leaves less)."""
        if self.telemetry.is_gpu:
            return int(self.telemetry.sample().memory_total_bytes * 0.9)
        return int(host_memory_available() * 0.8)

    def _on_loaded(self, m: ResidentModel) -> None:
        self.loaded_ids.add(m.id)
        m.loop.step_listeners.append(self.metrics.step_listener(m.id, m.quantization))
        self.metrics.model_loaded(m.id, m.quantization, m.load_time_s)

    def _on_evicted(self, m: ResidentModel) -> None:
        self.metrics.model_evicted(m.id, m.quantization)

    def start(self) -> None:
        """Load the start-up models in the background; /ready answers 503 until they are in."""
        def run():
            try:
                self.preload_failures = self.registry.preload(self.config.preload)
            finally:
                self.ready.set()
                resident = [f"{m.id}:{m.quantization}" for m in self.registry.resident()]
                if self.preload_failures:
                    log.error("node not ready: start-up models failed to load", extra={
                        "event": "node_not_ready", "node_id": self.config.node_id, "models": resident,
                        "failed": sorted(self.preload_failures)})
                else:
                    log.info("node ready", extra={"event": "node_ready", "node_id": self.config.node_id,
                                                  "models": resident})
        threading.Thread(target=run, name="preload", daemon=True).start()

    def close(self) -> None:
        self.closing = True
        self.registry.close()
        self.telemetry.close()

    @property
    def healthy(self) -> bool:
        """Alive: serving, and no engine loop has failed (loading and draining nodes are alive)."""
        return self.liveness() is None

    def liveness(self) -> str | None:
        """Why the node is not alive (None: it is)."""
        if self.closing:
            return "stopping"
        if any(m.loop.failed is not None for m in self.registry.resident()):
            return "unhealthy"
        return None

    def readiness(self) -> str | None:
        """Why the node should take no traffic now (None: it should): not alive, loading, draining."""
        if self.drain.draining:
            return "draining"
        if not self.ready.is_set():
            return "loading"
        if self.failed_startup_models():
            return "preload_failed"
        return self.liveness()

    def failed_startup_models(self) -> list[str]:
        """Start-up models that failed to load and have not loaded since (an eviction after a later load
        that succeeded is no failure: the node would otherwise stay unready, and be sent nothing)."""
        return [model_id for model_id in self.preload_failures if model_id not in self.loaded_ids]

    def drain_gracefully(self) -> None:
        """Stop admitting, let the generations in flight finish within the grace period, end the rest
        (blocking; the caller then lets the process exit)."""
        self.drain.run(self.config.drain_grace_s)

    def submit(self, call: GenerateRequest, received: float, sock) -> Generation:
        """Find the model (loading it if needed), admit the request, and hand it to the model's loop;
        `sock` is the client's socket, watched so that a client that leaves cancels its request.
        The generation counts as in flight for the drain until it closes."""
        if not self.drain.enter():
            raise unavailable("the node is shutting down; send the request to another node", "node_draining",
                              RETRY_AFTER_S)
        try:
            return self._submit(call, received, sock)
        except BaseException:
            self.drain.leave()
            raise

    def _submit(self, call: GenerateRequest, received: float, sock) -> Generation:
        try:
            self.registry.spec(call.model)
        except ModelNotFound as e:
            raise model_not_found(e) from None
        try:   # the queue's place is taken before any cold load: a request waiting for one waits in the queue
            ticket = self.admission.reserve(call.sampling.n, call.latency_class, call.org, call.group)
        except QueueFull as e:
            raise queue_full(e) from None
        handed_over = False
        try:
            try:
                m = self.registry.acquire(call.model, call.quantization, self.config.load_wait_s,
                                          stop=self.drain.started)
            except ModelUnavailable as e:
                raise unavailable(str(e), e.code, e.retry_after) from None
            try:
                ids, text = tokenize(call, m)
                req = EngineRequest(call.request_id, m.id, ids, call.sampling, call.latency_class, call.org,
                                    arrival_time=received, queue_timeout_s=call.queue_timeout_s, prompt_text=text)
                ticket.admitted(m.key, len(ids))
                try:
                    stream = m.loop.submit(req)
                except RequestError as e:
                    raise request_error(e) from None
                except RuntimeError as e:   # the model's loop has failed
                    raise unavailable(str(e), "engine_failure", 5) from None
                gen = Generation(self, m, call, req, stream, ticket, sock)
                handed_over = True   # the Generation releases the model and closes the ticket when it closes
                return gen
            finally:
                if not handed_over:
                    self.registry.release(m)
        finally:
            if not handed_over:   # the queue's place is not kept for a request that did not start
                ticket.close()

    # ---- state
    def snapshot(self) -> NodeSnapshot:
        models = []
        for m in self.registry.resident():
            e = m.engine
            models.append(ModelSnapshot(
                m.id, m.quantization, e.num_running, e.num_waiting, e.pool.usage, e.pool.prefix_query_tokens,
                e.pool.prefix_hit_tokens, m.bytes, m.load_time_s, m.loop.utilization(),
                e.kv.window_saved_blocks * e.kv_block_bytes))
        return NodeSnapshot(models, self.telemetry.sample(), self.registry.memory_budget_bytes,
                            self.admission.waiting, self.config.max_waiting, dict(self.registry.last_load_s))

    def state(self) -> NodeState:
        """σ_g, the body of GET /state (and, in brief, of the state header on every /v1/ answer)."""
        resident = self.registry.resident()
        tel = self.telemetry.sample()
        models, used_blocks, blocks = [], 0, 0
        for m in resident:
            e, loop = m.engine, m.loop
            used_blocks += e.pool.num_blocks - e.pool.num_free_blocks
            blocks += e.pool.num_blocks
            step_s, step_per_seq_s = loop.decode_step.line()
            models.append(ModelState(
                id=m.id, version=m.version, quantization=m.quantization, bytes=m.bytes,
                load_time_s=round(m.load_time_s, 4),
                prefill_tokens_per_s=round(loop.prefill_rate.value, 2),
                decode_tokens_per_s=round(loop.stream_rate.value, 2),
                batch_decode_tokens_per_s=round(loop.decode_rate.value, 2),
                decode_step_s=round(step_s, 6), decode_step_per_seq_s=round(step_per_seq_s, 6),
                running=e.num_running, waiting=loop.num_waiting, admitted=self.admission.by_model.get(m.key, 0),
                kv_cache_usage=round(e.pool.usage, 4), kv_cache_blocks=e.pool.num_blocks,
                utilization=round(loop.utilization(), 4), max_model_len=e.max_model_len,
                formats=e.formats, idle_s=round(time.monotonic() - m.last_used, 1)))
        by_class, tokens_by_class = self.admission.by_class_snapshot()
        return NodeState(
            node_id=self.config.node_id, healthy=self.healthy, ready=self.readiness() is None,
            draining=self.drain.draining, models=tuple(models),
            loading=tuple(self.registry.loading()), available_models=tuple(self.registry.available()),
            utilization=max((x.utilization for x in models), default=0.0),
            queue=QueueState(waiting=sum(x.waiting for x in models), running=sum(x.running for x in models),
                             admitted=self.admission.waiting, max_waiting=self.config.max_waiting,
                             max_running=self.config.max_num_seqs, admitted_by_class=by_class,
                             admitted_tokens_by_class=tokens_by_class),
            temperature_c=tel.temperature_c, power_w=tel.power_w,
            kv_cache_usage=round(used_blocks / blocks, 4) if blocks else 0.0,
            memory=MemoryState(used_bytes=tel.memory_used_bytes, total_bytes=tel.memory_total_bytes,
                               budget_bytes=self.registry.memory_budget_bytes,
                               resident_bytes=sum(m.bytes for m in resident),
                               process_rss_bytes=tel.process_rss_bytes),
            accelerator=AcceleratorState(device=tel.device, utilization=tel.utilization),
            uptime_s=round(time.time() - self.started_at, 1))
