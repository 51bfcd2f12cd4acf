"""Grammars of constrained decoding: a request's structured_output compiled into an llguidance matcher.

The constraint's shape is checked by engine/sampling.py (check_structured_output); here it becomes an
llguidance grammar (JSON schema, regex, choice, Lark or GBNF grammar), is validated (GrammarError names
the parameter and the reason) and is compiled against the model's tokenizer once: compiled matchers are
kept per constraint (LRU), and each sequence gets a copy of the compiled one, which costs microseconds.

Per step (engine/runner.py): `fill_masks` writes the packed allowed-token bitmask of every constrained
sequence (bit t of row r, word t // 32: token t allowed) while the forward pass runs; llguidance releases
the GIL while it computes. After sampling, `Grammar.advance` moves a sequence's matcher by its token.
"""
from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from functools import lru_cache

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from engine.sampling import SamplingParamError

DEFAULT_CACHE_SIZE = 256          # compiled grammars kept per model
# A compiled matcher's lexer grows with its source (a 256 KB regex: ~120 MB once masks are computed, and its
# first mask holds up the step ~0.4 s): a constraint is at most MAX_CONSTRAINT_CHARS (OpenAI's own bound on a
# schema's strings is 120k), and the matchers kept per model hold at most CACHE_CHARS of sources together.
MAX_CONSTRAINT_CHARS = 131_072
CACHE_CHARS = 1 << 20
# Compact JSON by default: with free whitespace a model can loop on newlines until max_tokens; lenient:
# keywords and formats llguidance does not implement (uniqueItems, not, format "password", ...) are left
# unenforced rather than refused, as pydantic and OpenAPI schemas carry them (a schema's own "x-guidance"
# options still win).
JSON_DEFAULTS = {"whitespace_flexible": False, "lenient": True}
PARAM = "structured_output"        # the parameter the node's errors name (the gateway names its own)


class GrammarError(SamplingParamError):
    """A constraint that does not compile: a bad schema, regex or grammar, or one llguidance cannot do."""

    def __init__(self, message: str, param: str = PARAM):
        super().__init__(param, message)


def constraint_key(spec: dict) -> str:
    """One string per distinct constraint, its keys in their order: a schema's property order is the
    order the output writes them in (OpenAI's structured outputs: a "reasoning" listed before an "answer"
    is written first)."""
    return json.dumps(spec, separators=(",", ":"))


def _grammar_source(spec: dict) -> str:
    kind, value = spec["type"], spec["value"]
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(value), defaults=JSON_DEFAULTS)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(value))
        if kind == "regex":
            return llguidance.grammar_from("regex", value)
        return llguidance.grammar_from("grammar", value)   # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise GrammarError(f"the {kind} constraint is invalid: {e}") from None


@lru_cache(maxsize=DEFAULT_CACHE_SIZE)
def _checked_source(key: str) -> str:
    spec = json.loads(key)
    if len(key) > MAX_CONSTRAINT_CHARS:
        raise GrammarError(f"the {spec['type']} constraint is {len(key)} characters long (as JSON), more than "
                           f"the {MAX_CONSTRAINT_CHARS} this server compiles")
    source = _grammar_source(spec)
    error = llguidance.LLMatcher.validate_grammar(source)
    if error:
        raise GrammarError(f"the {spec['type']} constraint is invalid: {error.strip()}")
    return source


def check_constraint(spec: dict) -> str:
    """The llguidance grammar of a constraint, validated without a tokenizer (what the gateway runs
    before it queues anything); GrammarError when it is invalid or unsupported."""
    return _checked_source(constraint_key(spec))


class Grammar:
    """One sequence's matcher: which tokens may come next, advanced by each sampled token."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def advance(self, token_id: int) -> bool:
        """Consume a sampled token; False if the grammar refused it (the mask should have prevented it)."""
        return self.matcher.consume_token(int(token_id))

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (EOS included): the sequence stops."""
        return self.matcher.is_stopped()

    @property
    def failed(self) -> str | None:
        return _first_line(self.matcher) if self.matcher.is_error() else None


def _first_line(matcher: llguidance.LLMatcher) -> str:
    """A failed matcher's error without the parser state llguidance appends to it."""
    return matcher.get_error().strip().split("\n")[0]


_guidance_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_guidance_lock = threading.Lock()


def guidance_tokenizer(tokenizer, vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of a tokenizer over `vocab_size` logits (default: the tokenizer's own vocabulary),
    built once per tokenizer: building it holds the GIL for a few hundred ms, so a node builds it at
    start-up, where a cold load beside streaming models would stall them."""
    n = int(vocab_size if vocab_size is not None else tokenizer.vocab_size)
    with _guidance_lock:
        built = _guidance_tokenizers.setdefault(tokenizer, {})
        if n not in built:
            built[n] = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=n,
                                              eos_token=list(tokenizer.stop_token_ids))
        return built[n]


class GrammarCompiler:
    """Constraints compiled against one model's tokenizer, with the compiled matchers cached by constraint."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE):
        # the mask covers the logits' width, which may exceed the tokenizer's vocabulary (padding rows)
        self.vocab_size = int(vocab_size)
        self.words = (self.vocab_size + 31) // 32       # uint32 words per mask row
        self.tokenizer = guidance_tokenizer(tokenizer, self.vocab_size)
        self.executor = llguidance.LLExecutor()
        self.cache_size = cache_size
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._compiled_chars = 0          # the keys' lengths: what the cache's memory grows with
        self._lock = threading.Lock()
        self.num_compiles = 0

    def compile(self, spec: dict) -> llguidance.LLMatcher:
        """The compiled matcher of a constraint (from the cache when seen before); GrammarError if invalid.
        A template: every sequence takes a copy with `new_grammar`."""
        key = constraint_key(spec)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
        source = _checked_source(key)
        matcher = llguidance.LLMatcher(self.tokenizer, source, log_level=0)   # drops the GIL while compiling
        if not matcher.is_error():   # some grammars (a cycle of $refs) fail only once a mask is computed
            probe = matcher.deep_copy()
            probe.compute_bitmask()
            if probe.is_error():
                raise GrammarError(f"the {spec['type']} constraint cannot be enforced: {_first_line(probe)}")
        if matcher.is_error():
            raise GrammarError(f"the {spec['type']} constraint is invalid: {matcher.get_error().strip()}")
        with self._lock:
            self.num_compiles += 1
            if key not in self._compiled:
                self._compiled_chars += len(key)
            self._compiled[key] = matcher
            while len(self._compiled) > 1 and (len(self._compiled) > self.cache_size
                                               or self._compiled_chars > CACHE_CHARS):
                self._compiled_chars -= len(self._compiled.popitem(last=False)[0])
        return matcher

    @staticmethod
    def new_grammar(template: llguidance.LLMatcher) -> Grammar:
        return Grammar(template.deep_copy())

    def allocate_masks(self, rows: int) -> np.ndarray:
        """A packed mask buffer [rows, words] uint32."""
        return np.empty((rows, self.words), np.uint32)

    def fill_masks(self, grammars: list[Grammar], out: np.ndarray) -> None:
        """Row r of out := the allowed tokens of grammars[r], computed in parallel by llguidance's threads."""
        if grammars:
            fill_next_token_bitmask_par(self.executor, [(g.matcher, r) for r, g in enumerate(grammars)],
                                        out.view(np.int32))
