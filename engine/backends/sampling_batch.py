"""What a backend's `sample` takes and returns: the rows of one step (RowSpec) packed into per-row
arrays (SamplingBatch), and the sampled tokens with their logprobs (SampleResult)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.sampling import SamplingParams


@dataclass
class RowSpec:
    """One sequence to sample this step, as the engine describes it."""
    params: SamplingParams
    seed: int            # always set: the engine draws one for unseeded requests
    step: int            # tokens this sequence has generated so far
    prompt_token_ids: Sequence[int] = ()   # read only when the params have penalties
    output_token_ids: Sequence[int] = ()
    eos_token_ids: Sequence[int] = ()
    banned_token_ids: Sequence[int] = ()   # never sampled: the model's logits past the tokenizer's tokens
    allowed_row: int = -1  # row of the batch's allowed-token mask (a constrained sequence); -1: none


def _csr(parts: list[np.ndarray | None], dtype) -> tuple[np.ndarray, np.ndarray]:
    """Rows' arrays (None = empty) -> (indptr int64 [S+1], values)."""
    lens = np.fromiter((0 if p is None else len(p) for p in parts), np.int64, len(parts))
    indptr = np.zeros(len(parts) + 1, np.int64)
    np.cumsum(lens, out=indptr[1:])
    present = [p for p in parts if p is not None and len(p)]
    values = np.concatenate(present).astype(dtype, copy=False) if present else np.zeros(0, dtype)
    return indptr, np.ascontiguousarray(values)


@dataclass
class SamplingBatch:
    """Per-row arrays of one sampling step (S rows). CSR arrays hold entries only for rows that need them."""
    temperature: np.ndarray        # f32 [S], 0 for greedy rows
    top_p: np.ndarray              # f32 [S]
    top_k: np.ndarray              # i32 [S], 0 = off
    min_p: np.ndarray              # f32 [S]
    repetition_penalty: np.ndarray  # f32 [S]
    presence_penalty: np.ndarray   # f32 [S]
    frequency_penalty: np.ndarray  # f32 [S]
    seed: np.ndarray               # u64 [S]
    step: np.ndarray               # i64 [S]
    num_logprobs: np.ndarray       # i32 [S], 0 when none asked
    bias_indptr: np.ndarray        # i64 [S+1]
    bias_token_ids: np.ndarray     # i32 [nnz]
    bias_values: np.ndarray        # f32 [nnz]
    mask_indptr: np.ndarray        # i64 [S+1]   tokens banned this step (EOS/stop ids under min_tokens)
    mask_token_ids: np.ndarray     # i32 [nnz]
    hist_indptr: np.ndarray        # i64 [S+1]   token history of rows with penalties: prompt then output
    hist_token_ids: np.ndarray     # i32 [nnz]
    hist_num_prompt: np.ndarray    # i32 [S]     how many of a row's history tokens are prompt tokens
    allowed_row: np.ndarray | None = None   # i32 [S]  row of allowed_mask, -1 for an unconstrained row
    allowed_mask: np.ndarray | None = None  # u32 [R, ceil(V/32)]  bit t % 32 of word t // 32: t allowed
    max_num_logprobs: int = 0      # K of the result
    max_token_id: int = -1         # largest token id in the CSR arrays (checked against the vocabulary)

    @property
    def num_rows(self) -> int:
        return len(self.temperature)

    def check_logits_shape(self, shape) -> None:
        """Logits for this batch are [num_rows, vocab] with every token id of the batch inside the vocab."""
        if len(shape) != 2 or shape[0] != self.num_rows:
            raise ValueError(f"logits must be [{self.num_rows}, vocab], got shape {tuple(shape)}")
        if self.max_token_id >= shape[1]:
            raise ValueError(f"token id {self.max_token_id} in the sampling batch is out of range for a "
                             f"vocabulary of {shape[1]}")
        if self.constrained and self.allowed_mask.shape[1] * 32 < shape[1]:
            raise ValueError(f"the allowed-token mask covers {self.allowed_mask.shape[1] * 32} tokens, fewer "
                             f"than the vocabulary of {shape[1]}")

    @property
    def constrained(self) -> bool:
        return self.allowed_mask is not None and len(self.allowed_mask) > 0

    @classmethod
    def build(cls, rows: list[RowSpec], allowed_mask: np.ndarray | None = None) -> SamplingBatch:
        """The batch of `rows`; allowed_mask [R, words] uint32 holds the rows that RowSpec.allowed_row name."""
        S = len(rows)
        f32 = lambda get: np.fromiter((get(r.params) for r in rows), np.float32, S)  # noqa: E731
        temperature = f32(lambda p: 0.0 if p.greedy else p.temperature)
        top_k = np.fromiter((min(max(r.params.top_k, 0), 2**31 - 1) for r in rows), np.int32, S)
        num_logprobs = np.fromiter((r.params.logprobs or 0 for r in rows), np.int32, S)
        seed = np.fromiter((r.seed & 0xFFFFFFFFFFFFFFFF for r in rows), np.uint64, S)
        step = np.fromiter((r.step for r in rows), np.int64, S)

        bias, mask, hist = [None] * S, [None] * S, [None] * S
        bias_vals = [None] * S
        num_prompt = np.zeros(S, np.int32)
        for i, r in enumerate(rows):
            p = r.params
            if p.logit_bias:
                bias[i] = np.fromiter(p.logit_bias.keys(), np.int32, len(p.logit_bias))
                bias_vals[i] = np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias))
            banned = list(r.banned_token_ids)
            if r.step < p.min_tokens:
                banned += list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
            if banned:
                mask[i] = np.asarray(banned, np.int32)
            if p.repetition_penalty != 1.0:
                hist[i] = np.concatenate([np.asarray(r.prompt_token_ids, np.int32).ravel(),
                                          np.asarray(r.output_token_ids, np.int32).ravel()])
                num_prompt[i] = len(r.prompt_token_ids)
            elif p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
                hist[i] = np.asarray(r.output_token_ids, np.int32).ravel()
        bias_indptr, bias_ids = _csr(bias, np.int32)
        _, bias_values = _csr(bias_vals, np.float32)
        mask_indptr, mask_ids = _csr(mask, np.int32)
        hist_indptr, hist_ids = _csr(hist, np.int32)
        ids = [a for a in (bias_ids, mask_ids, hist_ids) if a.size]
        if any(a.min() < 0 for a in ids):
            raise ValueError("token ids must be >= 0")
        allowed_row = np.fromiter((r.allowed_row for r in rows), np.int32, S)
        if allowed_mask is None:
            allowed_mask = np.zeros((0, 1), np.uint32)
        if S and allowed_row.max() >= len(allowed_mask):
            raise ValueError(f"allowed_row {allowed_row.max()} is past the mask's {len(allowed_mask)} rows")
        return cls(
            temperature=temperature, top_p=f32(lambda p: p.top_p), top_k=top_k, min_p=f32(lambda p: p.min_p),
            repetition_penalty=f32(lambda p: p.repetition_penalty),
            presence_penalty=f32(lambda p: p.presence_penalty),
            frequency_penalty=f32(lambda p: p.frequency_penalty),
            seed=seed, step=step, num_logprobs=num_logprobs,
            bias_indptr=bias_indptr, bias_token_ids=bias_ids, bias_values=bias_values,
            mask_indptr=mask_indptr, mask_token_ids=mask_ids,
            hist_indptr=hist_indptr, hist_token_ids=hist_ids, hist_num_prompt=num_prompt,
            allowed_row=allowed_row, allowed_mask=np.ascontiguousarray(allowed_mask, np.uint32),
            max_num_logprobs=int(num_logprobs.max()) if S else 0,
            max_token_id=max((int(a.max()) for a in ids), default=-1),
        )


@dataclass
class SampleResult:
    token_ids: np.ndarray      # i64 [S]
    logprobs: np.ndarray       # f32 [S]     log-probability of the chosen token (raw logits)
    top_token_ids: np.ndarray  # i64 [S, K]  K = max logprobs asked in the batch; -1 past a row's own count
    top_logprobs: np.ndarray   # f32 [S, K]  descending; -inf past a row's own count

    @classmethod
    def empty(cls, num_rows: int, k: int) -> "SampleResult":
        """A result for num_rows rows and k top logprobs, filled in by a sampler."""
        return cls(token_ids=np.zeros(num_rows, np.int64), logprobs=np.zeros(num_rows, np.float32),
                   top_token_ids=np.full((num_rows, k), -1, np.int64),
                   top_logprobs=np.full((num_rows, k), -np.inf, np.float32))

