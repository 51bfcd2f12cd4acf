"""Engine: add_request / abort / step over one model — the loop that a node's thread (or LLM) drives."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.backends import get_backend
from engine.backends.sampling_batch import RowSpec, SamplingBatch
from engine.config import EngineConfig
from engine.grammar import GrammarCompiler
from engine.heap import release_free_heap
from engine.kv_cache import BlockPool, KVCacheManager
from engine.request import EngineRequest
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, TokenLogprob
from engine.stop import StopChecker
from models.build import build_model
from models.llama import StepInput
from models.loader import load_model
from models.tokenizer import IncrementalDetokenizer

log = logging.getLogger("engine")


class RequestError(ValueError):
    """A request that can never run (bad parameters, prompt over the context); `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def duplicate_request_id(request_id: str) -> RequestError:
    return RequestError(f"request id {request_id!r} is already in use", param="request_id",
                        code="duplicate_request_id")


@dataclass
class SequenceDelta:
    """What one step added to one sequence of a request (stream it; the last one has finish_reason)."""
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    finish_message: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0   # prompt tokens found in the prefix cache
    times: object = None   # SequenceTimes of the sequence

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _Output:
    """Per-sequence output state: incremental text and stop strings."""

    def __init__(self, seq: Sequence, tokenizer):
        p = seq.request.sampling
        self.detok = IncrementalDetokenizer(tokenizer, seq.token_ids[:seq.num_prompt_tokens],
                                            skip_special_tokens=p.skip_special_tokens)
        self.stop = StopChecker(p.stop or [], p.include_stop_str_in_output)
        self.stop_ids = set(p.stop_token_ids or [])


def warm_up_fused(fused, max_num_seqs: int) -> list:
    """Run each variant of the one-launch decode step that steps of at most max_num_seqs sequences take, once
    (each builds its kernel on its first run), all rows on the KV cache's first block, which holds nothing
    yet; the SampleResults."""
    results = []
    for n in fused.variant_batches(max_num_seqs):
        z = np.zeros(n, np.int32)
        rows = np.arange(n, dtype=np.int32)
        results.append(fused.run(StepInput(z, z, rows, z.astype(np.int64), z[:, None], rows),
                                 SamplingBatch.build([RowSpec(SamplingParams(temperature=0.0), seed=0, step=0)] * n)))
    return results


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        t0 = time.monotonic()
        weights, self.tokenizer = load_model(config.model, config.quantization)
        self.backend = get_backend(config.backend)
        self.model = build_model(weights, self.backend)
        self.model_config = weights.config
        self.model_id = config.model_id or Path(config.model).name.split(".")[0]
        self.formats = sorted(weights.formats())
        self.weight_bytes = self.model.nbytes   # in the backend's layout (5- and 6-bit codes take a byte there)
        del weights
        self.max_model_len = min(config.max_model_len or self.model_config.max_position, self.model_config.max_position)
        self.kv_block_bytes = self.model.kv_bytes_per_block(config.block_size)   # kept: release() drops the model
        num_blocks = config.kv_cache_bytes // self.kv_block_bytes
        self.pool = BlockPool(int(num_blocks))
        self.kv = KVCacheManager(self.pool, config.block_size, self.model_id, config.enable_prefix_caching,
                                 self.model.window_groups, self.model_config.sliding_window)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        # the longest sequence: the context, or what the whole KV pool holds if that is less
        self.max_seq_tokens = min(self.max_model_len, self.kv.max_tokens(config.scheduler.max_num_batched_tokens))
        self.eos_token_ids = sorted(set(self.tokenizer.stop_token_ids))
        self.grammars = self._grammar_compiler()
        # a padded model (more logits than its tokenizer has tokens) never samples the padding
        self.num_text_tokens = min(self.model_config.vocab_size, self.tokenizer.vocab_size)
        self.runner = ModelRunner(self.model, config.block_size, self.pool.num_blocks, self.eos_token_ids,
                                  self.grammars, tuple(range(self.num_text_tokens, self.model_config.vocab_size)))
        self.warm_up()
        release_free_heap()   # what the load freed (the file's tensors, repacking's temporaries)
        self.load_time_s = time.monotonic() - t0
        self._seq_ids = itertools.count()
        self._requests: dict[str, list[Sequence]] = {}
        self._outputs: dict[int, _Output] = {}
        self.num_steps = 0
        self.last_step_tokens = 0
        self.last_batch_size = 0
        self.num_preemptions = 0   # sequences sent back to the queue for recompute (blocks ran out)

    def warm_up(self) -> None:
        """Run each kernel variant once (decode, small and large prefill, sampling) so numba's compiled
        code is loaded now rather than during the first requests. It writes only into the KV cache's
        first blocks, which hold nothing yet."""
        bs = self.config.block_size
        for n in (1, 8, 64):
            n = min(n, self.pool.num_blocks * bs)
            pos = np.arange(n, dtype=np.int32)
            step = StepInput(np.zeros(n, np.int32), pos, np.zeros(n, np.int32), pos.astype(np.int64),
                             np.arange(-(-n // bs), dtype=np.int32)[None, :], np.array([n - 1], np.int32))
            if self.model.window_groups:   # every group on the same blocks: this step's K/V are never read
                g = self.model.window_groups
                step.window_slot_mapping = np.repeat(step.slot_mapping[None], g, axis=0)
                step.window_block_tables = np.repeat(step.block_tables[None], g, axis=0)
            b = self.backend
            logits = self.model.forward(StepInput(*(None if a is None else b.upload(a) for a in step.arrays())),
                                        self.runner.k_cache, self.runner.v_cache)
            b.sample(logits, SamplingBatch.build([RowSpec(SamplingParams(temperature=0.0), seed=0, step=0)]))
        if self.runner.fused_decode is not None:
            warm_up_fused(self.runner.fused_decode, self.config.scheduler.max_num_seqs)

    def _grammar_compiler(self) -> GrammarCompiler | None:
        """Structured outputs for this model's tokenizer (None, logged, if llguidance cannot take it)."""
        try:
            return GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        except (ValueError, RuntimeError) as e:
            log.warning("structured outputs are off for %s: %s", self.model_id, e)
            return None

    def release(self) -> None:
        """Drop the weights and the KV cache, once nothing steps this engine any more: their memory
        goes now, whatever else still refers to the engine object."""
        self.runner.release()
        self.model = None

    # ------------------------------------------------------------------------------------ requests
    def validate(self, request: EngineRequest) -> None:
        n = len(request.prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < self.num_text_tokens for t in request.prompt_token_ids):
            raise RequestError(f"prompt token ids must be in [0, {self.num_text_tokens})", param="prompt")
        if n >= self.max_model_len:
            raise RequestError(
                f"the prompt has {n} tokens; this model's context is {self.max_model_len} tokens "
                f"and at least one must be left to generate", param="prompt", code="context_length_exceeded")
        p = request.sampling
        room = self.max_seq_tokens - n
        if p.max_tokens_default and p.max_tokens is not None and max(1, p.min_tokens) <= room < p.max_tokens:
            p = request.sampling = dataclasses.replace(p, max_tokens=room)
        try:
            p.validate_for(vocab_size=vocab, max_model_len=self.max_model_len, prompt_len=n)
        except ValueError as e:
            raise RequestError(str(e), param=getattr(e, "param", None),
                               code="context_length_exceeded" if "context" in str(e) else None) from None
        # A sequence must fit the KV pool alone, or preemption could never make room for it.
        if n + 1 > self.max_seq_tokens:
            raise RequestError(f"the prompt has {n} tokens; this node's KV cache holds {self.max_seq_tokens} "
                               f"tokens for one sequence", param="prompt", code="context_length_exceeded")
        if p.max_tokens is not None and n + p.max_tokens > self.max_seq_tokens:
            raise RequestError(f"max_tokens ({p.max_tokens}) plus the prompt's {n} tokens exceeds the "
                               f"{self.max_seq_tokens} tokens this node's KV cache holds for one sequence; "
                               f"use max_tokens <= {self.max_seq_tokens - n}", param="max_tokens",
                               code="context_length_exceeded")
        if n + p.min_tokens > self.max_seq_tokens:   # else it ends at the pool's limit, short of min_tokens
            raise RequestError(f"min_tokens ({p.min_tokens}) plus the prompt's {n} tokens exceeds the "
                               f"{self.max_seq_tokens} tokens this node's KV cache holds for one sequence; "
                               f"use min_tokens <= {self.max_seq_tokens - n}", param="min_tokens",
                               code="context_length_exceeded")
        if request.request_id in self._requests:
            raise duplicate_request_id(request.request_id)
        if p.structured_output is not None and request.grammar is None:
            request.grammar = self._compile(p.structured_output)

    def _compile(self, spec: dict):
        if self.grammars is None:
            raise RequestError("this model's tokenizer does not support structured outputs",
                               param="structured_output", code="unsupported_parameter")
        try:
            return self.grammars.compile(spec)
        except ValueError as e:
            raise RequestError(str(e), param=getattr(e, "param", "structured_output")) from None

    def add_request(self, request: EngineRequest) -> None:
        """Validate, then queue the request's n sequences (raises RequestError, nothing queued)."""
        self.validate(request)
        p = request.sampling
        seqs = []
        for i in range(p.n):
            seed = (p.seed + i) if p.seed is not None else random.getrandbits(63)
            seq = Sequence(next(self._seq_ids), request, i, seed)
            if request.grammar is not None:
                seq.grammar = self.grammars.new_grammar(request.grammar)
            if seqs:
                seq.prefill_leader = seqs[0]
            seqs.append(seq)
        outputs = [_Output(seq, self.tokenizer) for seq in seqs]
        for seq, output in zip(seqs, outputs):   # all built first: a failure above queues nothing
            self._outputs[seq.seq_id] = output
            self.scheduler.add(seq)
        self._requests[request.request_id] = seqs

    def abort(self, request_id: str) -> list[SequenceDelta]:
        """Finish every unfinished sequence of the request at once (its blocks go back to the pool); one
        finished delta for each of those (the others had theirs)."""
        deltas = []
        for seq in self._requests.pop(request_id, []):
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                deltas.append(self._delta(seq, [], "", []))
            self._outputs.pop(seq.seq_id, None)
        return deltas

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---------------------------------------------------------------------------------------- step
    def step(self) -> list[SequenceDelta]:
        out = self.scheduler.schedule()
        deltas = [self._finished_delta(seq) for seq in out.timed_out]
        self.last_step_tokens = out.num_tokens
        self.last_batch_size = len(out.scheduled)
        self.num_preemptions += len(out.preempted)
        if not out.scheduled:
            return deltas
        sampled, result = self.runner.execute(out.scheduled)
        self.num_steps += 1
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            self.kv.cache_computed_blocks(seq)
            self.kv.release_out_of_window(seq)
        now = time.monotonic()
        for row, seq in enumerate(sampled):
            deltas.append(self._append(seq, row, result, now))
        return deltas

    def _append(self, seq: Sequence, row: int, result, now: float) -> SequenceDelta:
        token = int(result.token_ids[row])
        p = seq.request.sampling
        o = self._outputs[seq.seq_id]
        seq.append_token(token, now)
        grammar_done, message = self._advance_grammar(seq, token) if seq.grammar is not None else (False, None)
        lp = []
        if p.logprobs is not None:
            k = p.logprobs
            entry = TokenLogprob(token, float(result.logprobs[row]),
                                 [(int(i), float(v)) for i, v in zip(result.top_token_ids[row][:k],
                                                                     result.top_logprobs[row][:k])])
            seq.logprobs.append(entry)
            lp.append(entry)
        long_enough = seq.num_output_tokens >= p.min_tokens
        # a stop token ends the text before it, as a stop string does; under min_tokens nothing stops
        stop_token = long_enough and (token in o.stop_ids or (not p.ignore_eos and token in self.eos_token_ids))
        piece = "" if stop_token else o.detok.push(token)
        held = o.stop.held_chars   # earlier tokens' text this push may still emit
        text, stopped = o.stop.push(piece, may_stop=long_enough)
        reason = None
        if message is not None:   # the grammar broke down: what follows would not conform
            reason = "error"
        elif stopped or grammar_done or stop_token:
            reason = "stop"
        elif p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            reason = "length"
        elif seq.num_tokens >= self.max_seq_tokens:
            reason = "length"
        if lp and (stop_token or (stopped and len(text) <= held)   # none of this token's own text is output
                   or (p.skip_special_tokens and token in self.tokenizer.special_token_ids)):
            lp[0].skipped = True
        if reason is not None:
            if not stopped:  # the stream ends: release held-back bytes and stop-string prefixes
                tail, stopped = o.stop.push(o.detok.flush(), may_stop=long_enough)
                text += tail if stopped else tail + o.stop.flush()
                reason = "stop" if stopped and reason != "error" else reason
            self.scheduler.finish(seq, reason, message)
            return self._finished_delta(seq, [token], text, lp)
        return self._delta(seq, [token], text, lp)

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int) -> tuple[bool, str | None]:
        """Move the sequence's grammar by its token: (done, why). Done when the grammar is complete, or
        broken (the sequence cannot go on, and the message says why)."""
        g = seq.grammar
        if not g.advance(token) or g.failed:   # refused the token, or failed on its next mask
            log.warning("the grammar failed", extra={
                "request_id": seq.request.request_id, "token": token, "error": g.failed})
            return True, f"the structured output could not be enforced past token {token}: {g.failed}"
        return g.finished, None

    def _finished_delta(self, seq: Sequence, tokens=(), text="", lp=()) -> SequenceDelta:
        d = self._delta(seq, list(tokens), text, list(lp))
        self._outputs.pop(seq.seq_id, None)
        seqs = self._requests.get(seq.request.request_id, [])
        if all(s.is_finished for s in seqs):
            self._requests.pop(seq.request.request_id, None)
        return d

    def _delta(self, seq, tokens, text, lp) -> SequenceDelta:
        return SequenceDelta(
            request_id=seq.request.request_id, index=seq.index, token_ids=tokens, text=text, logprobs=lp,
            finish_reason=seq.finish_reason, finish_message=seq.finish_message,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_prompt_tokens, times=seq.times)
