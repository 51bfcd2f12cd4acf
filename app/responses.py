"""OpenAI response objects built from the engine node's answers.

Non-streaming: `chat_completion` / `text_completion` from a node's JSON body. Streaming:
`ChunkWriter` turns node events (token, done) into OpenAI chunks (`chat.completion.chunk`
or `text_completion`) as server-sent events, ending with `data: [DONE]`.
"""
from __future__ import annotations

import codecs
import json
import time
from typing import Any, Iterable

from app.tool_responses import ToolCallDeltas, chat_message

CHAT = "chat"
COMPLETIONS = "completions"


def sse(data: Any) -> str:
    return "data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n\n"


def _text(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


_TEXT_MARK = "\x00text\x00"   # stands for the text in the serialised chunk


SSE_DONE = "data: [DONE]\n\n"


def _token_bytes(entry: dict) -> list[int]:
    """The token's bytes as the node sent them (a node without them: its text's)."""
    raw = entry.get("bytes")
    if isinstance(raw, list):
        return raw
    return list(str(entry.get("token", "")).encode("utf-8", errors="replace"))


def chat_logprob_content(entries: Iterable[dict], top_n: int) -> list[dict]:
    """Node logprob entries → OpenAI chat `logprobs.content`: the content's tokens, so not the special tokens
    the text leaves out (the node marks them `skipped`: an end-of-turn token, one in mid-answer)."""
    out = []
    for e in entries:
        if e.get("skipped"):
            continue
        token = str(e.get("token", ""))
        out.append({
            "token": token,
            "logprob": e.get("logprob"),
            "bytes": _token_bytes(e),
            "top_logprobs": [
                {"token": str(t.get("token", "")), "logprob": t.get("logprob"),
                 "bytes": _token_bytes(t)}
                for t in (e.get("top") or [])[:top_n]
            ],
        })
    return out


class TextOffsets:
    """Where each token's text begins in a completion's text, in characters counted from the tokens' bytes:
    the byte-piece tokens of one character share its offset (their own texts, "\ufffd" each, would count one
    character apiece)."""

    def __init__(self) -> None:
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, entry: dict) -> int:
        """The offset of this entry's token; the count moves past it (not past a special token the text
        leaves out: the node marks it `skipped`)."""
        offset = self.chars
        if entry.get("skipped"):
            return offset
        raw = entry.get("bytes")
        try:
            data = bytes(raw) if isinstance(raw, list) else str(entry.get("token", "")).encode()
        except (TypeError, ValueError):   # not bytes: the token's text
            data = str(entry.get("token", "")).encode()
        self.chars += len(self._decoder.decode(data))
        return offset


def completion_logprobs(entries: list[dict], top_n: int, offsets: TextOffsets | None = None) -> dict:
    """Node logprob entries → OpenAI completions `logprobs` (`offsets`: the choice's count so far)."""
    offsets = offsets or TextOffsets()
    tokens, token_logprobs, top, text_offsets = [], [], [], []
    for e in entries:
        token = str(e.get("token", ""))
        tokens.append(token)
        token_logprobs.append(e.get("logprob"))
        alternatives: dict[str, Any] = {}
        for t in (e.get("top") or [])[:top_n]:   # tokens of one text (partial UTF-8: "\ufffd") keep the likeliest
            alternatives.setdefault(str(t.get("token", "")), t.get("logprob"))
        alternatives.setdefault(token, e.get("logprob"))   # the sampled token's always: up to logprobs + 1
        top.append(alternatives)
        text_offsets.append(offsets.next(e))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": text_offsets}


def usage_of(node_usage: Any) -> dict:
    """OpenAI's usage from the node's: the counts, and the prompt tokens its prefix cache held."""
    u = node_usage if isinstance(node_usage, dict) else {}
    prompt = int(u.get("prompt_tokens") or 0)
    completion = int(u.get("completion_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": int(u.get("total_tokens") or prompt + completion),
            "prompt_tokens_details": {"cached_tokens": int(u.get("cached_tokens") or 0)}}


def _fingerprint(model_id: str, quantization: str) -> str:
    return f"{model_id}-{quantization}"


def chat_completion(rid: str, alias: str, model_id: str, quantization: str, body: dict,
                    logprobs_top: int | None, tool_calls: str | None = None, service_tier: str = "default") -> dict:
    """tool_calls ("single" or "parallel"): the text is parsed for calls (app/tool_responses); service_tier:
    the latency class the request was served in, by OpenAI's name (app/priority.py)."""
    choices = []
    for c in sorted(body.get("choices", []), key=lambda c: c.get("index", 0)):
        logprobs = None
        if logprobs_top is not None:
            logprobs = {"content": chat_logprob_content(c.get("logprobs") or [], logprobs_top)}
        message, finish = {"role": "assistant", "content": c.get("text", "")}, c.get("finish_reason")
        if tool_calls is not None:
            message, finish = chat_message(c.get("text", ""), finish, tool_calls)
        choices.append({
            "index": c.get("index", 0),
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
        })
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": alias,
        "service_tier": service_tier,
        "system_fingerprint": _fingerprint(model_id, quantization),
        "choices": choices,
        "usage": usage_of(body.get("usage")),
    }


def text_completion(rid: str, alias: str, model_id: str, quantization: str, body: dict,
                    logprobs_top: int | None, tool_calls: str | None = None, service_tier: str = "default") -> dict:
    choices = []
    for c in sorted(body.get("choices", []), key=lambda c: c.get("index", 0)):
        logprobs = None
        if logprobs_top is not None:
            logprobs = completion_logprobs(c.get("logprobs") or [], logprobs_top)
        choices.append({
            "index": c.get("index", 0),
            "text": c.get("text", ""),
            "logprobs": logprobs,
            "finish_reason": c.get("finish_reason"),
        })
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": alias,
        "service_tier": service_tier,
        "system_fingerprint": _fingerprint(model_id, quantization),
        "choices": choices,
        "usage": usage_of(body.get("usage")),
    }


class ChunkWriter:
    """Node stream events → OpenAI chunks (SSE strings) for one request."""

    def __init__(self, kind: str, rid: str, alias: str, model_id: str, quantization: str,
                 n: int, include_usage: bool, logprobs_top: int | None, tool_calls: str | None = None,
                 service_tier: str = "default") -> None:
        self.kind = kind
        self.id = f"chatcmpl-{rid}" if kind == CHAT else f"cmpl-{rid}"
        self.object = "chat.completion.chunk" if kind == CHAT else "text_completion"
        self.created = int(time.time())
        self.alias = alias
        self.service_tier = service_tier
        self.fingerprint = _fingerprint(model_id, quantization)
        self.n = n
        self.include_usage = include_usage
        self.logprobs_top = logprobs_top
        self.text_offsets = [TextOffsets() for _ in range(n)]
        self.finished: set[int] = set()
        self._plain: dict[int, tuple[str, str]] = {}   # index -> the chunk around its text
        # a chat answer parsed for tool calls: per choice, and the logprobs of its tokens not yet sent (the
        # parser holds text back, so they go out with the next delta it releases)
        self.tools = [ToolCallDeltas(tool_calls) for _ in range(n)] if tool_calls and kind == CHAT else None
        self._unsent_logprobs: list[list[dict]] = [[] for _ in range(n)]
        if logprobs_top is None:
            self._around(0)   # now, while the node reads the request, rather than on the first token's path

    def _token_choice(self, index: int, text: str, logprobs: dict | None) -> dict:
        if self.kind == CHAT:
            return {"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        out = {"id": self.id, "object": self.object, "created": self.created,
               "model": self.alias, "service_tier": self.service_tier, "system_fingerprint": self.fingerprint,
               "choices": choices}
        if self.include_usage:
            out["usage"] = usage
        return sse(out)

    def start(self) -> list[str]:
        """Opening chunks: the assistant role of every chat choice."""
        if self.kind != CHAT:
            return []
        # an answer parsed for tool calls may be calls only: its content null, as in the whole answer
        role = {"role": "assistant", "content": None if self.tools is not None else ""}
        return [self._chunk([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}])
                for i in range(self.n)]

    def token(self, event: dict) -> str:
        index = int(event.get("index", 0))
        text = str(event.get("text", ""))
        entry = event.get("logprobs")
        if self.tools is not None and index < self.n:
            if self.logprobs_top is not None and isinstance(entry, dict):
                self._unsent_logprobs[index].append(entry)
            return self._deltas(index, self.tools[index].push(text))
        with_logprobs = self.logprobs_top is not None and isinstance(entry, dict) and not (
            self.kind == CHAT and entry.get("skipped"))   # a chat chunk's logprobs are its content's
        if not with_logprobs:
            # The same chunk every time but for its text: serialised once per choice, then only the
            # text is encoded (once per token per stream, this is the gateway's hottest line).
            around = self._plain.get(index) or self._around(index)
            return around[0] + _text(text) + around[1]
        if self.kind == CHAT:
            lp = {"content": chat_logprob_content([entry], self.logprobs_top)}
        else:
            offsets = self.text_offsets[index] if index < self.n else None
            lp = completion_logprobs([entry], self.logprobs_top, offsets)
        return self._chunk([self._token_choice(index, text, lp)])

    def _around(self, index: int) -> tuple[str, str]:
        """The token chunk of choice `index` before and after its text (the chunk's last string: only
        constants and the usage follow it)."""
        head, _, tail = self._chunk([self._token_choice(index, _TEXT_MARK, None)]).rpartition(_text(_TEXT_MARK))
        around = self._plain[index] = (head, tail)
        return around

    def _unsent(self, index: int) -> dict | None:
        """The logprobs of the choice's tokens not sent yet, taken (None when there are none)."""
        if index >= self.n or not self._unsent_logprobs[index]:
            return None
        entries, self._unsent_logprobs[index] = self._unsent_logprobs[index], []
        return {"content": chat_logprob_content(entries, self.logprobs_top)}

    def _deltas(self, index: int, deltas: list[dict]) -> str:
        return "".join(self._chunk([{"index": index, "delta": d, "logprobs": self._unsent(index) if i == 0 else None,
                                     "finish_reason": None}]) for i, d in enumerate(deltas))

    def done(self, event: dict) -> list[str]:
        """Closing chunks: the finish reason of each choice not finished yet, then usage if asked for."""
        out = self.finish([c for c in event.get("choices") or [] if int(c.get("index", 0)) not in self.finished])
        if self.include_usage:
            out.append(self._chunk([], usage_of(event.get("usage"))))
        return out

    def finish(self, choices: list[dict]) -> list[str]:
        """The chunks that end these choices (a node's done event's), with their finish reasons."""
        out = []
        for c in sorted(choices, key=lambda c: c.get("index", 0)):
            index = int(c.get("index", 0))
            self.finished.add(index)
            if self.kind == CHAT:
                finish = c.get("finish_reason")
                if self.tools is not None and index < self.n:
                    deltas, finish = self.tools[index].finish(finish)
                    out.append(self._deltas(index, deltas))
                choice = {"index": index, "delta": {}, "logprobs": self._unsent(index), "finish_reason": finish}
            else:
                choice = {"index": index, "text": "", "logprobs": None,
                          "finish_reason": c.get("finish_reason")}
            out.append(self._chunk([choice]))
        return out
