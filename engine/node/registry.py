"""ModelRegistry: the models a node may serve, and those resident now, within a memory budget.

A resident model is an Engine with its own EngineLoop, under the key (model id, quantization); the
loops of CPU models are stepped by one thread (StepThread says why), a GPU model's by its own. A
request for a model that is not resident starts a cold load in a background thread
(so the other models' loops keep stepping); room is made first by evicting the least recently used
idle models — a model with leases (requests in flight: running, waiting or being answered) is never
evicted. The budget counts each model's weights plus its KV cache: estimated from the file before
the load, exact once it is loaded.

Requests hold a lease from acquire() to release(); all bookkeeping is under one lock, and the slow
parts (loading, stopping a loop) run outside it.
"""
from __future__ import annotations

import gc
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from engine.backends import backend_name
from engine.config import EngineConfig
from engine.engine import Engine
from engine.grammar import guidance_tokenizer
from engine.node.config import ModelSpec
from engine.node.loop import EngineLoop, StepThread
from engine.protocol import LoadingState
from models.inspect import ModelFileInfo, inspect_model, resolve_quantization
from models.loader import load_tokenizer

log = logging.getLogger(__name__)

LOAD_RETRY_S = 30.0   # a load that failed is not tried again (nor are idle models evicted for it) before this

class ModelNotFound(LookupError):
    """The node has no such model (404)."""


class ModelUnavailable(RuntimeError):
    """The model cannot serve now (503): it is loading, or there is no room for it."""

    def __init__(self, message: str, code: str, retry_after: float):
        super().__init__(message)
        self.code = code
        self.retry_after = max(1, int(retry_after + 0.999))


class ModelBusy(RuntimeError):
    """The model has requests in flight and cannot be unloaded now (409)."""


@dataclass
class ResidentModel:
    spec: ModelSpec
    quantization: str            # the label: the requested format, or the file's dominant one
    engine: Engine
    loop: EngineLoop
    version: str
    bytes: int                   # weights + KV cache
    load_time_s: float
    loaded_at: float
    last_used: float
    leases: int = 0

    @property
    def key(self) -> tuple[str, str]:
        return (self.spec.id, self.quantization)

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def idle(self) -> bool:
        """No request holds it; a failed loop's sequences will never finish (their streams got the error)."""
        return self.leases == 0 and (self.loop.failed is not None or
                                     (self.loop.num_streams == 0 and not self.engine.has_unfinished()))


@dataclass
class _LoadJob:
    key: tuple[str, str]
    reserved: int
    started: float
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


def _wait(done: threading.Event, deadline: float, stop: threading.Event | None) -> bool:
    """Whether `done` is set before the monotonic deadline, or before `stop` is (checked every 0.1 s)."""
    while not done.is_set():
        left = deadline - time.monotonic()
        if left <= 0 or (stop is not None and stop.is_set()):
            return False
        done.wait(left if stop is None else min(left, 0.1))
    return True


class ModelRegistry:
    def __init__(self, specs: list[ModelSpec], memory_budget_bytes: int,
                 engine_config: Callable[[ModelSpec, str | None], EngineConfig],
                 on_loaded: Callable[[ResidentModel], None] | None = None,
                 on_evicted: Callable[[ResidentModel], None] | None = None):
        self.specs = {s.id: s for s in specs}
        self.order = [s.id for s in specs]
        self.memory_budget_bytes = memory_budget_bytes
        self.engine_config = engine_config
        self.on_loaded = on_loaded
        self.on_evicted = on_evicted
        self._lock = threading.Lock()
        self._resident: dict[tuple[str, str], ResidentModel] = {}
        self._loading: dict[tuple[str, str], _LoadJob] = {}
        self._info: dict[str, ModelFileInfo] = {}
        self._exact_bytes: dict[tuple[str, str], int] = {}     # measured at an earlier load
        self.last_load_s: dict[tuple[str, str], float] = {}
        self.last_error: dict[str, str] = {}
        self._failed_at: dict[tuple[str, str], float] = {}     # when a load last failed
        self._closed = False
        self._cpu_steps = StepThread("engine-cpu")

    # ---- reading
    def available(self) -> list[str]:
        return list(self.order)

    def spec(self, model_id: str) -> ModelSpec:
        try:
            return self.specs[model_id]
        except KeyError:
            raise ModelNotFound(f"The model {model_id!r} does not exist on this node "
                                f"(available: {', '.join(self.order)})") from None

    def resident(self) -> list[ResidentModel]:
        with self._lock:
            return list(self._resident.values())

    def loading(self) -> list[LoadingState]:
        """The loads in progress: how long each has run, and how long the last load of its model took
        (0: none yet)."""
        now = time.monotonic()
        with self._lock:
            return [LoadingState(key[0], key[1], round(now - job.started, 3), round(self.last_load_s.get(key, 0.0), 3))
                    for key, job in self._loading.items()]

    def info(self, model_id: str) -> ModelFileInfo:
        spec = self.spec(model_id)
        info = self._info.get(model_id)
        if info is None:
            try:
                info = self._info[model_id] = inspect_model(spec.path)
            except (OSError, ValueError) as e:
                self.last_error[model_id] = str(e)
                raise ModelUnavailable(f"The model {model_id!r} cannot be read on this node: {e}",
                                       "model_load_failed", 60) from None
        return info

    def resolve(self, model_id: str, quantization: str | None) -> tuple[str, str | None]:
        """(the label a load with `quantization` is served under, the format its weights convert to)."""
        info = self.info(model_id)
        return resolve_quantization(quantization, info.stored_format, info.loads_dequantized)

    def estimate_bytes(self, model_id: str, quantization: str | None) -> int:
        label, convert_to = self.resolve(model_id, quantization)
        if (model_id, label) in self._exact_bytes:
            return self._exact_bytes[(model_id, label)]
        cfg = self.engine_config(self.spec(model_id), convert_to)
        return self.info(model_id).weight_bytes(convert_to, backend_name(cfg.backend)) + cfg.kv_cache_bytes

    # ---- leases
    def _find_locked(self, model_id: str, quantization: str | None) -> ResidentModel | None:
        """A resident instance (any quantization when None; the most recently used first)."""
        found = [m for m in self._resident.values()
                 if m.id == model_id and (quantization is None or m.quantization == quantization)]
        return max(found, key=lambda m: m.last_used) if found else None

    def acquire(self, model_id: str, quantization: str | None = None, wait_s: float = 0.0,
                stop: threading.Event | None = None) -> ResidentModel:
        """A resident model with one more lease (release() it); loads it if needed, waiting up to wait_s
        (less if `stop` is set meanwhile: the node began to drain, and another node should take the
        request now). ModelNotFound, or ModelUnavailable when it is still loading or cannot fit."""
        self.spec(model_id)
        deadline = time.monotonic() + wait_s
        for _ in range(8):   # a model just loaded can be evicted again before we lease it: retry a few times
            with self._lock:
                if self._closed:
                    raise ModelUnavailable("the node is shutting down", "node_stopping", 5)
                m = self._find_locked(model_id, quantization)
                if m is not None and m.loop.failed is None:
                    m.leases += 1
                    m.last_used = time.monotonic()
                    return m
            if m is not None:   # its engine loop died: drop it and load it again
                self._drop_failed(m)
            job = self._start_load(model_id, quantization)
            if not _wait(job.done, deadline, stop):
                if stop is not None and stop.is_set():
                    raise ModelUnavailable(f"The node began shutting down while {model_id!r} loaded; send the "
                                           "request to another node", "node_draining", 1)
                elapsed = time.monotonic() - job.started
                expected = self.last_load_s.get(job.key, 5.0)
                raise ModelUnavailable(f"The model {model_id!r} is loading on this node; retry shortly",
                                       "model_loading", max(1.0, expected - elapsed))
            if job.error is not None:
                raise ModelUnavailable(f"The model {model_id!r} failed to load on this node: {job.error}",
                                       "model_load_failed", 30)
        raise ModelUnavailable(f"The model {model_id!r} could not be kept resident (memory pressure)",
                               "insufficient_memory", 5)

    def release(self, m: ResidentModel) -> None:
        with self._lock:
            m.leases -= 1
            m.last_used = time.monotonic()

    # ---- loading and eviction
    def load(self, model_id: str, quantization: str | None = None, wait_s: float = 0.0) -> ResidentModel:
        """Make the model resident (for /v1/models/load and the start-up preload): asked for, a model whose
        load failed is tried again at once (an operator who mended its file need not wait out LOAD_RETRY_S)."""
        label, _ = self.resolve(model_id, quantization)
        with self._lock:
            self._failed_at.pop((model_id, label), None)
        m = self.acquire(model_id, quantization, wait_s)
        self.release(m)
        return m

    def _start_load(self, model_id: str, quantization: str | None) -> _LoadJob:
        label, fmt = self.resolve(model_id, quantization)
        key = (model_id, label)
        need = self.estimate_bytes(model_id, quantization)
        evicted = []
        with self._lock:
            job = self._loading.get(key)
            if job is not None:
                return job
            if key in self._resident:   # loaded meanwhile: the caller's next round leases it
                job = _LoadJob(key, 0, time.monotonic())
                job.done.set()
                return job
            since = time.monotonic() - self._failed_at.get(key, -math.inf)
            if since < LOAD_RETRY_S:   # each try would evict idle models for a load that fails again
                raise ModelUnavailable(
                    f"The model {model_id!r} ({label}) failed to load on this node {since:.0f} s ago "
                    f"({self.last_error.get(model_id)}); it is tried again {LOAD_RETRY_S:g} s after that",
                    "model_load_failed", max(1.0, LOAD_RETRY_S - since))
            if need > self.memory_budget_bytes:
                raise ModelUnavailable(
                    f"The model {model_id!r} ({label}) needs about {need} bytes; this node's memory budget "
                    f"is {self.memory_budget_bytes}", "insufficient_memory", 3600)
            evicted = self._make_room_locked(need)
            if evicted is None:
                busy = ", ".join(f"{m.id} ({m.quantization})" for m in self._resident.values()) or "none"
                loading = ", ".join(f"{i} ({q})" for i, q in self._loading) or "none"
                raise ModelUnavailable(
                    f"No room to load {model_id!r} ({label}): the resident models are serving requests "
                    f"({busy}), and loads in progress hold the rest ({loading})", "insufficient_memory", 5)
            job = self._loading[key] = _LoadJob(key, need, time.monotonic())
        for m in evicted:
            self._stop(m, "evicted (least recently used) to load " + f"{model_id} ({label})")
        threading.Thread(target=self._load, args=(job, self.spec(model_id), fmt, label),
                         name=f"load-{model_id}-{label}", daemon=True).start()
        return job

    def _used_locked(self) -> int:
        return sum(m.bytes for m in self._resident.values()) + sum(j.reserved for j in self._loading.values())

    def _make_room_locked(self, need: int, keep: ResidentModel | None = None) -> list[ResidentModel] | None:
        """Take idle models out of the resident set, least recently used first, until `need` more bytes
        fit (the caller stops them); None (nothing taken) if it cannot fit even then."""
        free = self.memory_budget_bytes - self._used_locked()
        if need <= free:
            return []
        idle = sorted((m for m in self._resident.values() if m.idle and m is not keep), key=lambda m: m.last_used)
        chosen = []
        for m in idle:
            if need <= free:
                break
            chosen.append(m)
            free += m.bytes
        if need > free:
            return None
        for m in chosen:
            del self._resident[m.key]
        return chosen

    def _share_cpu_while_loading(self) -> None:
        """Resident models leave a core to loads in progress (a load is ~1 s of CPU work)."""
        with self._lock:
            sharing = bool(self._loading)
            loops = [m.loop for m in self._resident.values()]
        for loop in loops:
            loop.share_cpu(sharing)

    def _load(self, job: _LoadJob, spec: ModelSpec, fmt: str | None, label: str) -> None:
        t0 = time.monotonic()
        self._share_cpu_while_loading()
        try:
            cfg = self.engine_config(spec, fmt)
            log.info("loading model", extra={"event": "model_load_start", "model": spec.id, "quantization": label,
                                             "path": spec.path})
            engine = Engine(cfg)
            loop = EngineLoop(engine, name=f"engine-{spec.id}-{label}",
                              thread=self._cpu_steps if engine.backend.name == "cpu" else None)
            kv_bytes = engine.pool.num_blocks * engine.model.kv_bytes_per_block(cfg.block_size)
            seconds = time.monotonic() - t0
            now = time.monotonic()
            m = ResidentModel(spec, label, engine, loop, self.info(spec.id).version,
                              int(engine.weight_bytes + kv_bytes), seconds, now, now)
            if self.on_loaded is not None:
                self.on_loaded(m)
            with self._lock:
                closed = self._closed
                if not closed:
                    self._resident[job.key] = m
                    self._exact_bytes[job.key] = m.bytes
                    self.last_load_s[job.key] = seconds
                    self.last_error.pop(spec.id, None)
                    self._failed_at.pop(job.key, None)
                self._loading.pop(job.key, None)
                extra = []
                if self._used_locked() > self.memory_budget_bytes:   # larger than estimated
                    extra = self._make_room_locked(0, keep=m) or []
            if closed:
                loop.stop()
                return
            # What is alive now lives until an eviction: kept out of full GC passes, which stall every stream.
            gc.freeze()
            log.info("model loaded", extra={"event": "model_loaded", "model": spec.id, "quantization": label,
                                            "load_time_s": round(seconds, 3), "bytes": m.bytes})
            for e in extra:
                self._stop(e, "evicted: the loaded model is larger than estimated")
        except BaseException as e:   # noqa: BLE001 — a load failure is reported to every waiter
            log.exception("model load failed", extra={"event": "model_load_failed", "model": spec.id})
            job.error = str(e)   # not e: its traceback holds this frame, which holds job: a cycle keeping the load alive
            with self._lock:
                self._loading.pop(job.key, None)
                self.last_error[spec.id] = str(e)
                self._failed_at[job.key] = time.monotonic()
        finally:
            job.done.set()
            self._share_cpu_while_loading()

    def preload(self, model_ids: list[str] | None, wait_s: float = 3600.0) -> dict[str, str]:
        """Start-up: load the named models (all of them must fit), or by default the listed models in
        order while each fits without evicting another. Returns the ones that failed, with their errors
        (one that does not fit beside the others is skipped, not failed)."""
        failed: dict[str, str] = {}
        for spec in self.specs.values():
            # Built once here: building one holds the GIL, which a later cold load must not do beside streams.
            try:
                guidance_tokenizer(load_tokenizer(spec.path))
            except Exception:  # an unloadable model reports its error when it is loaded
                pass
        for model_id in (model_ids if model_ids is not None else self.order):
            try:
                if model_ids is None:
                    need = self.estimate_bytes(model_id, None)
                    with self._lock:
                        fits = need <= self.memory_budget_bytes - self._used_locked()
                    if not fits:
                        log.info("not preloading: it does not fit beside the models loaded before it",
                                 extra={"event": "preload_skipped", "model": model_id, "bytes": need})
                        continue
                self.load(model_id, None, wait_s)
            except Exception as e:   # noqa: BLE001 — one model's failure (any: a file the estimate cannot read) leaves the others to load
                log.error("start-up load failed", extra={"event": "preload_failed", "model": model_id,
                                                         "error": str(e)})
                failed[model_id] = str(e)
        return failed

    def unload(self, model_id: str, quantization: str | None = None) -> list[ResidentModel]:
        """Unload the idle resident instances of a model; ModelBusy if one has requests in flight."""
        self.spec(model_id)
        with self._lock:
            found = [m for m in self._resident.values()
                     if m.id == model_id and (quantization is None or m.quantization == quantization)]
            busy = [m for m in found if not m.idle]
            if busy:
                raise ModelBusy(f"The model {model_id!r} has requests in flight; unload it when they finish")
            for m in found:
                del self._resident[m.key]
        for m in found:
            self._stop(m, "unloaded on request")
        return found

    def _drop_failed(self, m: ResidentModel) -> None:
        with self._lock:
            if self._resident.get(m.key) is m:
                del self._resident[m.key]
            else:
                return
        self._stop(m, f"engine loop failed ({m.loop.failed})")

    STOP_WAIT_S = 5.0    # how long an eviction waits for the step thread to let go of the model

    def _stop(self, m: ResidentModel, why: str) -> None:
        log.info("model evicted", extra={"event": "model_evicted", "model": m.id, "quantization": m.quantization,
                                         "reason": why, "bytes": m.bytes})
        stopped = m.loop.stop(self.STOP_WAIT_S)
        if self.on_evicted is not None:
            self.on_evicted(m)
        # The model's objects are frozen with the rest (see _load) and its callers may still hold it:
        # the weights and the KV cache are let go of explicitly, so their memory is back now.
        m.loop.step_listeners.clear()   # the node's listeners refer back to m
        if stopped:
            self._release(m)
        else:   # a long step holds the step thread (another model's prefill): released once it ends
            threading.Thread(target=lambda: m.loop.stop(None) and self._release(m), name="release", daemon=True).start()

    @staticmethod
    def _release(m: ResidentModel) -> None:
        m.engine.release()
        gc.unfreeze()
        gc.collect()
        gc.freeze()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            models = list(self._resident.values())
            self._resident.clear()
        for m in models:
            m.loop.stop()
