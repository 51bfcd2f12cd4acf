"""A completions request with a list of prompts, read from the nodes as one stream.

OpenAI's completions take several prompts at once and answer each with n choices, numbered prompt by
prompt (choice i × n + j is prompt i's j-th). `send` writes one node request per prompt (NodeClient.send,
each to the node the router picks for it), all before any answer is read, so the nodes compute them
together; PromptBatch then reads them as a NodeStream reads one: every prompt's events as they come (a
thread reads each node stream: a client gathers choices by index), a "finish" event with a prompt's finish
reasons when it ends, and one done event at the end with every choice and the usage summed.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Iterator

from app.inference import InferenceRequest
from app.node_client import PING, NodeClient, NodeStream, NodeStreamError
from engine.protocol import APIError

log = logging.getLogger("zen.gateway")
_END = object()   # a reader's last item: its stream is closed


def send(client: NodeClient, req: InferenceRequest) -> NodeStream | PromptBatch:
    """`req` written to the nodes (NodeClient.send): one stream, or a PromptBatch of a stream per prompt."""
    parts = req.parts
    if len(parts) == 1:
        return client.send(req)
    streams: list[NodeStream] = []
    try:
        for part in parts:
            streams.append(client.send(part))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return PromptBatch(streams, req.params.n)


class PromptBatch:
    """The node streams of a request's prompts as one NodeStream.

    Each stream is read, and closed, by a thread of its own once `events` starts; `close` abandons the
    streams being read (their reads end at once, and their readers close them), so that no thread
    touches a connection another owns."""

    def __init__(self, streams: list[NodeStream], n: int) -> None:
        self.streams = streams
        self.n = n
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._readers = 0   # the streams that have a reader: the first `_readers`
        self._closed = False

    @property
    def node(self) -> str:
        return ",".join(dict.fromkeys(s.node for s in self.streams if s.node))

    @property
    def attempts(self) -> int:
        return sum(s.attempts for s in self.streams)

    @property
    def tokens_read(self) -> int:
        return sum(s.tokens_read for s in self.streams)

    @property
    def prompt_tokens(self) -> int | None:
        """The prompts' tokens as their nodes counted them; None unless every prompt's node has."""
        counts = [s.prompt_tokens for s in self.streams]
        return None if None in counts else sum(counts)

    def accept(self) -> None:
        """Every prompt's node answer (APIError at the first that no node takes: the others are closed)."""
        try:
            for stream in self.streams:
                stream.accept()
        except BaseException:
            self.close()
            raise

    def events(self) -> Iterator[dict]:
        """The prompts' events as they come, then one done event. A prompt that no node serves once tokens
        came fails the answer as a stream that broke after its first token does."""
        for i, stream in enumerate(self.streams):
            threading.Thread(target=self._read, args=(i, stream), name=f"prompt-{i}", daemon=True).start()
            self._readers = i + 1
        dones: dict[int, dict] = {}
        running = len(self.streams)
        while running:
            i, item = self._items.get()
            if item is _END:
                running -= 1
            elif isinstance(item, APIError):
                if self.tokens_read == 0:
                    raise item
                raise NodeStreamError(item.message, item.code) from None
            elif isinstance(item, BaseException):
                raise item
            elif item is not PING and item.get("type") == "done":
                dones[i] = item
                yield {"type": "finish", "choices": item["choices"]}
            else:
                yield item
        ended = [dones[i] for i in sorted(dones)]
        usage: dict[str, int] = {}
        for done in ended:
            for key, value in (done.get("usage") or {}).items():
                usage[key] = usage.get(key, 0) + (value if isinstance(value, int) else 0)
        yield {"type": "done", "choices": [c for done in ended for c in done.get("choices", [])], "usage": usage,
               "timings": ended[0].get("timings") or {}}   # the first prompt's: its time to first token

    def _read(self, i: int, stream: NodeStream) -> None:
        """Prompt i's events into the queue, numbered, until its stream ends or the batch is closed."""
        try:
            for event in _numbered(stream.events(), i * self.n):
                if self._closed:
                    break
                self._items.put((i, event))
        except BaseException as exc:
            self._items.put((i, exc))
        finally:
            try:
                stream.close()
            except Exception:   # the answer is complete without it: said, not raised in a thread no one joins
                log.exception("a prompt's node stream did not close cleanly", extra={"event": "stream_close_error"})
            self._items.put((i, _END))

    def close(self) -> None:
        self._closed = True
        for i, stream in enumerate(self.streams):
            if i < self._readers:
                stream.abandon()
            else:
                stream.close()


def _numbered(events: Iterator[dict], first: int) -> Iterator[dict]:
    """One prompt's events with its choices numbered from `first`."""
    for event in events:
        kind = None if event is PING else event.get("type")
        if kind == "token":
            yield {**event, "index": first + int(event.get("index", 0))}
        elif kind == "done":
            yield {**event, "choices": [{**c, "index": first + int(c.get("index", 0))}
                                        for c in event.get("choices", [])]}
        else:
            yield event
