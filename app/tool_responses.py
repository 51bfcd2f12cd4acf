"""Tool calls in OpenAI's answers: the node's text parsed into `message.tool_calls` (finish_reason
"tool_calls"), or, streaming, into tool-call deltas as each call completes, and a call the token limit
cut short as far as it came (the format and the parser are engine/tools.py's)."""
from __future__ import annotations

import uuid
from typing import Any

from engine.tools import ToolCall, ToolCallParser


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _finish(reason: str | None, calls: int) -> str | None:
    """A sequence that ended on its own after calling tools finished to let them run."""
    return "tool_calls" if calls and reason == "stop" else reason


def chat_message(text: str, finish_reason: str | None, mode: str) -> tuple[dict, str | None]:
    """(the assistant message, the finish reason) of a whole answer: what its stream's deltas add up to
    (mode "single" keeps the first call; the whitespace before a call, or after the last, is not content)."""
    stream = ToolCallDeltas(mode)
    deltas = stream.push(text)
    rest, finish = stream.finish(finish_reason)
    content, calls = "", []
    for delta in deltas + rest:
        content += delta.get("content", "")
        for part in delta.get("tool_calls", ()):
            if "id" in part:
                calls.append({"id": part["id"], "type": "function", "function": dict(part["function"])})
            else:
                calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message, finish


class ToolCallDeltas:
    """One streamed choice: text in, chat deltas out — content as it is known not to begin a call, and
    each complete call as two deltas (its id and name, then its arguments)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.parser = ToolCallParser()
        self.calls = 0
        self._space = ""   # whitespace held back: content if text follows, a separator if a call does
        self._text = False  # some content was sent (the role chunk has none: the answer may be calls only)

    def push(self, text: str) -> list[dict]:
        return self._deltas(self.parser.push(text))

    def finish(self, reason: str | None) -> tuple[list[dict], str | None]:
        """The deltas of what was held back, and the finish reason. A call the token limit cut short is
        sent as far as it came (engine/tools.py's ToolCallParser.finish)."""
        out = self._deltas(self.parser.finish(cut=reason == "length"))
        if self._space and not self.calls:     # an answer without calls is its text, whole
            out.append({"content": self._space})
            self._text = True
        if not self._text and not self.calls:  # no text and no call: content "", as the whole answer's
            out.append({"content": ""})
        return out, _finish(reason, self.calls)

    def _deltas(self, pieces: list[tuple[str, Any]]) -> list[dict]:
        out = []
        for kind, piece in pieces:
            if kind == "text":
                held = self._space + piece
                text = held.rstrip()
                if text:
                    out.append({"content": text})
                    self._text = True
                self._space = held[len(text):]
            else:
                self._space = ""
                if self.mode == "parallel" or self.calls == 0:
                    out.extend(self._call(piece))
        return out

    def _call(self, call: ToolCall) -> list[dict]:
        index, self.calls = self.calls, self.calls + 1
        return [{"tool_calls": [{"index": index, "id": _call_id(), "type": "function",
                                 "function": {"name": call.name, "arguments": ""}}]},
                {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]
