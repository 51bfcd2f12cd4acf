"""Sampling parameters (θ) of a request: SamplingParams, validated and normalized on construction.

The samplers (engine/backends/cpu_sampler.py, cuda/kernels/sampling.py) apply them per row, in this order
(Hugging Face's, and vLLM's before its V1 engine, which applies min-p before top-k and top-p: the two
differ only when top_p and min_p are both set):
  1. logit_bias            w[t] += bias[t]
  2. min_tokens            w[t] = -inf for EOS and stop_token_ids while len(output) < min_tokens
     structured_output     w[t] = -inf for every token the request's grammar does not allow next
                           (engine/grammar.py computes the mask; docs/structured-outputs.md)
  3. repetition_penalty    for t in set(prompt + output): w[t] = w[t] / r if w[t] > 0 else w[t] * r
     frequency_penalty     w[t] -= f * count_output(t)
     presence_penalty      w[t] -= p * [count_output(t) > 0]
  4. temperature 0         token = argmax(w)                      (also for temperature < 1e-5)
     otherwise             z = (w - max w) / T ; top-k, then top-p on the renormalized top-k set,
                           then min-p (keep exp(z) >= min_p) ; draw from softmax(z) over what is kept
Logprobs are vLLM's default: log_softmax of the raw logits (before bias, penalties and temperature).

This module imports nothing heavier than numpy: the gateway imports it to validate requests.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_LOGPROBS = 20          # most top alternatives a request may ask for
MAX_TEMPERATURE = 100.0    # larger values are refused as absurd (OpenAI's own limit is 2)
MAX_REPETITION_PENALTY = 100.0  # and repetition penalties outside [1/100, 100]
MAX_N = 128                # most sequences per request (OpenAI's limit)
GREEDY_EPS = 1e-5          # temperatures below this are greedy (as vLLM)


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


def _float(x) -> float:
    """float(x), an integer past float's range (JSON's 10**400) as infinity rather than OverflowError."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


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
    x = _float(x)
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


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")
MAX_CHOICES = 1024


def check_structured_output(spec) -> dict | None:
    """The constraint's shape: {"type": "json", "value": a JSON schema object}, {"type": "regex" |
    "grammar", "value": a string (a grammar: Lark or GBNF)}, {"type": "choice", "value": [strings]}.
    Whether the schema or grammar compiles is checked by engine/grammar.py."""
    if spec is None:
        return None
    name = "structured_output"
    if not isinstance(spec, dict) or set(spec) != {"type", "value"}:
        raise SamplingParamError(name, f"{name} must be an object {{type, value}}")
    kind, value = spec["type"], spec["value"]
    if kind not in STRUCTURED_KINDS:
        raise SamplingParamError(name, f"{name}.type must be one of {', '.join(STRUCTURED_KINDS)}, got {kind!r}")
    if kind == "json" and not isinstance(value, dict):
        raise SamplingParamError(name, "a json constraint's value must be a JSON schema object")
    if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
        raise SamplingParamError(name, f"a {kind} constraint's value must be a non-empty string")
    if kind == "choice" and (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                             or not all(isinstance(c, str) and c for c in value)):
        raise SamplingParamError(name, f"a choice constraint's value must be a list of 1 to {MAX_CHOICES} "
                                       f"non-empty strings")
    return {"type": kind, "value": value}


@dataclass
class SamplingParams:
    """Generation parameters of one request (θ). Validated and normalized on construction."""
    n: int = 1
    best_of: int | None = None                 # accepted for compatibility, ignored
    temperature: float = 1.0                   # 0 = greedy
    top_p: float = 1.0                         # [0, 1]; 0 keeps the most likely token alone (top_k 1)
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
    max_tokens_default: bool = False           # max_tokens is the server's default: cut to what the prompt leaves
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None                # top alternatives, 0..20; 0 = only the chosen token's
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the stop string that ended the text stays in it (vLLM)
    structured_output: dict | None = None      # {"type": json|regex|choice|grammar, "value": ...}: see below

    def __post_init__(self):
        self.n = _int("n", self.n, 1, MAX_N)
        self.best_of = _int("best_of", self.best_of, 1, optional=True)
        self.temperature = _real("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        self.top_p = _real("top_p", self.top_p, 0.0, 1.0)
        self.top_k = _int("top_k", self.top_k)
        if self.top_k < -1:
            raise SamplingParamError("top_k", f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if self.top_p == 0.0:   # OpenAI's range includes 0: the smallest nucleus, the most likely token
            self.top_p, self.top_k = 1.0, 1
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
        self.max_tokens_default = _bool("max_tokens_default", self.max_tokens_default)
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        self.logprobs = _int("logprobs", self.logprobs, 0, MAX_LOGPROBS, optional=True)
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _bool("include_stop_str_in_output", self.include_stop_str_in_output)
        self.structured_output = check_structured_output(self.structured_output)

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
            b = _float(v) if _is_real(v) else math.nan
            if not -100.0 <= b <= 100.0:    # NaN too
                raise SamplingParamError("logit_bias", f"logit_bias values must be numbers in [-100, 100], "
                                                       f"got {str(v)[:20]} for token {k}")
            out[int(k)] = b
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
    def constrained(self) -> bool:
        return self.structured_output is not None

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
        if self.min_tokens > room:
            raise SamplingParamError("min_tokens", f"min_tokens ({self.min_tokens}) plus the prompt's "
                                                   f"{prompt_len} tokens exceeds the model's context length "
                                                   f"of {max_model_len}")
        if self.max_tokens is not None and self.max_tokens > room:
            raise SamplingParamError("max_tokens", f"max_tokens ({self.max_tokens}) plus the prompt's "
                                                   f"{prompt_len} tokens exceeds the model's context length "
                                                   f"of {max_model_len}; use max_tokens <= {room}")

