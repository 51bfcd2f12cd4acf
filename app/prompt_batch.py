"""A completions request with a list of prompts, read from the nodes as one stream.

OpenAI's completions take several prompts at once and answer each with n choices, numbered prompt by
prompt (choice i × n + j is prompt i's j-th). `send` writes one node request per prompt (NodeClient.send,
each to the node the router picks for it), all before any answer is read, so the nodes compute them
together; PromptBatch then reads them as a NodeStream reads one: their events one prompt after
another (a client gathers choices by index), and one done event at the end with their usage summed.
"""
from __future__ import annotations

from typing import Iterator

from app.inference import InferenceRequest
from app.node_client import PING, NodeClient, NodeStream, NodeStreamError
from engine.protocol import APIError


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
    """The node streams of a request's prompts, in order, as one NodeStream."""

    def __init__(self, streams: list[NodeStream], n: int) -> None:
        self.streams = streams
        self.n = n

    @property
    def node(self) -> str:
        return ",".join(dict.fromkeys(s.node for s in self.streams if s.node))

    @property
    def attempts(self) -> int:
        return sum(s.attempts for s in self.streams)

    @property
    def tokens_read(self) -> int:
        return sum(s.tokens_read for s in self.streams)

    def accept(self) -> None:
        """Every prompt's node answer (APIError at the first that no node takes: the others are closed)."""
        try:
            for stream in self.streams:
                stream.accept()
        except BaseException:
            self.close()
            raise

    def events(self) -> Iterator[dict]:
        """The prompts' events in turn, then one done event. A prompt that no node serves after tokens of an
        earlier one came fails the answer as a stream that broke after its first token does."""
        dones: list[dict] = []
        for i, stream in enumerate(self.streams):
            try:
                yield from _numbered(stream.events(), i * self.n, dones)
            except APIError as exc:
                if self.tokens_read == 0:
                    raise
                raise NodeStreamError(exc.message, exc.code) from None
        usage: dict[str, int] = {}
        for done in dones:
            for key, value in (done.get("usage") or {}).items():
                usage[key] = usage.get(key, 0) + (value if isinstance(value, int) else 0)
        yield {"type": "done", "choices": [c for done in dones for c in done.get("choices", [])], "usage": usage,
               "timings": dones[0].get("timings") or {}}   # the first prompt's: its time to first token

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


def _numbered(events: Iterator[dict], first: int, dones: list[dict]) -> Iterator[dict]:
    """One prompt's events with its choices numbered from `first`; its done event goes to `dones`."""
    for event in events:
        kind = None if event is PING else event.get("type")
        if kind == "token":
            yield {**event, "index": first + int(event.get("index", 0))}
        elif kind == "done":
            dones.append({**event, "choices": [{**c, "index": first + int(c.get("index", 0))}
                                               for c in event.get("choices", [])]})
        else:
            yield event
