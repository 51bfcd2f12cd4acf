"""EngineLoop: a step thread owns an Engine and steps it; other threads submit requests and read streams.

Requests and aborts reach the loop through a command queue and are applied between steps, so the
engine, its scheduler and its block pool are only ever touched by the step thread. A StepThread can
step several loops in turn: a node's CPU models share one (see StepThread).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from engine.engine import Engine, RequestError, SequenceDelta, duplicate_request_id
from engine.request import EngineRequest

log = logging.getLogger(__name__)

# The step's kernels hold the GIL: after a step that gave requests their first tokens, the step thread
# waits (at most this long) until their readers have taken them, so the first token is not a step late.
STREAM_HANDOFF_S = 0.002
STREAM_YIELD_S = 0.0002   # the pause after other steps with deltas: a woken reader takes the GIL in it
IDLE_WAIT_S = 0.05     # an idle step thread looks at its loops at least this often (submit, abort, stop wake it)


class HandOff:
    """The readers one step woke with their request's first deltas, counted down as each comes back
    for more."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._left = 0

    def expect(self) -> None:
        with self._cond:
            self._left += 1

    def came_back(self) -> None:
        with self._cond:
            self._left -= 1
            if self._left <= 0:
                self._cond.notify()

    @property
    def expected(self) -> int:
        return self._left

    def wait(self, timeout: float) -> bool:
        """Whether every reader came back within timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._left <= 0, timeout)


class MovingAverage:
    """An exponentially weighted mean whose first samples count equally (the weight of a new sample is
    1/n until that falls below `weight`): a node's first, cold steps are slow, and a start held by the
    first sample would keep a node that serves little looking slow, so the router would send it nothing
    to measure again."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.n = 0
        self.value = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.value += max(self.weight, 1.0 / self.n) * (x - self.value)


class DecodeStepFit:
    """A decode step's time as a line in the batch size, step_s ~ base_s + per_seq_s * batch, fitted by
    exponentially weighted least squares over recent decode-only steps (about the last 20): what a request
    joining the batch would see (the router's latency estimate). With one batch size seen so far the slope
    is 0."""

    WEIGHT = 0.05

    def __init__(self) -> None:
        self._b, self._t, self._bb, self._bt = (MovingAverage(self.WEIGHT) for _ in range(4))

    def add(self, batch: int, seconds: float) -> None:
        for mean, x in ((self._b, batch), (self._t, seconds), (self._bb, batch * batch), (self._bt, batch * seconds)):
            mean.add(x)

    def line(self) -> tuple[float, float]:
        """(base_s, per_seq_s); (0, 0) before any decode step."""
        if not self._t.n:
            return 0.0, 0.0
        b, t = self._b.value, self._t.value
        var = self._bb.value - b * b
        slope = max(0.0, (self._bt.value - b * t) / var) if var > 1e-6 else 0.0
        base = t - slope * b
        if base < 0:   # a line through the origin fits no worse than a negative base
            base, slope = 0.0, t / max(b, 1.0)
        return base, slope


class RequestStream:
    """The deltas of one request as the loop produces them; iterate, or call next_delta(timeout)."""

    def __init__(self, loop: "EngineLoop", request: EngineRequest):
        self.loop = loop
        self.request = request
        self.num_sequences = request.sampling.n
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._open = self.num_sequences
        self.num_finished_in_loop = 0     # counted on the loop thread
        self.error: BaseException | None = None
        self.reader_waiting = False       # the reader is blocked in next_delta (read by the loop thread)
        self._started = False             # something was put
        self._first_step: HandOff | None = None   # the hand-off of the step that put the first deltas
        self._owed: HandOff | None = None          # the reader's: told once the reader comes back

    def _put(self, item, handoff: HandOff | None = None) -> None:
        """Put item. With the step's handoff: a reader waiting for the request's first deltas counts in
        it, and they carry it to the reader."""
        if handoff is not None and not self._started and self.reader_waiting:
            self._first_step = handoff
            handoff.expect()
        self._started = True
        self._q.put((item, handoff if handoff is self._first_step else None))

    def next_delta(self, timeout: float | None = None) -> SequenceDelta | None:
        """The next delta; None once every sequence has finished. Raises queue.Empty on timeout,
        or the error that failed the request. A reader asks again after the last delta (as iteration
        does): that is how the step thread learns it is done with the first ones."""
        if self._owed is not None and self._q.empty():
            self._owed.came_back()
            self._owed = None
        if self._open == 0:
            return None
        self.reader_waiting = True
        try:
            item, handoff = self._q.get(timeout=timeout)
        finally:
            self.reader_waiting = False
        if handoff is not None:
            self._owed = handoff
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

    def cancel(self) -> None:
        """Abort the request (a client went away); its blocks are freed before the next step. Only this
        stream's: another request that took the same id (this one's was refused as a duplicate) runs on."""
        self.loop.abort(self.request.request_id, self)


class EngineLoop:
    stream_handoff_s = STREAM_HANDOFF_S
    stream_yield_s = STREAM_YIELD_S

    def __init__(self, engine: Engine, name: str | None = None, thread: "StepThread | None" = None):
        """thread: the StepThread to be stepped by (shared with other loops); by default one of its own,
        named `name`."""
        self.engine = engine
        self._cmds: deque = deque()
        self._queued_ids: set[str] = set()   # the ids of the requests submitted and not yet added
        self._ids_lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._stopped = threading.Event()   # set by the step thread once it has let go of this loop
        self._busy: deque = deque()       # (end time, seconds) of recent steps, for utilization
        # what the router estimates latency from: tokens per second of prefill, of the decode batch, and of
        # one stream in it (1 / decode-step time)
        self.prefill_rate, self.decode_rate, self.stream_rate = (MovingAverage(0.2) for _ in range(3))
        self.decode_step = DecodeStepFit()
        self.step_listeners: list = []    # callables(engine, step_seconds, deltas) run on the step thread
        self.failed: BaseException | None = None
        self._share_cpu = False           # wanted: steps leave a core to a model loading beside
        self._thread = thread if thread is not None else StepThread(name or f"engine-{engine.model_id}")
        self._wake = self._thread.wake
        self._thread.add(self)

    # ---- any thread
    def submit(self, request: EngineRequest) -> RequestStream:
        """Validate now (RequestError to the caller), then queue for the loop."""
        if self.failed is not None:
            raise RuntimeError(f"the engine loop has failed: {self.failed}")
        self.engine.validate(request)
        with self._ids_lock:   # its id is in use from now: queued here, then the engine's until it ends
            if request.request_id in self._queued_ids or self.engine.has_request(request.request_id):
                raise duplicate_request_id(request.request_id)
            self._queued_ids.add(request.request_id)
        stream = RequestStream(self, request)
        self._cmds.append(("add", request, stream))
        self._wake.set()
        if self._stopped.is_set():   # the step thread let go of this loop meanwhile: nobody would answer
            self._fail_queued()
        return stream

    def abort(self, request_id: str, stream: RequestStream | None = None) -> None:
        """Abort the request with this id (with `stream`: only while it is that stream's request)."""
        self._cmds.append(("abort", request_id, stream))
        self._wake.set()

    def stop(self, timeout: float | None = 5.0) -> bool:
        """Take the loop off its step thread; whether that is done within `timeout` (None: wait). The step
        in progress finishes first: this loop's, or another's on a shared step thread."""
        self._stopping = True
        self._wake.set()
        return self._stopped.wait(timeout)

    def share_cpu(self, sharing: bool) -> None:
        """Leave a core to other work (a model loading beside this one) from the next step on."""
        self._share_cpu = sharing
        self._wake.set()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Sequences accepted and not running: submitted but not yet taken in by the step thread, and
        those the engine's scheduler holds back (new, or preempted to be computed again)."""
        pending = sum(req.sampling.n for kind, req, _ in list(self._cmds) if kind == "add")
        return pending + self.engine.num_waiting

    UTILIZATION_WINDOW_S = 10.0

    def utilization(self) -> float:
        """Fraction of the last few seconds this loop spent computing steps."""
        horizon = time.monotonic() - self.UTILIZATION_WINDOW_S
        return min(1.0, sum(dt for end, dt in list(self._busy) if end > horizon) / self.UTILIZATION_WINDOW_S)

    def _fail_queued(self) -> None:
        """Answer the requests still queued with an error (once the step thread has let go of the loop)."""
        why = f"engine failure: {self.failed}" if self.failed is not None else "the engine loop has stopped"
        while self._cmds:
            try:
                kind, arg, stream = self._cmds.popleft()
            except IndexError:   # drained by the other thread meanwhile
                return
            if kind == "add":
                with self._ids_lock:
                    self._queued_ids.discard(arg.request_id)
                stream._put(RuntimeError(why))

    # ---- the step thread
    def _apply_commands(self) -> None:
        while self._cmds:
            kind, arg, stream = self._cmds.popleft()
            if kind == "add":
                try:
                    with self._ids_lock:   # from queued to the engine's in one move: submit sees it in one
                        self._queued_ids.discard(arg.request_id)
                        self.engine.add_request(arg)
                    self._streams[arg.request_id] = stream
                except RequestError as e:
                    stream._put(e)
            elif stream is None or self._streams.get(arg) is stream:
                for d in self.engine.abort(arg):
                    self._dispatch(d)
                self._streams.pop(arg, None)

    def _dispatch(self, d: SequenceDelta, handoff: HandOff | None = None) -> None:
        stream = self._streams.get(d.request_id)
        if stream is None:
            return
        stream._put(d, handoff)
        if d.finished:
            stream.num_finished_in_loop += 1
            if stream.num_finished_in_loop >= stream.num_sequences:
                self._streams.pop(d.request_id, None)

    def _run_once(self) -> bool:
        """Apply the queued commands, then take one step if there is work; whether it stepped."""
        try:
            self._apply_commands()
            if not self.engine.has_unfinished():
                return False
            if self._thread.sharing_cpu != self._share_cpu:   # the backend's setting is per launching thread
                self._thread.sharing_cpu = self._share_cpu
                self.engine.backend.share_cpu(self._share_cpu)
            t0 = time.monotonic()
            deltas = self.engine.step()
            dt = time.monotonic() - t0
            self._busy.append((t0 + dt, dt))
            while self._busy and self._busy[0][0] < t0 - self.UTILIZATION_WINDOW_S:
                self._busy.popleft()
            self._measure(dt)
            if deltas:
                handoff = HandOff()
                for d in deltas:
                    self._dispatch(d, handoff)
                # The readers write their tokens now, between steps, when the cores are free anyway:
                # once the next step's kernels hold the GIL they could not (see STREAM_HANDOFF_S).
                if handoff.expected:
                    handoff.wait(self.stream_handoff_s)
                else:
                    time.sleep(self.stream_yield_s)
            for listener in self.step_listeners:
                listener(self.engine, dt, deltas)
            return True
        except BaseException as e:  # a bug in a step: fail every open stream loudly, never hang them
            log.exception("engine loop failed", extra={"model": self.engine.model_id})
            self.failed = e
            self._stopping = True
            for stream in list(self._streams.values()):
                stream._put(RuntimeError(f"engine failure: {e}"))
            self._streams.clear()
            return False

    def _measure(self, dt: float) -> None:
        eng = self.engine
        if eng.last_step_tokens <= 0 or dt <= 0:
            return
        rate = eng.last_step_tokens / dt
        if eng.last_step_tokens > eng.last_batch_size:   # a step with prefill chunks in it
            self.prefill_rate.add(rate)
        else:
            self.decode_rate.add(rate)
            self.stream_rate.add(1.0 / dt)
            self.decode_step.add(eng.last_batch_size, dt)


class StepThread:
    """One thread that steps the EngineLoops given to it, in turn; it runs while it has any.

    A node's CPU models share one: a libgomp team per stepping thread means more kernel threads than
    cores, and libgomp then stops spinning between parallel regions; the CPU kernels hold the GIL, so
    two models' steps never ran at once anyway.
    """

    def __init__(self, name: str):
        self.name = name
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self._loops: list[EngineLoop] = []
        self._thread: threading.Thread | None = None
        self.sharing_cpu = False   # the backend's share_cpu setting on this thread, applied by its loops

    def add(self, loop: EngineLoop) -> None:
        with self._lock:
            self._loops.append(loop)
            if self._thread is None:
                self.sharing_cpu = False   # a new thread starts from the default
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self.wake.set()

    @property
    def alive(self) -> bool:
        with self._lock:
            return self._thread is not None

    def _run(self) -> None:
        while True:
            with self._lock:
                for loop in [x for x in self._loops if x._stopping]:
                    self._loops.remove(loop)
                    loop._stopped.set()   # first: a submit() that comes after sees it and drains itself
                    loop._fail_queued()
                if not self._loops:
                    self._thread = None   # the next add() starts a new thread
                    return
                loops = list(self._loops)
            stepped = False
            for loop in loops:
                if not loop._stopping:
                    stepped = loop._run_once() or stepped
            if not stepped:
                self.wake.wait(IDLE_WAIT_S)
                self.wake.clear()
