"""engine/grammar.py: constraints compiled against a real tokenizer (the tiny model's), cached per
constraint; masks filled in parallel agree with the matcher one by one; a complete grammar stops."""
from __future__ import annotations

import numpy as np
import pytest

from engine.grammar import GrammarCompiler, GrammarError, check_constraint, constraint_key, guidance_tokenizer
from engine.sampling import SamplingParamError, SamplingParams
from tests.tiny_model import make_tiny_tokenizer


@pytest.fixture(scope="module")
def compiler():
    tok = make_tiny_tokenizer()
    return GrammarCompiler(tok, tok.vocab_size + 5), tok   # logits wider than the vocabulary


def allowed_of(words: np.ndarray, V: int) -> np.ndarray:
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:V].astype(bool)


def test_a_constraint_seen_before_costs_no_compile(compiler):
    c, _ = compiler
    spec = {"type": "json", "value": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    before = c.num_compiles
    first = c.compile(spec)
    same = c.compile({"type": "json", "value": {"type": "object", "properties": {"a": {"type": "integer"}}}})
    assert first is same and c.num_compiles == before + 1


def test_properties_are_written_in_the_schemas_order(compiler):
    """A schema's property order is the output's (a "reasoning" listed first is written first); the same
    properties in another order are another constraint."""
    c, tok = compiler
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    swapped = {**schema, "properties": dict(reversed(schema["properties"].items()))}
    assert constraint_key({"type": "json", "value": schema}) != constraint_key({"type": "json", "value": swapped})
    for spec, text, fits in ((schema, '{"reasoning":"r","answer":1}', True), (schema, '{"answer":1,"reasoning":"r"}', False),
                             (swapped, '{"answer":1,"reasoning":"r"}', True)):
        g = c.new_grammar(c.compile({"type": "json", "value": spec}))
        assert all(g.advance(t) for t in tok.encode(text, add_special_tokens=False)) == fits, text


def test_the_llguidance_tokenizer_is_built_once_per_tokenizer_and_width(compiler):
    """A node builds it at start-up; a later engine on the same tokenizer reuses it (no GIL-holding build
    beside streaming models), and a different logits width gets its own."""
    c, tok = compiler
    assert guidance_tokenizer(tok, tok.vocab_size + 5) is c.tokenizer
    assert GrammarCompiler(tok, tok.vocab_size + 5).tokenizer is c.tokenizer
    own = guidance_tokenizer(tok)
    assert own is not c.tokenizer and own is guidance_tokenizer(tok, tok.vocab_size)
    assert own.vocab_size == tok.vocab_size and c.tokenizer.vocab_size == tok.vocab_size + 5


def test_the_cache_is_bounded_by_the_sources_it_holds_and_a_source_by_its_size(monkeypatch):
    """A compiled matcher's memory grows with its source: a constraint past MAX_CONSTRAINT_CHARS is refused
    (at the gateway's check too), and the matchers kept hold CACHE_CHARS of sources at most."""
    from engine import grammar
    tok = make_tiny_tokenizer()
    monkeypatch.setattr(grammar, "CACHE_CHARS", 2000)
    c = GrammarCompiler(tok, tok.vocab_size)
    specs = [{"type": "regex", "value": f"{i}" + "a" * 600} for i in range(5)]
    for spec in specs:
        c.compile(spec)
    kept = [key for key in c._compiled]
    assert kept == [constraint_key(s) for s in specs[-3:]] and c._compiled_chars == sum(map(len, kept)) <= 2000
    huge = {"type": "regex", "value": "b" * grammar.MAX_CONSTRAINT_CHARS}
    for compile_it in (c.compile, check_constraint):
        with pytest.raises(GrammarError, match="characters long"):
            compile_it(huge)


@pytest.mark.parametrize("spec, message", [
    ({"type": "json", "value": {"type": "nope"}}, "json constraint is invalid"),
    ({"type": "regex", "value": "a{2"}, "regex constraint is invalid"),
    ({"type": "grammar", "value": "start: nothing_here"}, "grammar constraint is invalid"),
    ({"type": "grammar", "value": "root ::= ("}, "grammar constraint is invalid"),
])
def test_invalid_constraints_say_why(compiler, spec, message):
    c, _ = compiler
    with pytest.raises(GrammarError, match=message) as err:
        c.compile(spec)
    assert err.value.param == "structured_output"
    with pytest.raises(GrammarError):
        check_constraint(spec)


def test_a_constraint_that_fails_on_its_first_mask_is_refused_when_compiled(compiler):
    c, _ = compiler
    cycle = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    with pytest.raises(GrammarError, match="cannot be enforced") as err:
        c.compile({"type": "json", "value": cycle})
    assert err.value.param == "structured_output" and "\n" not in str(err.value)


@pytest.mark.parametrize("spec", [
    {"type": "xml", "value": "<a/>"}, {"type": "choice", "value": []}, {"type": "choice", "value": ["a", 1]},
    {"type": "json", "value": "{}"}, {"type": "regex", "value": ""}, {"type": "regex"},
])
def test_bad_shapes_are_refused_by_the_parameters(spec):
    with pytest.raises(SamplingParamError) as err:
        SamplingParams(structured_output=spec)
    assert err.value.param == "structured_output"


def test_parallel_masks_match_each_matcher_and_a_choice_completes(compiler):
    c, tok = compiler
    V = c.vocab_size
    grammars = [c.new_grammar(c.compile({"type": "choice", "value": ["cat", "dog"]})),
                c.new_grammar(c.compile({"type": "regex", "value": "[0-9]+"}))]
    masks = c.allocate_masks(2)
    c.fill_masks(grammars, masks)
    for g, row in zip(grammars, masks):
        one = np.frombuffer(g.matcher.compute_bitmask(), np.uint32)
        assert np.array_equal(row, one)
    assert not allowed_of(masks[0], V)[tok.vocab_size:].any()   # the padding rows are never allowed
    for t in tok.encode("dog", add_special_tokens=False):
        assert allowed_of(masks[0], V)[t]
        assert grammars[0].advance(t)
        c.fill_masks(grammars[:1], masks[:1])
    assert grammars[0].finished and grammars[0].failed is None
    assert not grammars[1].advance(tok.encode("x", add_special_tokens=False)[0])
    assert grammars[1].failed
