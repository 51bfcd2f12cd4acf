"""Sampling parameters and the sampler: one numba kernel over the whole batch's logits.

Per row, in this order (vLLM/HF semantics):
  1. logit_bias            w[t] += bias[t]
  2. min_tokens            w[t] = -inf for EOS and stop_token_ids while len(output) < min_tokens
  3. repetition_penalty    for t in set(prompt + output): w[t] = w[t] / r if w[t] > 0 else w[t] * r
     frequency_penalty     w[t] -= f * count_output(t)
     presence_penalty      w[t] -= p * [count_output(t) > 0]
  4. temperature 0         token = argmax(w)                      (also for temperature < 1e-5)
     otherwise             z = (w - max w) / T ; top-k, then top-p on the renormalized top-k set,
                           then min-p (keep exp(z) >= min_p) ; draw from softmax(z) over what is kept
Logprobs are vLLM's default: log_softmax of the raw logits (before bias, penalties and temperature).

The draw is a pure function of (seed, step): u = splitmix64(splitmix64(seed) + step) / 2^64, and the
token is the inverse CDF of u over the kept tokens walked in "draw order" (below). No RNG state is
carried, so a seeded request samples the same tokens whatever else is in the batch and wherever its row is.

Nothing sorts the vocabulary. A row is seen as nb = ceil(V / BLOCK) strided blocks (block b holds tokens
b, b + nb, b + 2 nb, ...), so block maxima and block sums are element-wise passes that vectorize; the draw
order is (block, position in block) = (t mod nb, t div nb). Cuts use the order (logit desc, token id asc):
  - top-k and the top logprobs gather candidates through the block maxima: the c-th largest block maximum
    is a lower bound of the c-th largest logit, and the c blocks that reach it hold every logit above it;
  - top-p starts from a few blocks and widens (x8) only while the gathered mass is below p; past
    _TOPP_MAX_BLOCKS (or for top-k > _SMALL_K) the cut runs over the whole row;
  - a cut is a weighted quickselect, after bisection on the logit value when there are many values.
Measured on a 2-core znver4 VM (one thread, V = 49152): greedy ~20 us a row, plain temperature ~40 us,
top-k 50 + top-p ~35 us, top-p over a flat distribution (thousands of tokens kept) ~130-220 us.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

MAX_LOGPROBS = 20          # most top alternatives a request may ask for
MAX_TEMPERATURE = 100.0    # larger values are refused as absurd (OpenAI's own limit is 2)
MAX_REPETITION_PENALTY = 100.0  # and repetition penalties outside [1/100, 100]
MAX_N = 128                # most sequences per request (OpenAI's limit)
GREEDY_EPS = 1e-5          # temperatures below this are greedy (as vLLM)
BLOCK = 64                 # logits per block for the block-maxima candidate search
_TOPP_FIRST_BLOCKS = 4     # top-p's first try gathers this many blocks, then x8 per widening ...
_TOPP_MAX_BLOCKS = 32      # ... up to this many; past it the cut runs over the whole row
_SMALL_K = 1024            # top-k up to this gathers candidates; larger k cuts over the whole row
_BISECT_MIN = 1024         # cuts over more values than this bisect on the value first ...
_BAND = 256                # ... until at most this many values are left for the quickselect


class SamplingParamError(ValueError):
    """A bad sampling parameter; `param` names it (the API layer puts it in OpenAI's error shape)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


# --------------------------------------------------------------------------- parameters

def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return (isinstance(x, (int, float, np.integer, np.floating))
            and not isinstance(x, (bool, np.bool_)))


def _int(name: str, x, lo: int | None = None, hi: int | None = None, optional: bool = False):
    if x is None and optional:
        return None
    if not _is_int(x):
        raise SamplingParamError(name, f"{name} must be an integer, got {type(x).__name__} {x!r}")
    x = int(x)
    if lo is not None and x < lo:
        raise SamplingParamError(name, f"{name} must be >= {lo}, got {x}")
    if hi is not None and x > hi:
        raise SamplingParamError(name, f"{name} must be <= {hi}, got {x}")
    return x


def _real(name: str, x, lo: float | None = None, hi: float | None = None) -> float:
    if not _is_real(x):
        raise SamplingParamError(name, f"{name} must be a number, got {type(x).__name__} {x!r}")
    x = float(x)
    if not math.isfinite(x):
        raise SamplingParamError(name, f"{name} must be finite, got {x}")
    if lo is not None and x < lo:
        raise SamplingParamError(name, f"{name} must be >= {lo:g}, got {x:g}")
    if hi is not None and x > hi:
        raise SamplingParamError(name, f"{name} must be <= {hi:g}, got {x:g}")
    return x


def _bool(name: str, x) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise SamplingParamError(name, f"{name} must be a boolean, got {type(x).__name__} {x!r}")
    return bool(x)


@dataclass
class SamplingParams:
    """Generation parameters of one request (θ). Validated and normalized on construction."""
    n: int = 1
    best_of: int | None = None                 # accepted for compatibility, ignored
    temperature: float = 1.0                   # 0 = greedy
    top_p: float = 1.0                         # (0, 1]
    top_k: int = 0                             # 0 or -1 = off
    min_p: float = 0.0                         # [0, 1]
    presence_penalty: float = 0.0              # [-2, 2], on generated tokens
    frequency_penalty: float = 0.0             # [-2, 2], on generated tokens
    repetition_penalty: float = 1.0            # > 0, on prompt + generated tokens
    logit_bias: dict[int, float] | None = None  # token id -> [-100, 100]
    seed: int | None = None
    stop: str | list[str] | None = None        # normalized to a list (empty when None)
    stop_token_ids: list[int] | None = None    # normalized to a list (empty when None)
    max_tokens: int | None = 16                # None = up to the context
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None                # top alternatives, 0..20; 0 = only the chosen token's
    skip_special_tokens: bool = True

    def __post_init__(self):
        self.n = _int("n", self.n, 1, MAX_N)
        self.best_of = _int("best_of", self.best_of, 1, optional=True)
        self.temperature = _real("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        self.top_p = _real("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise SamplingParamError("top_p", "top_p must be in (0, 1], got 0")
        self.top_k = _int("top_k", self.top_k)
        if self.top_k < -1:
            raise SamplingParamError("top_k", f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        self.min_p = _real("min_p", self.min_p, 0.0, 1.0)
        self.presence_penalty = _real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty,
                                        hi=MAX_REPETITION_PENALTY)
        if not self.repetition_penalty >= 1.0 / MAX_REPETITION_PENALTY:
            raise SamplingParamError("repetition_penalty", f"repetition_penalty must be > 0 (at least "
                                     f"{1 / MAX_REPETITION_PENALTY:g}), got {self.repetition_penalty:g}")
        self.logit_bias = self._check_logit_bias(self.logit_bias)
        if self.seed is not None:
            self.seed = _int("seed", self.seed, -(1 << 63), (1 << 64) - 1)
        self.stop = self._check_stop(self.stop)
        self.stop_token_ids = self._check_token_list("stop_token_ids", self.stop_token_ids)
        self.max_tokens = _int("max_tokens", self.max_tokens, 1, optional=True)
        self.min_tokens = _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamError("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                                                   f"({self.max_tokens})")
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        self.logprobs = _int("logprobs", self.logprobs, 0, MAX_LOGPROBS, optional=True)
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)

    @staticmethod
    def _check_logit_bias(bias):
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise SamplingParamError("logit_bias", f"logit_bias must be a mapping of token id to bias, "
                                                   f"got {type(bias).__name__}")
        out: dict[int, float] = {}
        for k, v in bias.items():
            if isinstance(k, str) and k.strip().isdigit():   # JSON object keys arrive as strings
                k = int(k)
            if not _is_int(k) or k < 0:
                raise SamplingParamError("logit_bias", f"logit_bias keys must be token ids (integers >= 0), "
                                                       f"got {k!r}")
            if not _is_real(v) or not math.isfinite(float(v)) or not -100.0 <= float(v) <= 100.0:
                raise SamplingParamError("logit_bias", f"logit_bias values must be numbers in [-100, 100], "
                                                       f"got {v!r} for token {k}")
            out[int(k)] = float(v)
        return out

    @staticmethod
    def _check_stop(stop) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise SamplingParamError("stop", f"stop must be a string or a list of strings, "
                                             f"got {type(stop).__name__}")
        for s in stop:
            if not isinstance(s, str):
                raise SamplingParamError("stop", f"stop must be a string or a list of strings, got a list "
                                                 f"holding {type(s).__name__} {s!r}")
            if not s:
                raise SamplingParamError("stop", "stop strings must not be empty")
        return list(stop)

    @staticmethod
    def _check_token_list(name: str, ids) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise SamplingParamError(name, f"{name} must be a list of token ids, got {type(ids).__name__}")
        for t in ids:
            if not _is_int(t) or t < 0:
                raise SamplingParamError(name, f"{name} must hold token ids (integers >= 0), got {t!r}")
        return [int(t) for t in ids]

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the tokens generated so far (penalties)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate_for(self, vocab_size: int, max_model_len: int, prompt_len: int) -> None:
        """Checks that need the model: token ids within the vocabulary, prompt and output within the context."""
        if self.logit_bias:
            bad = max(self.logit_bias)
            if bad >= vocab_size:
                raise SamplingParamError("logit_bias", f"logit_bias token id {bad} is out of range for a "
                                                       f"vocabulary of {vocab_size} tokens")
        if self.stop_token_ids and max(self.stop_token_ids) >= vocab_size:
            raise SamplingParamError("stop_token_ids", f"stop_token_ids holds {max(self.stop_token_ids)}, out "
                                                       f"of range for a vocabulary of {vocab_size} tokens")
        if prompt_len < 1:
            raise SamplingParamError("prompt", "the prompt must contain at least one token")
        room = max_model_len - prompt_len
        if room < 1:
            raise SamplingParamError("prompt", f"the prompt is {prompt_len} tokens long, which leaves no room "
                                               f"in the model's context of {max_model_len} tokens")
        if self.max_tokens is not None and self.max_tokens > room:
            raise SamplingParamError("max_tokens", f"max_tokens ({self.max_tokens}) plus the prompt's "
                                                   f"{prompt_len} tokens exceeds the model's context length "
                                                   f"of {max_model_len}; use max_tokens <= {room}")
        if self.min_tokens > room:
            raise SamplingParamError("min_tokens", f"min_tokens ({self.min_tokens}) plus the prompt's "
                                                   f"{prompt_len} tokens exceeds the model's context length "
                                                   f"of {max_model_len}")


# --------------------------------------------------------------------------- the batch

@dataclass
class RowSpec:
    """One sequence to sample this step, as the engine describes it."""
    params: SamplingParams
    seed: int            # always set: the engine draws one for unseeded requests
    step: int            # tokens this sequence has generated so far
    prompt_token_ids: Sequence[int] = ()   # read only when the params have penalties
    output_token_ids: Sequence[int] = ()
    eos_token_ids: Sequence[int] = ()


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
    max_num_logprobs: int = 0      # K of the result
    max_token_id: int = -1         # largest token id in the CSR arrays (checked against the vocabulary)

    @property
    def num_rows(self) -> int:
        return len(self.temperature)

    @classmethod
    def build(cls, rows: list[RowSpec]) -> SamplingBatch:
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
            if r.step < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
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
        return cls(
            temperature=temperature, top_p=f32(lambda p: p.top_p), top_k=top_k, min_p=f32(lambda p: p.min_p),
            repetition_penalty=f32(lambda p: p.repetition_penalty),
            presence_penalty=f32(lambda p: p.presence_penalty),
            frequency_penalty=f32(lambda p: p.frequency_penalty),
            seed=seed, step=step, num_logprobs=num_logprobs,
            bias_indptr=bias_indptr, bias_token_ids=bias_ids, bias_values=bias_values,
            mask_indptr=mask_indptr, mask_token_ids=mask_ids,
            hist_indptr=hist_indptr, hist_token_ids=hist_ids, hist_num_prompt=num_prompt,
            max_num_logprobs=int(num_logprobs.max()) if S else 0,
            max_token_id=max((int(a.max()) for a in ids), default=-1),
        )


@dataclass
class SampleResult:
    token_ids: np.ndarray      # i64 [S]
    logprobs: np.ndarray       # f32 [S]     log-probability of the chosen token (raw logits)
    top_token_ids: np.ndarray  # i64 [S, K]  K = max logprobs asked in the batch; -1 past a row's own count
    top_logprobs: np.ndarray   # f32 [S, K]  descending; -inf past a row's own count


# --------------------------------------------------------------------------- kernel helpers

@intrinsic
def _bits_as_f32(typingctx, x):
    """Reinterpret the low 32 bits of an integer as a float32."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if v.type.width > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif v.type.width < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())
    return types.float32(x), codegen


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_MIN = np.float32(-87.0)
_NEG_INF32 = np.float32(-np.inf)


@njit(cache=True, fastmath=True)
def _exp_neg(x):
    """exp(x) for float32 x <= 0 (Cephes expf: ~1 ulp), 0 below -87; branch-free so loops vectorize."""
    xc = max(x, _EXP_MIN)
    n = np.floor(xc * _LOG2E + np.float32(0.5))
    r = xc - n * _LN2_HI - n * _LN2_LO
    y = ((((np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)) * r
           + np.float32(8.3334519073e-3)) * r + np.float32(4.1665795894e-2)) * r
         + np.float32(1.6666665459e-1)) * r + np.float32(5.0000001201e-1)
    y = y * (r * r) + r + np.float32(1.0)
    scale = _bits_as_f32((np.int32(n) + 127) << 23)
    return y * scale if x >= _EXP_MIN else np.float32(0.0)


def _minmax_intrinsic(name):
    def impl(typingctx, a, b):
        if a != types.float32 or b != types.float32:
            return None

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType(), ir.FloatType()])
            fn = cgutils.get_or_insert_function(builder.module, fnty, name)
            return builder.call(fn, args)
        return types.float32(a, b), codegen
    return intrinsic(impl)


# llvm.maxnum / llvm.minnum: a max and min that LLVM vectorizes (numba's max() does not); NaN loses
_fmax = _minmax_intrinsic("llvm.maxnum.f32")
_fmin = _minmax_intrinsic("llvm.minnum.f32")


# Blocks are strided: block b of a row of V logits holds tokens b, b + nb, b + 2 nb, ... (BLOCK of them,
# nb = ceil(V / BLOCK)), so per-block reductions are element-wise over BLOCK contiguous slices of nb
# values and vectorize. A row's "draw order" is (block, position in block) = (t mod nb, t div nb).

@njit(cache=True, fastmath=True)
def _block_max(x, out):
    """out[b] = max of x over block b; returns the overall max."""
    nb, n = out.size, x.size
    for b in range(nb):
        out[b] = x[b]
    for j in range(1, BLOCK):
        lo = j * nb
        if lo >= n:
            break
        xs = x[lo:min(lo + nb, n)]
        for b in range(xs.size):
            out[b] = _fmax(out[b], xs[b])
    m = _NEG_INF32
    for b in range(nb):
        m = _fmax(m, out[b])
    return m


@njit(cache=True, fastmath=True)
def _exp_sum(x, m, inv_t):
    """sum_t exp((x[t] - m) * inv_t), m = max x."""
    s = np.float32(0.0)
    for j in range(x.size):
        s += _exp_neg((x[j] - m) * inv_t)
    return np.float64(s)


@njit(cache=True, fastmath=True)
def _block_kept_sum(x, m, inv_t, min_e, bval, bid, out):
    """out[b] = sum over block b of e = exp((x - m) * inv_t) over kept tokens: those at or before the cut
    (bval, bid) in (value desc, id asc) order with e >= min_e. Returns the total."""
    nb, n = out.size, x.size
    acc = np.zeros(nb, np.float32)
    for j in range(BLOCK):
        lo = j * nb
        if lo >= n:
            break
        xs = x[lo:min(lo + nb, n)]
        for b in range(xs.size):
            v = xs[b]
            e = _exp_neg((v - m) * inv_t)
            kept = (v > bval or (v == bval and lo + b <= bid)) and e >= min_e
            acc[b] += e if kept else np.float32(0.0)
    total = 0.0
    for b in range(nb):
        out[b] = acc[b]
        total += acc[b]
    return total


@njit(cache=True, fastmath=True)
def _mass_ge(vals, wts, thr):
    """(sum of wts, count) over vals >= thr."""
    s = 0.0
    c = 0
    for j in range(vals.size):
        ge = vals[j] >= thr
        s += np.float64(wts[j]) if ge else 0.0
        c += 1 if ge else 0
    return s, c


@njit(cache=True)
def _before(va, ia, vb, ib):
    """Sort order for cuts: larger value first, then smaller token id."""
    return va > vb or (va == vb and ia < ib)


@njit(cache=True)
def _select(vals, ids, wts, n, target):
    """Weighted quickselect: the position (after partial reordering of the arrays) of the first element,
    in (value desc, id asc) order, at which the cumulative weight reaches `target` (the last element
    if it never does). With unit weights and target k it is the k-th element."""
    lo, hi = 0, n
    acc = 0.0
    last = -1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        # median of three as pivot, moved to hi - 1
        a, b, c = lo, mid, hi - 1
        if _before(vals[b], ids[b], vals[a], ids[a]):
            a, b = b, a
        if _before(vals[c], ids[c], vals[b], ids[b]):
            b, c = c, b
            if _before(vals[b], ids[b], vals[a], ids[a]):
                a, b = b, a
        p = b
        vals[p], vals[hi - 1] = vals[hi - 1], vals[p]
        ids[p], ids[hi - 1] = ids[hi - 1], ids[p]
        wts[p], wts[hi - 1] = wts[hi - 1], wts[p]
        pv, pi = vals[hi - 1], ids[hi - 1]
        store = lo
        mass = 0.0
        for j in range(lo, hi - 1):
            if _before(vals[j], ids[j], pv, pi):
                vals[j], vals[store] = vals[store], vals[j]
                ids[j], ids[store] = ids[store], ids[j]
                wts[j], wts[store] = wts[store], wts[j]
                mass += wts[store]
                store += 1
        vals[store], vals[hi - 1] = vals[hi - 1], vals[store]
        ids[store], ids[hi - 1] = ids[hi - 1], ids[store]
        wts[store], wts[hi - 1] = wts[hi - 1], wts[store]
        if acc + mass >= target:
            hi = store
        elif acc + mass + wts[store] >= target:
            return store
        else:
            acc += mass + wts[store]
            last = store
            lo = store + 1
    if hi - lo == 1:
        return lo
    return last if last >= 0 else 0


@njit(cache=True)
def _kth_block_threshold(bmax, c):
    """The c-th largest block maximum (-inf when c >= number of blocks: every logit is a candidate)."""
    nb = bmax.size
    if c >= nb:
        return _NEG_INF32
    vals = np.empty(nb, np.float32)
    ids = np.empty(nb, np.int32)
    wts = np.ones(nb)
    for b in range(nb):
        vals[b], ids[b] = bmax[b], b
    return vals[_select(vals, ids, wts, nb, np.float64(c))]


@njit(cache=True)
def _gather(x, bmax, thr):
    """Token ids and values of every x >= thr, in draw order (only blocks whose max reaches thr are read)."""
    nb, n = bmax.size, x.size
    nblk = 0
    for b in range(nb):
        if bmax[b] >= thr:
            nblk += 1
    ids = np.empty(nblk * BLOCK, np.int32)
    vals = np.empty(nblk * BLOCK, np.float32)
    cnt = 0
    for b in range(nb):
        if bmax[b] >= thr:
            for t in range(b, n, nb):
                if x[t] >= thr:
                    ids[cnt] = t
                    vals[cnt] = x[t]
                    cnt += 1
    return ids[:cnt], vals[:cnt]


@njit(cache=True, fastmath=True)
def _weights(vals, m, inv_t):
    out = np.empty(vals.size, np.float32)
    for j in range(vals.size):
        out[j] = _exp_neg((vals[j] - m) * inv_t)
    return out


@njit(cache=True, fastmath=True)
def _sum64(a):
    s = 0.0
    for j in range(a.size):
        s += a[j]
    return s


@njit(cache=True)
def _argmax(x, bmax, m):
    """First index of the maximum m (blocks located through their maxima)."""
    nb = bmax.size
    best = x.size
    for b in range(nb):
        if bmax[b] == m:
            for t in range(b, min(best, x.size), nb):
                if x[t] == m:
                    best = t
                    break
    return best if best < x.size else 0  # 0: all NaN


@njit(cache=True)
def _uniform01(seed, step):
    """A uniform in [0, 1) that is a pure function of (seed, step): splitmix64 of splitmix64(seed) + step."""
    z = _splitmix64(_splitmix64(np.uint64(seed)) + np.uint64(step))
    return np.float64(z >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@njit(cache=True)
def _splitmix64(x):
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


# --------------------------------------------------------------------------- one row

@njit(cache=True)
def _process_row(w, i, bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids,
                 hist_indptr, hist_ids, hist_num_prompt, rep, pres, freq):
    """Bias, min_tokens mask and penalties applied in place to w (a copy of row i's logits)."""
    for j in range(bias_indptr[i], bias_indptr[i + 1]):
        w[bias_ids[j]] += bias_vals[j]
    for j in range(mask_indptr[i], mask_indptr[i + 1]):
        w[mask_ids[j]] = _NEG_INF32
    h0, h1 = hist_indptr[i], hist_indptr[i + 1]
    if h1 == h0:
        return
    # cnt[t]: generated count in the low bits, DONE once t's penalties are applied
    done = np.int32(1 << 30)
    cnt = np.zeros(w.size, np.int32)
    for j in range(h0 + hist_num_prompt[i], h1):
        cnt[hist_ids[j]] += 1
    r, p, f = rep[i], pres[i], freq[i]
    for j in range(h0, h1):
        t = hist_ids[j]
        c = cnt[t]
        if c & done:
            continue
        cnt[t] = c | done
        v = w[t]
        if r != np.float32(1.0):
            v = v / r if v > np.float32(0.0) else v * r
        if c > 0:
            v = v - f * np.float32(c)
            v = v - p
        w[t] = v


@njit(cache=True, fastmath=True)
def _weighted_range(vals, wts):
    """(min, max) of vals over positive weights."""
    lo = np.float32(np.inf)
    hi = _NEG_INF32
    for j in range(vals.size):
        pos = wts[j] > 0
        lo = _fmin(lo, vals[j] if pos else np.float32(np.inf))
        hi = _fmax(hi, vals[j] if pos else _NEG_INF32)
    return lo, hi


@njit(cache=True)
def _cut(vals, ids, wts, target):
    """The (value, id) of the first element in (value desc, id asc) order at which the cumulative weight
    reaches target (the last weighted element if it never does). An empty ids means ids are positions.
    Many values are first narrowed by bisection on the value (vectorized passes), then a quickselect runs
    on the band that is left."""
    n = vals.size
    lo, hi = _weighted_range(vals, wts)
    acc = 0.0
    if n > _BISECT_MIN and lo < hi:
        m_lo, c_lo = _mass_ge(vals, wts, lo)
        m_hi, c_hi = _mass_ge(vals, wts, hi)
        target = min(target, m_lo)
        if m_hi >= target:      # the cut is among the ties at the top value
            lo, c_lo = hi, c_hi
            hi, m_hi, c_hi = np.float32(np.inf), 0.0, 0
        # invariant: mass(>= lo) >= target > mass(>= hi)
        while c_lo - c_hi > _BAND:
            mid = lo + (hi - lo) * np.float32(0.5)
            if not (lo < mid < hi):
                break
            m_mid, c_mid = _mass_ge(vals, wts, mid)
            if m_mid >= target:
                lo, c_lo = mid, c_mid
            else:
                hi, m_hi, c_hi = mid, m_mid, c_mid
        acc = m_hi
    else:
        lo = _NEG_INF32
        hi = np.float32(np.inf)
    # the band lo <= value < hi, with everything >= hi (mass acc) before it
    nb = 0
    for j in range(n):
        if lo <= vals[j] < hi:
            nb += 1
    bv = np.empty(nb, np.float32)
    bi = np.empty(nb, np.int32)
    bw = np.empty(nb, np.float64)
    c = 0
    identity = ids.size == 0
    for j in range(n):
        if lo <= vals[j] < hi:
            bv[c], bi[c], bw[c] = vals[j], j if identity else ids[j], wts[j]
            c += 1
    pos = _select(bv, bi, bw, bv.size, target - acc)
    return bv[pos], bi[pos]


@njit(cache=True)
def _draw_full(w, bmax, m, inv_t, min_p, bval, bid, u):
    """Inverse CDF of u over every kept token of the row, in draw order (block sums first)."""
    nb = bmax.size
    bsum = np.empty(nb, np.float64)
    total = _block_kept_sum(w, m, inv_t, min_p, bval, bid, bsum)
    target = u * total
    cum = 0.0
    b = 0
    while b < nb - 1 and (cum + bsum[b] <= target or bsum[b] == 0.0):
        cum += bsum[b]
        b += 1
    last = -1
    for t in range(b, w.size, nb):
        v = w[t]
        e = _exp_neg((v - m) * inv_t)
        if (v > bval or (v == bval and t <= bid)) and e >= min_p and e > 0:
            cum += e
            last = t
            if cum > target:
                return t
    return last if last >= 0 else _argmax(w, bmax, m)


@njit(cache=True)
def _draw_candidates(cid, cval, cw, bval, bid, min_p, u):
    """Inverse CDF of u over the kept candidates (given in draw order)."""
    total = 0.0
    for j in range(cid.size):
        if (cval[j] > bval or (cval[j] == bval and cid[j] <= bid)) and cw[j] >= min_p:
            total += cw[j]
    target = u * total
    cum = 0.0
    last = -1
    for j in range(cid.size):
        if (cval[j] > bval or (cval[j] == bval and cid[j] <= bid)) and cw[j] >= min_p and cw[j] > 0:
            cum += cw[j]
            last = j
            if cum > target:
                return cid[j]
    return cid[last] if last >= 0 else cid[0]


@njit(cache=True)
def _draw_row(w, bmax, m, temp, top_k, top_p, min_p, u):
    """Token drawn from row logits w (already processed) with block maxima bmax and max m."""
    V = w.size
    if not _NEG_INF32 < m < np.float32(np.inf):   # all -inf, NaN, or +inf logits: the first maximum
        return _argmax(w, bmax, m)
    inv_t = np.float32(1.0) / temp
    k_on = 0 < top_k < V
    p_on = top_p < np.float32(1.0)
    if not k_on and not p_on:   # nothing cut by rank: min-p is a filter of the draw
        return _draw_full(w, bmax, m, inv_t, min_p, _NEG_INF32, np.int32(V), u)
    # small candidate sets, gathered through the block maxima
    if k_on and top_k <= _SMALL_K:
        thr = _kth_block_threshold(bmax, np.int64(top_k))
        cid, cval = _gather(w, bmax, thr)
        bval, bid = _cut(cval, cid, np.ones(cid.size, np.float32), np.float64(top_k))
        nk = 0
        for j in range(cid.size):
            if cval[j] > bval or (cval[j] == bval and cid[j] <= bid):
                cid[nk], cval[nk] = cid[j], cval[j]
                nk += 1
        cid, cval = cid[:nk], cval[:nk]
        cw = _weights(cval, m, inv_t)
        if p_on:
            bval, bid = _cut(cval, cid, cw, top_p * _sum64(cw))
        return _draw_candidates(cid, cval, cw, bval, bid, min_p, u)
    if not k_on:
        target = top_p * _exp_sum(w, m, inv_t)
        c = np.int64(_TOPP_FIRST_BLOCKS)
        while c <= _TOPP_MAX_BLOCKS:
            thr = _kth_block_threshold(bmax, c)
            cid, cval = _gather(w, bmax, thr)
            cw = _weights(cval, m, inv_t)
            if _sum64(cw) >= target:
                bval, bid = _cut(cval, cid, cw, target)
                return _draw_candidates(cid, cval, cw, bval, bid, min_p, u)
            c *= 8
    # large sets: cut over the whole row
    ids = np.empty(0, np.int32)   # ids are positions
    e = _weights(w, m, inv_t)
    bval, bid = _NEG_INF32, np.int32(V)
    if k_on:
        bval, bid = _cut(w, ids, np.ones(V, np.float32), np.float64(top_k))
        for t in range(V):
            if not (w[t] > bval or (w[t] == bval and t <= bid)):
                e[t] = 0
    if p_on:
        bval, bid = _cut(w, ids, e, top_p * _sum64(e))
    return _draw_full(w, bmax, m, inv_t, min_p, bval, bid, u)


@njit(cache=True)
def _top_logprobs(raw, bmax, k, lse, out_ids, out_lp):
    """The k largest raw logits as (id, logprob), descending (ties: smaller id first)."""
    thr = _kth_block_threshold(bmax, np.int64(k))
    cid, cval = _gather(raw, bmax, thr)
    n = cid.size
    kk = min(k, n)
    pos = _select(cval, cid, np.ones(n), n, np.float64(kk))
    # the first pos+1 entries are the top kk in some order: insertion sort them
    for a in range(1, pos + 1):
        v, t = cval[a], cid[a]
        b = a - 1
        while b >= 0 and _before(v, t, cval[b], cid[b]):
            cval[b + 1], cid[b + 1] = cval[b], cid[b]
            b -= 1
        cval[b + 1], cid[b + 1] = v, t
    for a in range(kk):
        out_ids[a] = cid[a]
        out_lp[a] = np.float32(np.float64(cval[a]) - lse)


@njit(cache=True)
def _sample_row(i, raw, temperature, top_p, top_k, min_p, rep, pres, freq, seed, step, num_logprobs,
                bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids, hist_indptr, hist_ids, hist_num_prompt,
                out_tok, out_lp, out_top_ids, out_top_lp):
    V = raw.size
    nb = (V + BLOCK - 1) // BLOCK
    bmax_raw = np.empty(nb, np.float32)
    m_raw = _block_max(raw, bmax_raw)
    lse = np.float64(m_raw) + np.log(_exp_sum(raw, m_raw, np.float32(1.0)))
    if (bias_indptr[i + 1] > bias_indptr[i] or mask_indptr[i + 1] > mask_indptr[i]
            or hist_indptr[i + 1] > hist_indptr[i]):
        w = raw.copy()
        _process_row(w, i, bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids,
                     hist_indptr, hist_ids, hist_num_prompt, rep, pres, freq)
        bmax = np.empty(nb, np.float32)
        m = _block_max(w, bmax)
    else:
        w, bmax, m = raw, bmax_raw, m_raw
    if temperature[i] == np.float32(0.0):
        tok = _argmax(w, bmax, m)
    else:
        tok = _draw_row(w, bmax, m, temperature[i], top_k[i], top_p[i], min_p[i],
                        _uniform01(seed[i], step[i]))
    tok = min(max(tok, 0), V - 1)
    out_tok[i] = tok
    out_lp[i] = np.float32(np.float64(raw[tok]) - lse)
    if num_logprobs[i] > 0:
        _top_logprobs(raw, bmax_raw, num_logprobs[i], lse, out_top_ids[i], out_top_lp[i])


@njit(parallel=True, cache=True)
def _sample_kernel(logits, temperature, top_p, top_k, min_p, rep, pres, freq, seed, step, num_logprobs,
                   bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids, hist_indptr, hist_ids, hist_num_prompt,
                   out_tok, out_lp, out_top_ids, out_top_lp):
    """Sample every row of logits [S, V]; rows are independent."""
    for i in prange(logits.shape[0]):
        _sample_row(np.int64(i), logits[i], temperature, top_p, top_k, min_p, rep, pres, freq, seed, step, num_logprobs,
                    bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids, hist_indptr, hist_ids, hist_num_prompt,
                    out_tok, out_lp, out_top_ids, out_top_lp)


@njit(cache=True)
def _process_rows(logits, out, rep, pres, freq, bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids,
                  hist_indptr, hist_ids, hist_num_prompt):
    for i in range(logits.shape[0]):
        out[i] = logits[i]
        _process_row(out[i], i, bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids,
                     hist_indptr, hist_ids, hist_num_prompt, rep, pres, freq)


# --------------------------------------------------------------------------- entry points

def _check_logits(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    if logits.ndim != 2 or logits.shape[0] != batch.num_rows:
        raise ValueError(f"logits must be [{batch.num_rows}, vocab], got shape {logits.shape}")
    if batch.max_token_id >= logits.shape[1]:
        raise ValueError(f"token id {batch.max_token_id} in the sampling batch is out of range for a "
                         f"vocabulary of {logits.shape[1]}")
    return logits


def sample(logits: np.ndarray, batch: SamplingBatch) -> SampleResult:
    """Sample one token per row of logits [S, V] float32."""
    logits = _check_logits(logits, batch)
    S, K = batch.num_rows, batch.max_num_logprobs
    res = SampleResult(token_ids=np.zeros(S, np.int64), logprobs=np.zeros(S, np.float32),
                       top_token_ids=np.full((S, K), -1, np.int64),
                       top_logprobs=np.full((S, K), -np.inf, np.float32))
    if S == 0:
        return res
    b = batch
    _sample_kernel(logits, b.temperature, b.top_p, b.top_k, b.min_p, b.repetition_penalty, b.presence_penalty,
                   b.frequency_penalty, b.seed, b.step, b.num_logprobs,
                   b.bias_indptr, b.bias_token_ids, b.bias_values, b.mask_indptr, b.mask_token_ids,
                   b.hist_indptr, b.hist_token_ids, b.hist_num_prompt,
                   res.token_ids, res.logprobs, res.top_token_ids, res.top_logprobs)
    return res


def processed_logits(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """The logits after bias, min_tokens masking and penalties (what `sample` draws from before
    temperature), computed by the kernel's own code; for tests and debugging."""
    logits = _check_logits(logits, batch)
    out = np.empty_like(logits)
    b = batch
    if b.num_rows:
        _process_rows(logits, out, b.repetition_penalty, b.presence_penalty, b.frequency_penalty,
                        b.bias_indptr, b.bias_token_ids, b.bias_values, b.mask_indptr, b.mask_token_ids,
                        b.hist_indptr, b.hist_token_ids, b.hist_num_prompt)
    return out
