"""Tool calls in OpenAI's answers: the node's text parsed into `message.tool_calls` (finish_reason
"tool_calls"), or, streaming, into tool-call deltas as each call completes (the format and the parser
are engine/tools.py's)."""
from __future__ import annotations

import uuid
from typing import Any

from engine.tools import ToolCall, ToolCallParser, parse_tool_calls


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _finish(reason: str | None, calls: int) -> str | None:
    """A sequence that ended on its own after calling tools finished to let them run."""
    return "tool_calls" if calls and reason == "stop" else reason


def chat_message(text: str, finish_reason: str | None, mode: str) -> tuple[dict, str | None]:
    """(the assistant message, the finish reason) of a whole answer; mode "single" keeps the first call."""
    content, calls = parse_tool_calls(text)
    if mode == "single":
        calls = calls[:1]
    # the newlines between calls are not content
    message: dict[str, Any] = {"role": "assistant", "content": content if content.strip() or not calls else None}
    if calls:
        message["tool_calls"] = [{"id": _call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message, _finish(finish_reason, len(calls))


class ToolCallDeltas:
    """One streamed choice: text in, chat deltas out — content as it is known not to begin a call, and
    each complete call as two deltas (its id and name, then its arguments)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.parser = ToolCallParser()
        self.calls = 0
        self._space = ""   # whitespace after a call: content if text follows, a separator if a call does

    def push(self, text: str) -> list[dict]:
        return self._deltas(self.parser.push(text))

    def finish(self, reason: str | None) -> tuple[list[dict], str | None]:
        """The deltas of what was held back, and the finish reason."""
        return self._deltas(self.parser.finish()), _finish(reason, self.calls)

    def _deltas(self, pieces: list[tuple[str, Any]]) -> list[dict]:
        out = []
        for kind, piece in pieces:
            if kind == "text":
                if self.calls and not piece.strip():
                    self._space += piece
                elif piece:
                    out.append({"content": self._space + piece})
                    self._space = ""
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
