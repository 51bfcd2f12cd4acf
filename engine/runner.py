"""ModelRunner: one engine step on the device — batch metadata, the model forward, sampling."""
from __future__ import annotations

import numpy as np

from engine.backends.sampling_batch import RowSpec, SampleResult, SamplingBatch
from engine.sequence import Sequence
from models.llama import LlamaModel, StepInput


class ModelRunner:
    def __init__(self, model: LlamaModel, block_size: int, num_blocks: int, eos_token_ids: list[int]):
        self.model = model
        self.backend = model.backend
        self.block_size = block_size
        self.eos_token_ids = list(eos_token_ids)
        self.k_cache, self.v_cache = model.allocate_kv_cache(num_blocks, block_size)
        # pure decode steps in one device call where the backend has one (None: forward + sample)
        self.fused_decode = self.backend.fused_decode(model, self.k_cache, self.v_cache)

    def build_step(self, scheduled: list[tuple[Sequence, int]]) -> tuple[StepInput, list[Sequence]]:
        """Flatten the scheduled chunks into one token batch; the sequences whose chunk reaches their
        last token are the ones that sample."""
        bs = self.block_size
        ntok = sum(n for _, n in scheduled)
        tokens = np.empty(ntok, np.int32)
        positions = np.empty(ntok, np.int32)
        token_seq = np.empty(ntok, np.int32)
        max_blocks = max(len(s.block_table) for s, _ in scheduled)
        block_tables = np.zeros((len(scheduled), max_blocks), np.int32)
        logits_indices, sampling = [], []
        t = 0
        for row, (seq, n) in enumerate(scheduled):
            start = seq.num_computed_tokens
            tokens[t:t + n] = seq.token_ids[start:start + n]
            positions[t:t + n] = np.arange(start, start + n, dtype=np.int32)
            token_seq[t:t + n] = row
            block_tables[row, :len(seq.block_table)] = seq.block_table
            t += n
            if start + n == seq.num_tokens:
                logits_indices.append(t - 1)
                sampling.append(seq)
        slot_mapping = (block_tables[token_seq, positions // bs].astype(np.int64) * bs + positions % bs)
        step = StepInput(tokens, positions, token_seq, slot_mapping, block_tables,
                         np.asarray(logits_indices, np.int32))
        return step, sampling

    def takes_fused(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        """A pure decode step (every sequence one token, its last) that the fused decode step holds."""
        return (self.fused_decode is not None and self.fused_decode.bucket(len(scheduled)) is not None
                and all(n == 1 and s.num_computed_tokens + 1 == s.num_tokens for s, n in scheduled))

    def execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], SampleResult | None]:
        step, sampling = self.build_step(scheduled)
        if self.takes_fused(scheduled):
            return sampling, self.fused_decode.run(step, self.sampling_batch(sampling))
        b = self.backend
        logits = self.model.forward(
            StepInput(*(b.upload(a) for a in (step.tokens, step.positions, step.token_seq, step.slot_mapping,
                                               step.block_tables, step.logits_indices))),
            self.k_cache, self.v_cache)
        if not sampling:
            return [], None
        return sampling, b.sample(logits, self.sampling_batch(sampling))

    def sampling_batch(self, sampling: list[Sequence]) -> SamplingBatch:
        """The sampler's arrays for the sequences that sample this step."""
        rows = []
        for s in sampling:
            p = s.request.sampling
            history = p.needs_history  # copy token lists only for rows whose penalties read them
            rows.append(RowSpec(params=p, seed=s.seed, step=s.num_output_tokens,
                                prompt_token_ids=s.token_ids[:s.num_prompt_tokens] if history else (),
                                output_token_ids=s.output_token_ids if history else (),
                                eos_token_ids=self.eos_token_ids))
        return SamplingBatch.build(rows)
