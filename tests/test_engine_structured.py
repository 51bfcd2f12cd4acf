"""Constrained sequences in the engine (tiny model): the grammar holds with prefix-cache hits, n > 1,
preemption, stop strings and the incremental detokenizer; unconstrained sequences in the same batch are
unchanged; a bad constraint is refused before anything is queued."""
from __future__ import annotations

import re

import pytest

from engine.engine import RequestError
from tests.test_engine import make_engine, prompt, req, run

DIGITS = {"type": "regex", "value": "[0-9]{3}(-[0-9]{3}){4}"}
# compiles, and llguidance gives up once a property name begins: 600 alternatives are past its row limit
WIDE = {"type": "json", "value": {"type": "object",
                                  "properties": {f"field_{i}": {"type": "string"} for i in range(600)}}}
PATTERN = re.compile("[0-9]{3}(-[0-9]{3}){4}")


@pytest.fixture(scope="module")
def engine(tiny_gguf):
    return make_engine(tiny_gguf, num_blocks=64, block_size=4)


def test_constrained_and_free_sequences_share_a_batch(engine):
    p = prompt(5, 9)
    alone = run(engine, [req("free", p, temperature=1.0, seed=4, max_tokens=12)])
    mixed = run(engine, [req("free", p, temperature=1.0, seed=4, max_tokens=12),
                         req("so", p, temperature=1.0, seed=9, max_tokens=40, n=3, structured_output=DIGITS)])
    assert mixed["free"] == alone["free"]
    for i in range(3):
        tokens, finish, text = mixed["so"][i]
        assert finish == "stop" and PATTERN.fullmatch(text), (tokens, text)
        assert engine.tokenizer.decode(tokens) == text


def test_a_prefix_cache_hit_and_preemption_keep_the_grammar(tiny_gguf):
    eng = make_engine(tiny_gguf, num_blocks=24, block_size=4, max_num_seqs=8)
    p = prompt(7, 16)
    first = run(eng, [req("a", p, temperature=0.8, seed=1, max_tokens=40, structured_output=DIGITS)])
    hits = eng.pool.prefix_hit_tokens
    # the same prompt again (a prefix hit), with more sequences than the pool holds at once
    out = run(eng, [req(f"r{i}", p, temperature=0.8, seed=1 + i, max_tokens=40, structured_output=DIGITS)
                    for i in range(6)])
    assert eng.pool.prefix_hit_tokens > hits and eng.num_preemptions > 0
    assert out["r0"] == first["a"]
    assert all(o[0][1] == "stop" and PATTERN.fullmatch(o[0][2]) for o in out.values()), out


def test_stop_strings_and_max_tokens_cut_a_constrained_sequence(engine):
    out = run(engine, [req("stop", prompt(3, 5), temperature=0.9, seed=3, max_tokens=40, stop=["-"],
                           structured_output=DIGITS),
                       req("len", prompt(3, 5), temperature=0.9, seed=3, max_tokens=4, structured_output=DIGITS)])
    assert out["stop"][0][1] == "stop" and re.fullmatch("[0-9]{3}", out["stop"][0][2])
    assert out["len"][0][1] == "length" and len(out["len"][0][0]) == 4


def test_a_bad_constraint_is_refused_before_it_is_queued(engine):
    with pytest.raises(RequestError) as err:
        engine.add_request(req("bad", prompt(1, 4), structured_output={"type": "regex", "value": "(["}))
    assert err.value.param == "structured_output"
    assert not engine.has_unfinished()


def test_a_request_whose_later_sequence_fails_to_set_up_queues_nothing(engine, monkeypatch):
    made = []
    real = engine.grammars.new_grammar

    def second_fails(compiled):
        made.append(compiled)
        if len(made) == 2:
            raise MemoryError("no room for a second matcher")
        return real(compiled)
    monkeypatch.setattr(engine.grammars, "new_grammar", second_fails)
    with pytest.raises(MemoryError):
        engine.add_request(req("so", prompt(6, 9), n=3, structured_output=DIGITS))
    assert not engine.has_unfinished() and engine.step() == []


def test_a_grammar_that_breaks_down_ends_its_sequence_with_the_reason(engine):
    engine.add_request(req("wide", prompt(1, 4), max_tokens=30, structured_output=WIDE))
    finished = []
    while engine.has_unfinished():
        finished += [d for d in engine.step() if d.finished]
    assert len(finished) == 1 and finished[0].finish_reason == "error"
    assert "could not be enforced" in finished[0].finish_message and "max is 2000" in finished[0].finish_message
    assert engine.pool.usage == 0.0
