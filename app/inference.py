"""The inference request r = (m, x, θ, τ) as the gateway forwards it to an engine node.

m: the resolved model (alias → model id + quantization), x: the input (text prompt, token
ids or chat messages), θ: the sampling parameters, τ: the latency class. `to_node_payload`
writes it in the node protocol of POST {node}/v1/generate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from app.catalog import ResolvedModel
from app.priority import LatencyClass

# Rough upper estimate of BPE tokens per UTF-8 byte, used only to reserve prompt tokens in
# the org's token bucket before a node has tokenized the prompt; the reservation is settled
# with the node's real count when the request ends.
_BYTES_PER_TOKEN = 3
_TOKENS_PER_MESSAGE = 4      # chat-template overhead per message (role markers)
_TOKENS_PER_CONVERSATION = 3


@dataclass(frozen=True)
class SamplingParams:
    """θ: the sampling parameters, named as the node protocol names them."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None     # None: no logprobs; k: the chosen token's and k alternatives

    def to_node(self) -> dict[str, Any]:
        # Shallow: asdict() deep-copies every field, a cost on each request's path for nothing.
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        return out


@dataclass(frozen=True)
class PromptInput:
    """x: exactly one of a text prompt, prompt token ids or chat messages."""

    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None   # (role, content)

    def __post_init__(self) -> None:
        given = sum(v is not None for v in (self.prompt, self.prompt_token_ids, self.messages))
        assert given == 1, "exactly one of prompt, prompt_token_ids, messages"

    def estimated_tokens(self) -> int:
        """An upper estimate of the prompt's token count (exact for token ids)."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        if self.prompt is not None:
            return max(1, math.ceil(len(self.prompt.encode()) / _BYTES_PER_TOKEN))
        return _TOKENS_PER_CONVERSATION + sum(
            _TOKENS_PER_MESSAGE + math.ceil(len(content.encode()) / _BYTES_PER_TOKEN)
            for _, content in self.messages)

    def to_node(self) -> dict[str, Any]:
        if self.prompt is not None:
            return {"prompt": self.prompt}
        if self.prompt_token_ids is not None:
            return {"prompt_token_ids": list(self.prompt_token_ids)}
        return {"messages": [{"role": r, "content": c} for r, c in self.messages]}


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

    def token_cost(self) -> int:
        """Tokens reserved in the org's bucket: prompt + n × max_tokens."""
        return self.inputs.estimated_tokens() + self.params.n * self.params.max_tokens

    @property
    def node_request_id(self) -> str:
        """The id on the engine node: the client's X-Request-Id may repeat across orgs, so the node
        sees it under the org's name (a slash never occurs in a client's id)."""
        return f"{self.org}/{self.request_id}"

    def to_node_payload(self) -> dict[str, Any]:
        return {
            "request_id": self.node_request_id,
            "model": self.model.model,
            "quantization": self.model.quantization,
            "org": self.org,
            "latency_class": self.latency_class.value,
            **self.inputs.to_node(),
            "sampling": self.params.to_node(),
            "stream": self.stream,
        }
