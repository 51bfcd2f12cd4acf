"""LLM: the offline API in the shape users know from vLLM, running on the engine loop."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.engine import Engine, SequenceDelta
from engine.protocol import LatencyClass
from engine.request import EngineRequest
from engine.sampling import SamplingParams
from engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, SchedulerConfig
from engine.sequence import TokenLogprob


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


class LLM:
    """LLM(model=path, quantization=None | 'f32' | 'f16' | 'q8_0' | ...).generate(prompts, params)."""

    def __init__(self, model: str, quantization: str | None = None, backend: str = "auto",
                 kv_cache_bytes: int = 1 << 30, max_model_len: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, block_size: int = 16,
                 enable_prefix_caching: bool = True):
        self.engine = Engine(EngineConfig(
            model=model, quantization=quantization, backend=backend, kv_cache_bytes=kv_cache_bytes,
            max_model_len=max_model_len, block_size=block_size, enable_prefix_caching=enable_prefix_caching,
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 latency_class: LatencyClass = LatencyClass.STANDARD) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either. Returns one output per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        params = params if params is not None else SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, p in zip(prompts, plist):
            rid = f"offline-{next(self._ids)}"
            try:   # a prompt that cannot be read or queued: the ones queued before it go too
                if isinstance(prompt, str):
                    ids, text = self.tokenizer.encode(prompt), prompt
                else:
                    ids, text = [int(t) for t in prompt], None
                self.engine.add_request(EngineRequest(rid, self.engine.model_id, ids, p, latency_class,
                                                         prompt_text=text))
            except Exception:
                for r in order:  # leave the engine as it was
                    self.engine.abort(r)
                raise
            order.append(rid)
            results[rid] = RequestOutput(rid, text, ids, [
                CompletionOutput(i, logprobs=[] if p.logprobs is not None else None) for i in range(p.n)])
        try:
            while self.engine.has_unfinished():
                for d in self.engine.step():
                    self._merge(results[d.request_id], d)
        except BaseException:
            for r in order:
                self.engine.abort(r)
            raise
        return [results[r] for r in order]

    def chat(self, messages, params: SamplingParams | None = None, **kw) -> list[RequestOutput]:
        """messages: one conversation (a list of {role, content}) or a list of conversations."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c, add_generation_prompt=True),
                                         add_special_tokens=False) for c in convs]
        return self.generate(prompts, params, **kw)

    @staticmethod
    def _merge(out: RequestOutput, d: SequenceDelta) -> None:
        c = out.outputs[d.index]
        c.token_ids.extend(d.token_ids)
        c.text += d.text
        if c.logprobs is not None:
            c.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            c.finish_reason = d.finish_reason
