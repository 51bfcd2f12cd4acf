"""Tokenizer: ids against SmolLM2's Hugging Face tokenizer, round trips, special tokens, chat template,
incremental detokenization; on the default model file and on the tiny test tokenizer."""
from __future__ import annotations

import os

import pytest

from models.chat_template import TemplateError
from models.loader import default_model_path, load_tokenizer
from models.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.tiny_model import CHAT_TEMPLATE, make_tiny_tokenizer, tiny_tokenizer_fields

# Ground truth: ids that SmolLM2's Hugging Face tokenizer (and llama.cpp on the same GGUF vocabulary)
# produced for these strings, as published alongside SmolLM2-135M/360M-Instruct runs.
SMOLLM2_IDS = {
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "hello world": [28120, 905],
    "Hello": [19556],
    "Hello! How can I help you today?": [19556, 17, 1073, 416, 339, 724, 346, 1834, 47],
    "Explain in three short sentences why plants need sunlight.":
        [36971, 281, 1296, 1890, 8545, 1701, 2109, 737, 8118, 30],
    "Quelle est la capitale de la France ? Réponds en une phrase.":
        [65, 2726, 290, 1264, 2618, 47765, 1121, 367, 2618, 4649, 9148, 428, 2756, 96, 19870, 430, 16520, 8715, 30],
}
SMOLLM2_CHAT_IDS = [  # user "What is the capital of France?", default system prompt, generation prompt
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2,
    198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
]

VARIED_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "multiple   internal    spaces\t\ttabs\n\n\nnewlines\r\nCRLF",
    "Numbers 12345 and 3.14159 and 1,000,000; year 2024",
    "Emoji: 😀👍🏽🇺🇸 and ❤️ family 👨‍👩‍👧",
    "日本語のテキスト、中文字符和한국어 텍스트",
    "Café naïve résumé façade Ångström — “quotes” ‘single’ …",
    "مرحبا بالعالم שלום עולם Россия",
    "def foo(x):\n    return x ** 2  # comment\n",
    "zero\u200bwidth and\u00a0nbsp",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def real_tok() -> Tokenizer:
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def tiny_tok() -> Tokenizer:
    return make_tiny_tokenizer()


# ---- the default model's tokenizer ------------------------------------------------------------------

def test_real_ids_match_huggingface(real_tok):
    for text, ids in SMOLLM2_IDS.items():
        assert real_tok.encode(text) == ids, text
        assert real_tok.decode(ids) == text


def test_encoding_a_long_text_lets_other_threads_run(real_tok):
    """A node tokenizes in its request threads beside the step thread: an encode that held the GIL would
    stall every stream for as long as it takes (1 MB of text: ~2 s)."""
    import threading
    import time
    ticks, done = [0], threading.Event()

    def count():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    t0 = time.monotonic()
    ids = real_tok.encode("1234567890 " * 30_000)
    took = time.monotonic() - t0
    done.set()
    counter.join()
    assert len(ids) > 300_000
    assert ticks[0] > took * 1000 / 10      # held throughout, it would be 1 or 2


def test_real_properties(real_tok):
    assert real_tok.vocab_size == 49152
    assert real_tok.bos_token_id == 1 and real_tok.eos_token_id == 2
    assert real_tok.add_bos_token is False
    assert real_tok.encode("Hello")[0] != real_tok.bos_token_id  # add_bos is false for SmolLM2
    assert real_tok.stop_token_ids[0] == 2  # <|im_end|>
    assert set(real_tok.stop_token_ids) == {2, 0}  # and <|endoftext|>
    assert real_tok.pad_token_id == 2


def test_real_merged_tokens_exist(real_tok):
    the = real_tok.hf.token_to_id("Ġthe")
    assert the is not None
    assert real_tok.encode(" the") == [the]
    assert real_tok.encode(" the the") == [the, the]
    # merges applied: common words are one token, not bytes
    assert len(real_tok.encode(" information")) == 1
    assert real_tok.token_text(the) == " the"


def test_real_digits_split_individually(real_tok):
    ids = real_tok.encode("12345")
    assert [real_tok.token_text(i) for i in ids] == ["1", "2", "3", "4", "5"]
    ids = real_tok.encode("in 2024")
    assert [real_tok.token_text(i) for i in ids] == ["in", " ", "2", "0", "2", "4"]


def test_real_round_trips(real_tok):
    for text in VARIED_TEXTS:
        assert real_tok.decode(real_tok.encode(text)) == text, repr(text)


def test_real_special_tokens(real_tok):
    ids = real_tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and ids[1:3] == [4093, 198]
    assert real_tok.decode(ids) == "user\nhi"
    assert real_tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert real_tok.token_text(1) == "<|im_start|>"
    assert real_tok.encode("<|endoftext|>") == [0]
    assert real_tok.encode("<jupyter_code>") == [13]
    assert {0, 1, 2, 16} <= real_tok.special_token_ids


def test_real_chat_template(real_tok):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = real_tok.apply_chat_template(msgs)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert real_tok.encode(prompt) == SMOLLM2_CHAT_IDS
    with_system = real_tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}] + msgs, add_generation_prompt=False
    )
    assert "SmolLM" not in with_system
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert not with_system.endswith("<|im_start|>assistant\n")


def test_real_token_text_and_bytes(real_tok):
    text = "héllo 😀 日本"
    ids = real_tok.encode(text)
    assert b"".join(real_tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    partial = [i for i in ids if real_tok.token_text(i).endswith("\ufffd")]
    assert partial, "the emoji should be split over byte tokens"
    assert real_tok.token_bytes(2) == b"<|im_end|>"
    with pytest.raises(ValueError):
        real_tok.token_text(49152)


def _stream(tok, ids, prompt_ids=None, skip_special_tokens=True):
    d = IncrementalDetokenizer(tok, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [d.push(i) for i in ids]
    deltas.append(d.flush())
    assert d.token_ids == list(ids)
    return deltas, d


def test_real_incremental_detokenization(real_tok):
    prompt = real_tok.encode(real_tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    for text in VARIED_TEXTS + [" The capital of France is Paris.", "😀😀 日本語 x"]:
        ids = real_tok.encode(text)
        for ctx in (None, prompt):
            deltas, d = _stream(real_tok, ids, ctx)
            assert "".join(deltas) == real_tok.decode(ids) == text == d.text
            assert not any("\ufffd" in x for x in deltas), (text, deltas)
    # special tokens: skipped by default, or shown
    ids = real_tok.encode("Paris<|im_end|>")
    assert "".join(_stream(real_tok, ids)[0]) == "Paris"
    assert "".join(_stream(real_tok, ids, skip_special_tokens=False)[0]) == "Paris<|im_end|>"


# ---- the tiny tokenizer -----------------------------------------------------------------------------

def test_tiny_tokenizer_basics(tiny_tok):
    assert tiny_tok.vocab_size == len(tiny_tokenizer_fields()["ggml.tokens"])
    ids = tiny_tok.encode(" the cat")
    assert [tiny_tok.token_text(i) for i in ids] == [" the", " cat"]
    assert tiny_tok.encode("<|im_start|>") == [1]
    assert tiny_tok.stop_token_ids == (2, 0)
    for text in VARIED_TEXTS:
        assert tiny_tok.decode(tiny_tok.encode(text)) == text


def test_incremental_emoji_split_over_byte_tokens(tiny_tok):
    ids = tiny_tok.encode("a😀b")
    pieces = [tiny_tok.token_text(i) for i in ids]
    assert pieces[0] == "a" and pieces[-1] == "b" and len(ids) == 5  # a, ðŁ, ĺ, Ģ, b: 4 bytes in 3 tokens
    deltas, _ = _stream(tiny_tok, ids)
    assert deltas == ["a", "", "", "😀", "b", ""]
    # two emoji back to back, and the stream cut in the middle of one: flush gives what decode gives
    ids = tiny_tok.encode("😀😀")
    deltas, _ = _stream(tiny_tok, ids[:-1])
    assert "".join(deltas[:-1]) == "😀" and deltas[-1] == "\ufffd"
    assert "".join(deltas) == tiny_tok.decode(ids[:-1])


def test_incremental_spaces_decode_as_full_text(tiny_tok):
    text = "  the  cat\n\nis  here "
    ids = tiny_tok.encode(text)
    deltas, _ = _stream(tiny_tok, ids, prompt_ids=tiny_tok.encode("<|im_start|>assistant\n"))
    assert "".join(deltas) == text


def test_chat_template_tiny_and_errors(tiny_tok):
    out = tiny_tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" \
                  "<|im_start|>assistant\n"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "user\na\nb<|im_end|>" in tiny_tok.apply_chat_template(parts)
    assert "assistant\n<|im_end|>" in tiny_tok.apply_chat_template([{"role": "assistant", "content": None}])
    bad = [
        "hello",
        [],
        [{"content": "no role"}],
        [{"role": "user", "content": 5}],
        [{"role": "", "content": "x"}],
        ["not a dict"],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    ]
    for messages in bad:
        with pytest.raises(ValueError):
            tiny_tok.apply_chat_template(messages)


def _with_template(template: str, **extra) -> Tokenizer:
    fields = tiny_tokenizer_fields()
    fields["chat_template"] = template
    fields.update(extra)
    return Tokenizer.from_gguf(fields)


def test_chat_template_environment():
    tok = _with_template("{{ bos_token }}|{{ eos_token }}|{{ messages | length }}|{{ messages[0] | tojson }}")
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == \
        '<|im_start|>|<|im_end|>|1|{"role": "user", "content": "é"}'
    tok = _with_template("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first!') }}{% endif %}ok")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateError, match="user first!"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    for failing in ("{{ 1 // (messages | length - 1) }}", "{{ range(10 ** 9) | list }}"):   # a division by
        with pytest.raises(TemplateError, match="failed on these messages"):                # zero, a range too long
            _with_template(failing).apply_chat_template([{"role": "user", "content": "x"}])
    # the sandbox refuses attribute escapes
    tok = _with_template("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    no_template = tiny_tokenizer_fields()
    del no_template["chat_template"]
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_gguf(no_template).apply_chat_template([{"role": "user", "content": "x"}])


def test_add_bos_when_the_model_asks():
    tok = _with_template(CHAT_TEMPLATE, **{"ggml.add_bos_token": True})
    assert tok.encode("hi") == [1] + tok.encode("hi", add_special_tokens=False)
    assert tok.decode(tok.encode("hi")) == "hi"


def test_pre_tokenizer_follows_the_gguf_name(tiny_tok):
    merged = tiny_tok.hf.token_to_id("12")
    assert merged is not None
    assert tiny_tok.encode("12") != [merged]  # smollm: digits one by one, the "1 2" merge never applies
    gpt2 = _with_template(CHAT_TEMPLATE, **{"ggml.pre": "gpt-2"})
    assert gpt2.encode("12") == [merged]


def test_unsupported_gguf_tokenizers():
    for key, value in (("ggml.model", "bert"), ("ggml.pre", "no-such-pre")):
        fields = tiny_tokenizer_fields()
        fields[key] = value
        with pytest.raises(ValueError, match=value):
            Tokenizer.from_gguf(fields)


def _same_tokenizer(a: Tokenizer, b: Tokenizer):
    for text in VARIED_TEXTS + ["<|im_start|>user\nhi<|im_end|>", " the cat is 12"]:
        assert a.encode(text) == b.encode(text)
        assert a.decode(a.encode(text)) == b.decode(b.encode(text))
    msgs = [{"role": "user", "content": "hi"}]
    assert a.apply_chat_template(msgs) == b.apply_chat_template(msgs)
    assert (a.vocab_size, a.bos_token_id, a.eos_token_id, a.stop_token_ids, a.add_bos_token, a.pad_token_id) == \
           (b.vocab_size, b.bos_token_id, b.eos_token_id, b.stop_token_ids, b.add_bos_token, b.pad_token_id)
    assert a.special_token_ids == b.special_token_ids


def test_save_hf_reloads_the_same(tmp_path, tiny_tok, real_tok):
    with_bos = _with_template(CHAT_TEMPLATE, **{"ggml.add_bos_token": True})
    for name, tok in (("tiny", tiny_tok), ("real", real_tok), ("bos", with_bos)):
        tok.save_hf(tmp_path / name)
        assert os.path.isfile(tmp_path / name / "tokenizer.json")
        _same_tokenizer(tok, Tokenizer.from_hf_dir(tmp_path / name))
    # the BOS rule lives in tokenizer.json's post-processor too (what transformers would load)
    import tokenizers

    raw = tokenizers.Tokenizer.from_file(str(tmp_path / "bos" / "tokenizer.json"))
    assert raw.encode("hi").ids[0] == 1
    # and back to GGUF fields
    _same_tokenizer(tiny_tok, Tokenizer.from_gguf(Tokenizer.from_hf_dir(tmp_path / "tiny").to_gguf_fields()))


def test_from_hf_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
