"""One generation on the node: a submitted request's deltas, answered as a JSON body or as server-sent events.

A client that goes away (the socket reads EOF, or a write fails and the WSGI iterable is closed)
cancels its request, whose blocks go back to the pool at once.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flask import Response, jsonify

from engine.client_socket import ClientGone, client_gone
from engine.engine import RequestError
from engine.grammar import PARAM as GRAMMAR_PARAM
from engine.node.admission import Ticket
from engine.node.drain import RETRY_AFTER_S, NodeShutdown
from engine.node.metrics import FinishedSequence
from engine.node.registry import ResidentModel
from engine.protocol import NODE_SHUTDOWN, ORG_QUEUE_FULL, STATE_FIELD, APIError, GenerateRequest, bad_value, stream_error_event
from engine.request import EngineRequest
from engine.tools import render_tool_prompt, template_messages, uses_tools
from models.chat_template import TemplateCompileError, renders_tools
from models.literal_text import LiteralText

if TYPE_CHECKING:
    from engine.node.node import Node
    from engine.node.tracing import GenerationTrace

log = logging.getLogger("engine.node")

POLL_S = 0.2                               # how often a waiting request thread checks its client
HEARTBEAT_S = 1.0                          # a stream without tokens this long sends an SSE comment


def unavailable(message: str, code: str, retry_after: int = 1) -> APIError:
    return APIError(503, message, code=code, headers={"Retry-After": str(max(1, int(retry_after)))})


def queue_full(e) -> APIError:
    """A full queue is the node's (503: another node may take the request); a full share of it, the org's
    (429 org_queue_full: another node may take it too, and the gateway says so when none does)."""
    if e.code == ORG_QUEUE_FULL:
        return APIError(429, str(e), code=e.code, headers={"Retry-After": "1"})
    return unavailable(str(e), e.code)


def model_not_found(e: LookupError) -> APIError:
    return APIError(404, str(e), param="model", code="model_not_found")


def prompt_token_ids(tok, prompt: str | None, messages: list | None, add_special_tokens: bool = True,
                     add_generation_prompt: bool = True, tools: list | None = None,
                     chat_template: str | None = None) -> list[int]:
    """The tokens of a text prompt, or of chat messages rendered by the model's template or by
    `chat_template` (a template's source, the catalog's) in its place, which holds the special tokens
    (add_special_tokens applies to a prompt only unless asked), with the tools as the template takes
    them or in the default rendering (engine/tools.py); special-token text in the messages and tools is
    text (models/literal_text.py); 400 when refused."""
    try:
        if prompt is not None:
            return tok.encode(prompt, add_special_tokens=add_special_tokens)
        template = chat_template or tok.chat_template
        if not template:
            raise bad_value("This model has no chat template: it serves completions only (send a `prompt` to "
                            "/v1/completions)", "messages", "chat_not_supported")
        render = functools.partial(tok.apply_chat_template, add_generation_prompt=add_generation_prompt,
                                   chat_template=chat_template)
        literal = LiteralText(tok)
        if not uses_tools(messages, tools):
            text = render(literal.quote(messages))
        else:   # quoted once the calls' arguments are decoded: JSON escapes in them spell special tokens too
            messages, tools = literal.quote(template_messages(messages)), literal.quote(tools)
            text = render(messages, tools=tools) if renders_tools(template) else render(
                render_tool_prompt(messages, tools))
        return literal.encode(text, add_special_tokens)
    except TemplateCompileError as e:   # the request's template, or the model's own
        raise bad_value(str(e), "chat_template" if chat_template else "messages") from None
    except ValueError as e:   # malformed messages, a template that refuses them
        raise bad_value(str(e), "messages" if messages is not None else "prompt") from None
    except RecursionError:    # tools or messages nested deeper than the template's rendering goes
        raise bad_value("the messages or tools are nested too deeply to render",
                        "tools" if tools else "messages") from None


def tokenize(call: GenerateRequest, m: ResidentModel) -> tuple[list[int], str | None]:
    if call.prompt_token_ids is not None:
        return list(call.prompt_token_ids), None
    if call.prompt is not None:
        return prompt_token_ids(m.engine.tokenizer, call.prompt, None), call.prompt
    return prompt_token_ids(m.engine.tokenizer, None, call.messages, add_special_tokens=False, tools=call.tools,
                            chat_template=call.chat_template), None


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


@dataclass
class Choice:
    index: int
    text: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    times: Any = None
    cached_tokens: int = 0
    started: bool = False


class Generation:
    """One submitted request: reads its deltas, keeps what the answer needs, and cleans up once."""

    def __init__(self, node: "Node", m: ResidentModel, call: GenerateRequest, req: EngineRequest, stream,
                 ticket: Ticket, sock):
        self.node, self.m, self.call, self.req, self.stream = node, m, call, req, stream
        self.ticket, self.sock = ticket, sock
        self.choices = [Choice(i, logprobs=[] if call.sampling.logprobs is not None else None)
                        for i in range(call.sampling.n)]
        self._closed = False
        self._lock = threading.Lock()
        self.trace: GenerationTrace | None = None   # set when tracing is on: its spans are made at close

    def deltas(self, heartbeat_s: float | None = None):
        """The request's deltas as they come; ClientGone when the client hangs up first (checked every
        POLL_S, whether deltas flow or not). With heartbeat_s, None is yielded after that long without
        a delta, so a stream can show its reader that it is alive (and learn whether the reader is)."""
        checked = last = time.monotonic()
        while True:
            try:
                d = self.stream.next_delta(timeout=POLL_S)
                if d is None:   # asked once more after the last delta: see RequestStream.next_delta
                    return
            except queue.Empty:
                d = None
            now = time.monotonic()
            if now - checked >= POLL_S:
                checked = now
                if client_gone(self.sock):
                    raise ClientGone()
                if self.node.closing or self.m.loop.failed is not None:
                    raise RuntimeError("the engine stopped serving this model")
                if self.node.drain.expired:
                    raise NodeShutdown("the node shut down before this generation finished")
            if d is None:
                if heartbeat_s is not None and now - last >= heartbeat_s:
                    last = now
                    yield None
                continue
            last = now
            c = self.choices[d.index]
            if not c.started:
                c.started = True
                self.ticket.started()
            c.token_ids.extend(d.token_ids)
            c.text.append(d.text)
            if c.logprobs is not None:
                c.logprobs.extend(d.logprobs)
            c.times = d.times
            c.cached_tokens = d.num_cached_tokens
            if d.finish_reason is not None:
                c.finish_reason = d.finish_reason
            if d.finish_reason == "error":   # the constraint broke down: its output would not conform
                raise RequestError(d.finish_message, param=GRAMMAR_PARAM, code="structured_output_failed")
            yield d

    def logprob_entry(self, lp) -> dict:
        tok = self.m.engine.tokenizer

        def entry(token_id: int, logprob: float) -> dict:
            # bytes: the token's own (text shows a partial UTF-8 character as U+FFFD); a padded model's
            # logits past its tokenizer's tokens have neither
            known = token_id < tok.vocab_size
            return {"token_id": token_id, "token": tok.token_text(token_id) if known else "",
                    "bytes": list(tok.token_bytes(token_id)) if known else [], "logprob": _finite(logprob)}
        out = {**entry(lp.token_id, lp.logprob), "top": [entry(t, v) for t, v in lp.top]}
        if lp.skipped:
            out["skipped"] = True   # a token the text leaves out (special, or the stop): no room in it (text_offset)
        return out

    def usage(self) -> dict:
        prompt = len(self.req.prompt_token_ids)
        completion = sum(len(c.token_ids) for c in self.choices)
        # the prompt's, once: the first choice's (n > 1 siblings share its blocks rather than the cache's)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "cached_tokens": self.choices[0].cached_tokens}

    def phase_times(self, now: float | None = None) -> tuple[float | None, float | None, float]:
        """(first scheduled, first token, end) over the choices, monotonic seconds; None where no choice
        got there yet; the end is `now` (default: the clock) until every choice has finished."""
        times = [c.times for c in self.choices if c.times is not None]
        scheduled = min((t.first_scheduled for t in times if t.first_scheduled is not None), default=None)
        first_token = min((t.first_token for t in times if t.first_token is not None), default=None)
        finished = [t.finished for t in times if t.finished is not None]
        if finished and len(finished) == len(self.choices):
            return scheduled, first_token, max(finished)
        return scheduled, first_token, time.monotonic() if now is None else now

    def timings(self) -> dict:
        times = [c.times for c in self.choices if c.times is not None]
        arrival = self.req.arrival_time
        scheduled, first_token, end = self.phase_times()
        gaps = [b - a for t in times for a, b in zip(t.token_times, t.token_times[1:])]

        def r(x):
            return None if x is None else round(max(0.0, x), 6)
        return {"queue_s": r(scheduled - arrival if scheduled is not None else None),
                "prefill_s": r(first_token - scheduled if first_token is not None and scheduled is not None
                               else None),
                "ttft_s": r(first_token - arrival if first_token is not None else None),
                "mean_itl_s": r(sum(gaps) / len(gaps) if gaps else (0.0 if first_token is not None else None)),
                "total_s": r(end - arrival)}

    @property
    def timed_out_before_start(self) -> bool:
        return all(c.finish_reason == "timeout" and not c.token_ids for c in self.choices)

    def close(self, outcome: str) -> None:
        """Once: cancel if unfinished (its blocks return to the pool), free the queue slot and the lease,
        and record metrics and the log line."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            unfinished = [c for c in self.choices if c.finish_reason is None]
            if unfinished:
                self.stream.cancel()
            self.ticket.close()
            now = time.monotonic()
            metrics, model, cls = self.node.metrics, self.m.id, self.call.latency_class.label
            for c in self.choices:
                t = c.times
                metrics.observe_finished(FinishedSequence(
                    model, cls, c.finish_reason or "abort", self.req.arrival_time,
                    t.first_scheduled if t else None, t.first_token if t else None,
                    list(t.token_times) if t else [], (t.finished if t and t.finished else now)))
            usage = self.usage()
            served = any(c.times is not None and c.times.first_scheduled is not None for c in self.choices)
            metrics.count_tokens(model, cls, usage["prompt_tokens"] if served else 0, usage["completion_tokens"])
            log.info("generation", extra={
                "event": "generation", "request_id": self.req.request_id, "org": self.call.org, "model": model,
                "quantization": self.m.quantization, "latency_class": cls, "outcome": outcome,
                "stream": self.call.stream, "finish_reasons": [c.finish_reason or "abort" for c in self.choices],
                **usage, **self.timings()})
            if self.trace is not None:
                self.trace.record(self, outcome)
        finally:
            self.node.registry.release(self.m)
            self.node.drain.leave()


class SSEBody:
    """The WSGI iterable of a stream. close() — called by the server when the response ends, when a
    write fails or when the client went away — always runs the cleanup, even if iteration never began.
    The bookkeeping is close()'s alone: the body ends with its last event, so the server writes the end
    of the chunked body first, and a gateway that reads to that end to reuse the connection does not
    wait for it."""

    def __init__(self, gen: Generation):
        self.gen = gen
        self.outcome = "client_closed"   # what close() records: set as the stream reaches its end
        self._it = self._events()

    def __iter__(self):
        return self._it

    def close(self) -> None:
        try:
            self._it.close()
        finally:
            self.gen.close(self.outcome)

    @staticmethod
    def _event(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def _events(self):
        gen = self.gen
        yield b""   # sends the headers now: the client knows the node took the request
        try:
            for d in gen.deltas(heartbeat_s=HEARTBEAT_S):
                if d is None:
                    yield b": ping\n\n"   # an SSE comment: readers skip it
                    continue
                chunk = []
                n = len(d.token_ids)
                for j, tid in enumerate(d.token_ids):
                    lp = d.logprobs[j] if j < len(d.logprobs) else None
                    chunk.append(self._event({
                        "type": "token", "index": d.index, "token_id": tid, "text": d.text if j == n - 1 else "",
                        "logprobs": gen.logprob_entry(lp) if lp is not None else None}))
                if not n and d.text:
                    chunk.append(self._event({"type": "token", "index": d.index, "token_id": None,
                                              "text": d.text, "logprobs": None}))
                if chunk:
                    yield b"".join(chunk)
            if gen.timed_out_before_start:
                self.outcome = "queue_timeout"
                yield self._event(stream_error_event(
                    "the request waited past its queue_timeout_s before it was scheduled", "server_error",
                    "queue_timeout"))
                return
            self.outcome = "ok"
            yield self._event({"type": "done", "request_id": gen.req.request_id,
                               "choices": [{"index": c.index, "finish_reason": c.finish_reason} for c in gen.choices],
                               "usage": gen.usage(), "timings": gen.timings(),
                               STATE_FIELD: gen.node.state().to_brief()})
        except ClientGone:
            self.outcome = "client_closed"
        except NodeShutdown as e:
            self.outcome = "node_shutdown"
            yield self._event(stream_error_event(str(e), "server_error", NODE_SHUTDOWN))
        except RequestError as e:
            self.outcome = "error"
            yield self._event(stream_error_event(str(e), "invalid_request_error", e.code or "invalid_value", e.param))
        except Exception as e:   # noqa: BLE001 — an engine failure ends this stream with an error event
            self.outcome = "error"
            log.exception("stream failed", extra={"request_id": gen.req.request_id, "org": gen.call.org})
            yield self._event(stream_error_event(f"engine failure: {e}", "server_error", "engine_failure"))


def collect(gen: Generation) -> Response:
    """Non-streaming: wait for every choice, then answer one JSON body. Its errors are answered here, not
    raised to the error handler: the node took the request, so they are no refusal (requests_rejected),
    as a stream's error events are not."""
    outcome = "error"
    try:
        for _ in gen.deltas():
            pass
        if gen.timed_out_before_start:
            outcome = "queue_timeout"
            return unavailable("the request waited past its queue_timeout_s before it was scheduled",
                               "queue_timeout").response()
        outcome = "ok"
        choices = [{"index": c.index, "text": "".join(c.text), "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                    "logprobs": None if c.logprobs is None else [gen.logprob_entry(lp) for lp in c.logprobs]}
                   for c in gen.choices]
        return jsonify({"request_id": gen.req.request_id, "model": gen.m.id, "quantization": gen.m.quantization,
                        "choices": choices, "usage": gen.usage(), "timings": gen.timings()})
    except ClientGone:
        outcome = "client_closed"
        return Response(status=499)
    except NodeShutdown as e:
        outcome = "node_shutdown"
        return unavailable(str(e), NODE_SHUTDOWN, RETRY_AFTER_S).response()
    except RequestError as e:
        return request_error(e).response()
    except RuntimeError as e:   # the model's loop failed, or the node is stopping
        return unavailable(f"engine failure: {e}", "engine_failure", 5).response()
    finally:
        gen.close(outcome)


def request_error(e: RequestError) -> APIError:
    if e.param == "request_id":
        return APIError(409, str(e), param="request_id", code="duplicate_request_id")
    return bad_value(str(e), e.param, e.code or "invalid_value")
