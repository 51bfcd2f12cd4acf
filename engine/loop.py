"""EngineLoop: one thread owns an Engine and steps it; other threads submit requests and read streams.

Requests and aborts reach the loop through a command queue and are applied between steps, so the
engine, its scheduler and its block pool are only ever touched by the loop thread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from engine.engine import Engine, RequestError, SequenceDelta
from engine.request import InferenceRequest

log = logging.getLogger("engine.loop")

# Long enough for a woken stream thread to take the GIL (its wake-up is tens of microseconds). Measured
# on the 2-core machine: median TTFT at concurrency 1 down ~2.5 ms, and 16 streams through the gateway
# 5-9% more tokens/s (the writes no longer wait a step behind the kernels).
STREAM_YIELD_S = 0.0002


class RequestStream:
    """The deltas of one request as the loop produces them; iterate, or call next_delta(timeout)."""

    _END = object()

    def __init__(self, loop: "EngineLoop", request: InferenceRequest):
        self.loop = loop
        self.request = request
        self.num_sequences = request.sampling.n
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._open = self.num_sequences
        self.num_finished_in_loop = 0     # counted on the loop thread
        self.error: BaseException | None = None

    def _put(self, item) -> None:
        self._q.put(item)

    def next_delta(self, timeout: float | None = None) -> SequenceDelta | None:
        """The next delta; None once every sequence has finished. Raises queue.Empty on timeout,
        or the error that failed the request."""
        if self._open == 0:
            return None
        item = self._q.get(timeout=timeout)
        if isinstance(item, BaseException):
            self._open = 0
            raise item
        if item.finished:
            self._open -= 1
        return item

    def __iter__(self):
        while True:
            d = self.next_delta()
            if d is None:
                return
            yield d

    @property
    def finished(self) -> bool:
        return self._open == 0

    def cancel(self) -> None:
        """Abort the request (a client went away); its blocks are freed before the next step."""
        self.loop.abort(self.request.request_id)


class EngineLoop:
    stream_yield_s = STREAM_YIELD_S

    def __init__(self, engine: Engine, name: str | None = None):
        self.engine = engine
        self._cmds: deque = deque()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._busy: deque = deque()       # (end time, seconds) of recent steps, for utilization
        self.prefill_tokens_per_s = 0.0   # moving averages the router estimates latency from
        self.decode_tokens_per_s = 0.0
        self.step_listeners: list = []    # callables(engine, step_seconds, deltas) run on the loop thread
        self.failed: BaseException | None = None
        self._share_cpu = False           # wanted: steps leave a core to a model loading beside
        self._sharing = False             # applied by the loop thread (the backend's setting is per thread)
        self._thread = threading.Thread(target=self._run, name=name or f"engine-{engine.model_id}", daemon=True)
        self._thread.start()

    # ---- any thread
    def submit(self, request: InferenceRequest) -> RequestStream:
        """Validate now (RequestError to the caller), then queue for the loop."""
        if self.failed is not None:
            raise RuntimeError(f"the engine loop has failed: {self.failed}")
        self.engine.validate(request)
        stream = RequestStream(self, request)
        self._cmds.append(("add", request, stream))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._cmds.append(("abort", request_id, None))
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the loop thread; whether it has ended (it finishes the step in progress first)."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def share_cpu(self, sharing: bool) -> None:
        """Leave a core to other work (a model loading beside this one) from the next step on."""
        self._share_cpu = sharing
        self._wake.set()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    UTILIZATION_WINDOW_S = 10.0

    def utilization(self) -> float:
        """Fraction of the last few seconds this loop spent computing steps."""
        horizon = time.monotonic() - self.UTILIZATION_WINDOW_S
        return min(1.0, sum(dt for end, dt in list(self._busy) if end > horizon) / self.UTILIZATION_WINDOW_S)

    # ---- the loop thread
    def _apply_commands(self) -> None:
        while self._cmds:
            kind, arg, stream = self._cmds.popleft()
            if kind == "add":
                try:
                    self.engine.add_request(arg)
                    self._streams[arg.request_id] = stream
                except RequestError as e:
                    stream._put(e)
            else:
                for d in self.engine.abort(arg):
                    self._dispatch(d)
                self._streams.pop(arg, None)

    def _dispatch(self, d: SequenceDelta) -> None:
        stream = self._streams.get(d.request_id)
        if stream is None:
            return
        stream._put(d)
        if d.finished:
            stream.num_finished_in_loop += 1
            if stream.num_finished_in_loop >= stream.num_sequences:
                self._streams.pop(d.request_id, None)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                if self._sharing != self._share_cpu:
                    self._sharing = self._share_cpu
                    self.engine.backend.share_cpu(self._sharing)
                t0 = time.monotonic()
                deltas = self.engine.step()
                dt = time.monotonic() - t0
                self._busy.append((t0 + dt, dt))
                while self._busy and self._busy[0][0] < t0 - self.UTILIZATION_WINDOW_S:
                    self._busy.popleft()
                self._measure(dt)
                for d in deltas:
                    self._dispatch(d)
                if deltas:
                    # The step's kernels hold the GIL (see cpu_layers.run_layers), so a stream thread woken
                    # by these deltas would otherwise write its token only after the *next* step. A short
                    # sleep hands the GIL to it now, between steps, when its core is free anyway.
                    time.sleep(self.stream_yield_s)
                for listener in self.step_listeners:
                    listener(self.engine, dt, deltas)
        except BaseException as e:  # a bug in a step: fail every open stream loudly, never hang them
            log.exception("engine loop failed")
            self.failed = e
            for stream in list(self._streams.values()):
                stream._put(RuntimeError(f"engine failure: {e}"))
            self._streams.clear()

    def _measure(self, dt: float) -> None:
        eng = self.engine
        if eng.last_step_tokens <= 0 or dt <= 0:
            return
        rate = eng.last_step_tokens / dt
        a = 0.2
        if eng.last_step_tokens > eng.last_batch_size:   # a step with prefill chunks in it
            self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else (1 - a) * self.prefill_tokens_per_s + a * rate
        else:
            self.decode_tokens_per_s = rate if not self.decode_tokens_per_s else (1 - a) * self.decode_tokens_per_s + a * rate
