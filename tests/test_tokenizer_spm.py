"""The SentencePiece tokenizer (GGUF tokenizer model "llama", Gemma's) against an independent plain-Python
form of SentencePiece BPE as llama.cpp implements it, on the tiny vocabulary (and on Gemma 3's real one
in test_gemma3_real.py); byte fallback, BOS, no space prefix, special tokens, streaming."""
from __future__ import annotations

import pytest

from models.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.tiny_gemma import tiny_spm_fields

SAMPLES = [
    "the cat is on the mat", "what is the cat? That's it!", "  two spaces and\n\nnewlines\n",
    "emoji 🦙 and 漢字 fall back to bytes", "The end.", "<start_of_turn>user\nhi<end_of_turn>", "", " ",
    "trailing space ", "x" * 40,
]


def spm_encode_reference(text: str, fields: dict, add_bos: bool = True) -> list[int]:
    """llama.cpp's SentencePiece BPE (llm_tokenizer_spm) written plainly: control and user-defined pieces
    are split out of the raw text first (longest first); in each remaining fragment, spaces become ▁ and
    the adjacent pair whose joined text is a piece with the highest score is joined (leftmost on ties)
    until none is; pieces not in the vocabulary become their UTF-8 bytes' <0xXX> pieces."""
    tokens, scores, types = fields["ggml.tokens"], fields["ggml.scores"], fields["ggml.token_type"]
    ids = {t: i for i, t in reversed(list(enumerate(tokens)))}
    literal = sorted((t for t, ty in zip(tokens, types) if ty in (3, 4)), key=len, reverse=True)
    out = [fields["ggml.bos_token_id"]] if add_bos else []
    rest = text
    frag = ""
    while rest:
        hit = next((t for t in literal if rest.startswith(t)), None)
        if hit is None:
            frag += rest[0]
            rest = rest[1:]
            continue
        out += _spm_fragment(frag, ids, scores)
        out.append(ids[hit])
        frag, rest = "", rest[len(hit):]
    return out + _spm_fragment(frag, ids, scores)


def _spm_fragment(text: str, ids: dict, scores: list) -> list[int]:
    syms = list(text.replace(" ", "\u2581"))
    while True:
        best = None
        for i in range(len(syms) - 1):
            j = ids.get(syms[i] + syms[i + 1])
            if j is not None and (best is None or scores[j] > best[0]):
                best = (scores[j], i)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    out = []
    for s in syms:
        if s in ids:
            out.append(ids[s])
        else:
            out += [ids[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return out


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(tiny_spm_fields())


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_sentencepiece_bpe(tok, text):
    assert tok.encode(text) == spm_encode_reference(text, tiny_spm_fields())
    assert tok.decode(tok.encode(text)) == text.replace("<start_of_turn>", "").replace("<end_of_turn>", "")
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == "<bos>" + text


def test_bos_added_no_space_prefix_and_byte_fallback(tok):
    ids = tok.encode("the cat")
    assert ids[0] == tok.bos_token_id == 2
    assert tok.hf.id_to_token(ids[1]) == "th"   # no ▁ prepended: "the" at the start is not "▁the"
    assert tok.encode("the cat", add_special_tokens=False) == ids[1:]
    llama = tok.encode("🦙", add_special_tokens=False)
    assert [tok.hf.id_to_token(i) for i in llama] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert b"".join(tok.token_bytes(i) for i in llama) == "🦙".encode()
    assert tok.token_bytes(tok.encode(" cat", add_special_tokens=False)[0]) == b" cat"
    assert tok.stop_token_ids == (1, 5)   # <eos>, and <end_of_turn> as an end-of-turn token
    assert tok.special_token_ids >= {0, 1, 2, 3, 4, 5}


def test_incremental_detokenizer_streams_byte_fallback_and_spaces(tok):
    text = "what is 🦙 the  cat\n\n漢字 on"
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("the")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)   # a character's bytes are held until it is whole


def test_fields_without_scores_are_refused():
    fields = dict(tiny_spm_fields())
    fields["ggml.scores"] = None
    with pytest.raises(ValueError, match="scores"):
        Tokenizer.from_gguf(fields)


def test_token_text_keeps_the_space_a_space_prefix_vocabulary_strips():
    """Llama 2 / Mistral style (add_space_prefix): "▁cat" alone decodes as "cat", yet stands for " cat";
    logprobs' `token` must agree with its `bytes`."""
    tok = Tokenizer.from_gguf(dict(tiny_spm_fields(), **{"ggml.add_space_prefix": True}))
    ids = tok.encode("the cat", add_special_tokens=False)
    assert tok.hf.id_to_token(ids[-1]).startswith("\u2581")
    assert [tok.token_text(i) for i in ids] == [tok.token_bytes(i).decode() for i in ids]
    assert "".join(tok.token_text(i) for i in ids) == " the cat"
    assert tok.token_text(tok.bos_token_id) == "<bos>"   # special tokens keep their text
