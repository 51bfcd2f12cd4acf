"""The inference request r = (m, x, θ, τ) as the gateway receives it from a client.

m: the resolved model (alias → model id + quantization), x: the input (text prompt, token
ids or chat messages), θ: the sampling parameters, τ: the latency class. `generate_request`
turns it into what an engine node is sent (engine/protocol.py's GenerateRequest).
"""
from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from app.catalog import ResolvedModel
from engine.protocol import GenerateRequest, LatencyClass, bad_value
from engine.sampling import SamplingParamError, SamplingParams

# An estimate of a text's BPE tokens, for what a node has not counted yet: the reservation in the org's
# token bucket before a node has tokenized the prompt (settled with the node's count when the request
# ends). About three bytes a token, and a digit a token of its own (SmolLM2's and Gemma's tokenizers split
# every digit: a prompt of digits was reserved a third of its tokens).
_BYTES_PER_TOKEN = 3
_DROP_DIGITS = str.maketrans("", "", "0123456789")


def estimated_text_tokens(text: str) -> int:
    digits = len(text) - len(text.translate(_DROP_DIGITS))
    return digits + math.ceil((len(text.encode()) - digits) / _BYTES_PER_TOKEN)


_TOKENS_PER_MESSAGE = 4      # chat-template overhead per message (role markers)
_TOKENS_PER_CONVERSATION = 3


def sampling_params(**fields: Any) -> SamplingParams:
    """θ, as the engine defines it (validated there too: a 400 naming the parameter, as the node gives)."""
    try:
        return SamplingParams(**fields)
    except SamplingParamError as e:
        raise bad_value(str(e), e.param, "invalid_value") from None


def message_text(message: dict) -> str:
    """What of a message (or a tool) the template writes out: its content, its calls, a tool's schema."""
    if "role" not in message:
        return json.dumps(message, ensure_ascii=False)
    calls = message.get("tool_calls")
    return message["content"] + (json.dumps(calls, ensure_ascii=False) if calls else "")


@dataclass(frozen=True)
class PromptInput:
    """x: exactly one of a text prompt, prompt token ids or chat messages."""

    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None   # {role, content, tool_calls?, tool_call_id?} (app/params)
    tools: tuple[dict, ...] | None = None      # function tools the chat template renders (app/tool_params)

    def __post_init__(self) -> None:
        given = sum(v is not None for v in (self.prompt, self.prompt_token_ids, self.messages))
        assert given == 1, "exactly one of prompt, prompt_token_ids, messages"

    @cached_property
    def estimated_tokens(self) -> int:
        """An estimate of the prompt's token count (exact for token ids); computed once a request."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        if self.prompt is not None:
            return max(1, estimated_text_tokens(self.prompt))
        return _TOKENS_PER_CONVERSATION + sum(_TOKENS_PER_MESSAGE + estimated_text_tokens(message_text(m))
                                              for m in (*self.messages, *(self.tools or ())))

    def to_node(self) -> dict[str, Any]:
        if self.prompt is not None:
            return {"prompt": self.prompt}
        if self.prompt_token_ids is not None:
            return {"prompt_token_ids": list(self.prompt_token_ids)}
        out: dict[str, Any] = {"messages": list(self.messages)}
        if self.tools:
            out["tools"] = list(self.tools)
        return out


@dataclass(frozen=True)
class InferenceRequest:
    """r = (m, x, θ, τ), plus who asked and how the answer travels."""

    model: ResolvedModel          # m
    inputs: PromptInput           # x
    params: SamplingParams        # θ
    latency_class: LatencyClass   # τ
    org: str
    request_id: str
    stream: bool = False
    tool_calls: str | None = None   # the answer is parsed for tool calls: "single" or "parallel" (app/tool_params)
    # completions given a list of prompts: all of them (`inputs` is the first), each answered by n choices
    batch: tuple[PromptInput, ...] = ()
    group: str | None = None        # a part's: the id (the gateway's own) of the request it is a prompt of

    @property
    def parts(self) -> list[InferenceRequest]:
        """What the nodes are sent: one request per prompt, prompt i's id ending in /i, which no client's
        id does (itself alone)."""
        if len(self.batch) < 2:
            return [self]
        group = f"{self.org}/{uuid.uuid4().hex}"   # not the client's id: a reused one would join another group
        return [replace(self, inputs=x, batch=(), request_id=f"{self.request_id}/{i}", group=group)
                for i, x in enumerate(self.batch)]

    @property
    def num_choices(self) -> int:
        """Choices of the answer: n per prompt, prompt i's numbered from i × n."""
        return max(1, len(self.batch)) * self.params.n

    @property
    def estimated_tokens(self) -> int:
        """The prompts' tokens, estimated (app/inference's PromptInput.estimated_tokens)."""
        return sum(x.estimated_tokens for x in self.batch or (self.inputs,))

    def token_cost(self) -> int:
        """Tokens reserved in the org's bucket: the prompts + their choices × max_tokens."""
        return self.estimated_tokens + self.num_choices * self.params.max_tokens

    @property
    def node_request_id(self) -> str:
        """The id on the engine node: the client's X-Request-Id may repeat across orgs, so the node
        sees it under the org's name (a slash never occurs in a client's id)."""
        return f"{self.org}/{self.request_id}"

    def generate_request(self, stream: bool) -> GenerateRequest:
        """What the node is sent: POST /v1/generate's body."""
        return GenerateRequest(
            request_id=self.node_request_id, model=self.model.model, quantization=self.model.quantization,
            org=self.org, latency_class=self.latency_class, sampling=self.params, stream=stream,
            chat_template=self.model.chat_template if self.inputs.messages is not None else None,
            group=self.group, **self.inputs.to_node())
