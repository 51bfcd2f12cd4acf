"""ModelRunner: one engine step on the device — batch metadata, the model forward, sampling.

The allowed-token masks of constrained sequences are computed on another thread while the forward pass
runs (the kernels and llguidance both release the GIL), and go to the sampler as one packed array."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from engine.backends.sampling_batch import RowSpec, SampleResult, SamplingBatch
from engine.grammar import GrammarCompiler
from engine.sequence import Sequence
from models.llama import LlamaModel, StepInput


class ModelRunner:
    def __init__(self, model: LlamaModel, block_size: int, num_blocks: int, eos_token_ids: list[int],
                 grammars: GrammarCompiler | None = None, banned_token_ids: tuple[int, ...] = ()):
        """banned_token_ids: never sampled (a model's padding logits, past its tokenizer's tokens)."""
        self.model = model
        self.backend = model.backend
        self.block_size = block_size
        self.eos_token_ids = list(eos_token_ids)
        self.banned_token_ids = tuple(banned_token_ids)
        self.k_cache, self.v_cache = model.allocate_kv_cache(num_blocks, block_size)
        self.grammars = grammars
        self._mask_thread: ThreadPoolExecutor | None = None   # started by the first constrained step
        # pure decode steps in one device call where the backend has one (None: forward + sample)
        self.fused_decode = self.backend.fused_decode(model, self.k_cache, self.v_cache)

    def close(self) -> None:
        if self._mask_thread is not None:
            self._mask_thread.shutdown(wait=True)
            self._mask_thread = None

    def release(self) -> None:
        """Close, and drop everything on the device: the weights, the KV cache and the fused decode's
        stacked copies of both (the only copy of the layers' weights on a GPU)."""
        self.close()
        self.k_cache = self.v_cache = self.model = self.fused_decode = None

    def _start_masks(self, sampling: list[Sequence]) -> tuple[np.ndarray, Future] | None:
        """The constrained rows' masks, computed on the mask thread from now (None: no row is constrained)."""
        grammars = [s.grammar for s in sampling if s.grammar is not None]
        if not grammars:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        masks = self.grammars.allocate_masks(len(grammars))
        return masks, self._mask_thread.submit(self.grammars.fill_masks, grammars, masks)

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
        if self.model.window_groups:
            self._window_tables(step, scheduled, max_blocks)
        return step, sampling

    def _window_tables(self, step: StepInput, scheduled, max_blocks: int) -> None:
        """The local layer groups' tables and slots (blocks out of the window read as 0: never used)."""
        bs = self.block_size
        tables = np.zeros((self.model.window_groups, len(scheduled), max_blocks), np.int32)
        for row, (seq, _) in enumerate(scheduled):
            for g, table in enumerate(seq.window_tables):
                tables[g, row, :len(table)] = table
        np.maximum(tables, 0, out=tables)
        pos = step.positions
        step.window_block_tables = tables
        step.window_slot_mapping = (tables[:, step.token_seq, pos // bs].astype(np.int64) * bs + pos % bs)

    def takes_fused(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        """A pure decode step (every sequence one token, its last) that the fused decode step holds."""
        return (self.fused_decode is not None and self.fused_decode.bucket(len(scheduled)) is not None
                and all(n == 1 and s.num_computed_tokens + 1 == s.num_tokens for s, n in scheduled))

    def execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], SampleResult | None]:
        step, sampling = self.build_step(scheduled)
        pending = self._start_masks(sampling)
        if self.takes_fused(scheduled):
            return sampling, self.fused_decode.run(step, self.sampling_batch(sampling, self._masks(pending)))
        b = self.backend
        logits = self.model.forward(StepInput(*(None if a is None else b.upload(a) for a in step.arrays())),
                                    self.k_cache, self.v_cache)
        if not sampling:
            return [], None
        return sampling, b.sample(logits, self.sampling_batch(sampling, self._masks(pending)))

    @staticmethod
    def _masks(pending: tuple[np.ndarray, Future] | None) -> np.ndarray | None:
        """The constrained rows' masks once the mask thread has filled them (None: no row is constrained)."""
        if pending is None:
            return None
        masks, done = pending
        done.result()
        return masks

    def sampling_batch(self, sampling: list[Sequence], masks: np.ndarray | None = None) -> SamplingBatch:
        """The sampler's arrays for the sequences that sample this step (masks: the constrained rows' packed
        allowed-token masks, in order)."""
        rows = []
        constrained = 0
        for s in sampling:
            p = s.request.sampling
            history = p.needs_history  # copy token lists only for rows whose penalties read them
            allowed = -1
            if s.grammar is not None:
                allowed, constrained = constrained, constrained + 1
            rows.append(RowSpec(params=p, seed=s.seed, step=s.num_output_tokens,
                                prompt_token_ids=s.token_ids[:s.num_prompt_tokens] if history else (),
                                output_token_ids=s.output_token_ids if history else (),
                                eos_token_ids=self.eos_token_ids, banned_token_ids=self.banned_token_ids,
                                allowed_row=allowed))
        return SamplingBatch.build(rows, masks)
