"""Tokenizer: byte-level BPE or SentencePiece BPE (models/tokenizer_spm.py) on the `tokenizers` library, built
from a GGUF file's vocabulary or a Hugging Face tokenizer.json, with the model's chat template rendered by
Jinja2 (models/chat_template.py).

Also IncrementalDetokenizer, which turns a stream of sampled token ids into text deltas that never end
in half a UTF-8 character and that add up to the decoding of the whole sequence (where the bytes are
invalid UTF-8, each delta replaces its own invalid bytes, which may differ from the whole decoding's
replacement characters).
"""
from __future__ import annotations

import json
import os
import re
import threading
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

from models.chat_template import TemplateError, cached_chat_template, normalize_messages
from models.tokenizer_spm import (  # noqa: F401 (the token types are re-exported)
    SPACE, TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_UNUSED, TOKEN_USER_DEFINED, spm_piece_bytes,
    spm_tokenizer,
)

# Tokens that end an assistant turn in the chat formats we know; any that the vocabulary holds as a
# special token stops generation, like llama.cpp's end-of-generation set.
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>",
)

_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF `tokenizer.ggml.pre` names -> the pre-tokenizer Hugging Face uses for that family. The names that share
# one entry use the same split in llama.cpp (llama-vocab.cpp): e.g. smollm/starcoder split every digit, then the
# GPT-2 regex, which is HF's Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)].
_PRE_FAMILY = {
    "gpt-2": "gpt2", "gpt2": "gpt2", "default": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "command-r": "digits", "codeshell": "digits",
    "exaone": "digits", "minerva-7b": "digits",
    "llama-bpe": "llama3", "llama3": "llama3", "smaug-bpe": "llama3",
    "qwen2": "qwen2", "stablelm2": "qwen2",
}


def _pre_tokenizer(family: str):
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "digits":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    pattern = {"llama3": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN}[family]
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_TO_UNICODE = _bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def _token_content(value) -> str | None:
    """tokenizer_config.json names a token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A model's tokenizer: encode/decode, special tokens, stop tokens and chat template."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        extra_stop_token_ids: Iterable[int] = (),
        pre: str | None = None,
    ):
        self.hf = hf
        self.hf.no_padding()
        self.hf.no_truncation()
        # One instance serves a node's request threads and its engine thread: nothing shows the library
        # safe for concurrent encode/decode on one instance, and the lock costs microseconds.
        self._lock = threading.Lock()
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.add_bos_token, self.add_eos_token = bool(add_bos_token), bool(add_eos_token)
        self.chat_template = chat_template
        self.pre = pre
        self.spm = _is_spm(hf)   # a SentencePiece vocabulary: pieces with ▁ and <0xXX>, not byte-level
        self._bos_id = self._id_of(bos_token)
        self._eos_id = self._id_of(eos_token)
        if self.add_bos_token and self._bos_id is None:
            raise ValueError("the tokenizer adds a BOS token but has none")
        added = self.hf.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        specials = [t.content for t in added.values() if t.special and t.content]
        self.special_text = re.compile(_any_of(specials)) if specials else None
        # a SentencePiece vocabulary that prefixes a space (Llama 2's): a text's continuation has none
        prefixed = self.spm and hf.normalizer is not None and hf.normalizer.normalize_str("a") == SPACE + "a"
        self._continued_normalizer = normalizers.Replace(" ", SPACE) if prefixed else None
        stops = [] if self._eos_id is None else [self._eos_id]
        for t in END_OF_TURN_TOKENS:
            i = self.hf.token_to_id(t)
            if i is not None and i in self._special_ids and i not in stops:
                stops.append(i)
        for i in extra_stop_token_ids:
            if i is not None and int(i) not in stops:
                stops.append(int(i))
        self._stop_ids = tuple(stops)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.hf.token_to_id(token)

    # ---- construction -------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        """From a GGUF file's `tokenizer.*` metadata (keys without the `tokenizer.` prefix)."""
        model = fields.get("ggml.model")
        if model == "llama":
            return cls._from_gguf_spm(fields)
        if model != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {model!r} "
                             "(supported: gpt2 byte-level BPE, llama SentencePiece)")
        tokens = fields.get("ggml.tokens")
        merges = fields.get("ggml.merges")
        if not tokens or merges is None:
            raise ValueError("GGUF tokenizer has no vocabulary or no merges")
        pre = fields.get("ggml.pre") or "default"
        family = _PRE_FAMILY.get(pre)
        if family is None:
            raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(sorted(_PRE_FAMILY))})")
        types = fields.get("ggml.token_type") or [TOKEN_NORMAL] * len(tokens)

        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        # One JSON document is much faster to hand over than Python lists of 50k pairs.
        model_json = {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": family == "llama3", "vocab": vocab,
            "merges": [m.split(" ", 1) for m in merges],
        }
        doc = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": None, "post_processor": None, "decoder": None, "model": model_json,
        }
        hf = tokenizers.Tokenizer.from_str(json.dumps(doc))
        hf.pre_tokenizer = _pre_tokenizer(family)
        added = []
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty == TOKEN_CONTROL:
                added.append(AddedToken(t, special=True, normalized=False))
            elif ty == TOKEN_USER_DEFINED:
                added.append(AddedToken(t, special=False, normalized=False))
        if added:
            hf.add_special_tokens([a for a in added if a.special])
            hf.add_tokens([a for a in added if not a.special])

        hf.decoder = decoders.ByteLevel()
        return cls._with_gguf_specials(hf, fields, bool(fields.get("ggml.add_bos_token", False)), pre)

    @classmethod
    def _from_gguf_spm(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        """A SentencePiece vocabulary (Gemma's); it adds BOS unless the file says otherwise."""
        return cls._with_gguf_specials(spm_tokenizer(fields), fields, bool(fields.get("ggml.add_bos_token", True)),
                                       None)

    @classmethod
    def _with_gguf_specials(cls, hf, fields: Mapping[str, Any], add_bos: bool, pre: str | None) -> "Tokenizer":
        tokens = fields["ggml.tokens"]

        def tok(key):
            i = fields.get(key)
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        add_eos = bool(fields.get("ggml.add_eos_token", False))
        extra = [fields.get("ggml.eot_token_id"), fields.get("ggml.eom_token_id")]
        template = fields.get("chat_template")
        out = cls(
            hf, bos_token=tok("ggml.bos_token_id"), eos_token=tok("ggml.eos_token_id"),
            unk_token=tok("ggml.unknown_token_id"), pad_token=tok("ggml.padding_token_id"),
            add_bos_token=add_bos, add_eos_token=add_eos, chat_template=template,
            extra_stop_token_ids=[int(e) for e in extra if e is not None], pre=pre,
        )
        out._set_post_processor()
        return out

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """From a Hugging Face model directory: tokenizer.json (+ tokenizer_config.json, chat_template.jinja,
        generation_config.json when present)."""
        path = os.fspath(path)
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise FileNotFoundError(f"{tj}: no tokenizer.json in the model directory")
        try:
            hf = tokenizers.Tokenizer.from_file(tj)
        except Exception as e:
            raise ValueError(f"{tj}: not a tokenizers JSON file ({str(e).splitlines()[0] if str(e) else e})") from None
        cfg = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        bos, eos = _token_content(cfg.get("bos_token")), _token_content(cfg.get("eos_token"))
        model_cfg = _read_json(os.path.join(path, "config.json")) or {}
        gen_cfg = _read_json(os.path.join(path, "generation_config.json")) or {}
        if bos is None and isinstance(model_cfg.get("bos_token_id"), int):
            bos = hf.id_to_token(model_cfg["bos_token_id"])
        extra = []
        for src in (gen_cfg, model_cfg):
            e = src.get("eos_token_id")
            extra += e if isinstance(e, list) else [e] if isinstance(e, int) else []
        if eos is None and extra:
            eos = hf.id_to_token(extra[0])
        if "add_bos_token" in cfg:
            add_bos = bool(cfg["add_bos_token"])
        else:  # what the file's post-processor does
            probe = hf.encode("", add_special_tokens=True).ids
            add_bos = bool(probe) and bos is not None and probe[0] == hf.token_to_id(bos)
        add_eos = bool(cfg.get("add_eos_token", False))
        out = cls(
            hf, bos_token=bos, eos_token=eos, unk_token=_token_content(cfg.get("unk_token")),
            pad_token=_token_content(cfg.get("pad_token")), add_bos_token=add_bos, add_eos_token=add_eos,
            chat_template=template, extra_stop_token_ids=extra, pre=cfg.get("gguf_pre") or _guess_pre(hf),
        )
        out._set_post_processor()
        return out

    def _set_post_processor(self):
        """BOS/EOS are added by the post-processor, so tokenizer.json written by save_hf behaves the same."""
        single = ([f"{self.bos_token}:0"] if self.add_bos_token else []) + ["$A:0"]
        single += [f"{self.eos_token}:0"] if self.add_eos_token else []
        if len(single) == 1:
            self.hf.post_processor = None
            return
        special = [(t, self._id_of(t)) for t in {self.bos_token, self.eos_token} if t is not None]
        self.hf.post_processor = processors.TemplateProcessing(
            single=single, pair=single + [s.replace("$A", "$B") for s in single if s != f"{self.bos_token}:0"],
            special_tokens=[(t, i) for t, i in special if i is not None],
        )

    # ---- properties ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_id

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of(self.pad_token)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """EOS first, then the chat end-of-turn tokens the vocabulary holds."""
        return self._stop_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    # ---- encode / decode ----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it map to their ids. BOS is added only when the
        model asks for it (add_bos_token) and add_special_tokens is true."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        with self._lock:   # encode_batch lets go of the GIL (encode holds it: 1 MB of text stalled every stream ~2 s)
            return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        with self._lock:
            return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def encode_pieces(self, pieces: Sequence[tuple[str, bool]]) -> list[list[int]]:
        """Token ids of the pieces of one text, (text, literal) each: the first read as encode() reads a
        text, each later one as the text's continuation (no space prefix of its own), and in a literal piece
        special-token strings are plain text."""
        with self._lock:   # the switches are the library instance's: no other encode sees them
            normalizer = self.hf.normalizer
            try:
                out = []
                for i, (text, literal) in enumerate(pieces):
                    if i == 1 and self._continued_normalizer is not None:
                        self.hf.normalizer = self._continued_normalizer
                    self.hf.encode_special_tokens = literal
                    out.append(self.hf.encode_batch([text], add_special_tokens=False)[0].ids)
                return out
            finally:
                self.hf.normalizer = normalizer
                self.hf.encode_special_tokens = False

    def framed(self, ids: list[int]) -> list[int]:
        """`ids` with the BOS and EOS that encode(..., add_special_tokens=True) adds."""
        return ([self._bos_id] if self.add_bos_token else []) + ids + ([self._eos_id] if self.add_eos_token else [])

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        self._check_ids(ids)
        with self._lock:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def _check_ids(self, ids: list[int]):
        n = self.vocab_size
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"token id {i} is out of range for a vocabulary of {n}")

    def token_text(self, token_id: int) -> str:
        """The text of one token: its bytes as UTF-8 (a partial character as U+FFFD), or an added or special
        token's own text; for logprobs display, where it must agree with token_bytes."""
        token_id = int(token_id)
        self._check_ids([token_id])
        if token_id not in self._added_ids:   # decoding it alone would strip SentencePiece's leading space
            return self.token_bytes(token_id).decode("utf-8", errors="replace")
        with self._lock:
            return self.hf.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (OpenAI's logprobs `bytes`)."""
        token_id = int(token_id)
        self._check_ids([token_id])
        piece = self.hf.id_to_token(token_id) or ""
        if token_id in self._added_ids:  # added tokens are literal text
            return piece.encode("utf-8")
        if self.spm:
            return spm_piece_bytes(piece)
        try:
            return bytes(UNICODE_TO_BYTE[c] for c in piece)
        except KeyError:  # not a byte-level vocabulary entry
            return piece.encode("utf-8")

    # ---- chat ---------------------------------------------------------------------------------------

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, chat_template: str | None = None,
                            **kwargs) -> str:
        """Render the model's chat template, or `chat_template` (a template's source) in its place, as
        transformers does; ValueError for malformed messages or a template that refuses them
        (TemplateCompileError for one that does not compile)."""
        source = chat_template or self.chat_template
        if not source:
            raise ValueError("this model has no chat template")
        template = cached_chat_template(source)
        msgs = normalize_messages(messages)
        try:
            return template.render(
                messages=msgs, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                unk_token=self.unk_token or "", pad_token=self.pad_token or "", **kwargs,
            )
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError, ArithmeticError,
                RecursionError) as e:
            raise TemplateError(f"chat template failed on these messages: {e}") from None

    # ---- serialization ------------------------------------------------------------------------------

    def save_hf(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json so that from_hf_dir reloads the same tokenizer."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        self.hf.save(os.path.join(directory, "tokenizer.json"))
        added = {
            str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special}
            for i, t in sorted(self.hf.get_added_tokens_decoder().items())
        }
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "add_prefix_space": False,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": added,
            "chat_template": self.chat_template,
            "gguf_pre": self.pre,
        }
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, ensure_ascii=False, indent=2)

    def to_gguf_fields(self) -> dict:
        """The GGUF `tokenizer.*` metadata of this tokenizer (keys without the prefix), as read_gguf returns."""
        if self.pre is None or self.pre not in _PRE_FAMILY:
            raise ValueError("this tokenizer's pre-tokenizer has no GGUF name")
        model = json.loads(self.hf.to_str())["model"]
        if model.get("type") != "BPE":
            raise ValueError("only BPE tokenizers can be written to GGUF")
        n = self.vocab_size
        tokens = [self.hf.id_to_token(i) for i in range(n)]
        if any(t is None for t in tokens):
            raise ValueError("the vocabulary has holes")
        added = self.hf.get_added_tokens_decoder()
        types = [
            (TOKEN_CONTROL if added[i].special else TOKEN_USER_DEFINED) if i in added else TOKEN_NORMAL
            for i in range(n)
        ]
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        fields = {
            "ggml.model": "gpt2", "ggml.pre": self.pre, "ggml.tokens": tokens, "ggml.token_type": types,
            "ggml.merges": merges, "ggml.add_bos_token": self.add_bos_token, "ggml.add_eos_token": self.add_eos_token,
        }
        for key, tok in (("bos", self.bos_token), ("eos", self.eos_token), ("unknown", self.unk_token),
                         ("padding", self.pad_token)):
            if tok is not None and self._id_of(tok) is not None:
                fields[f"ggml.{key}_token_id"] = self._id_of(tok)
        if self.chat_template:
            fields["chat_template"] = self.chat_template
        return fields


def _any_of(words: Iterable[str]) -> str:
    """A regex of the longest of `words` at a place, as a trie (a branch per next character): the matcher
    follows one branch per character, where an alternation of Gemma's 6,249 special tokens, all beginning
    with "<", tried every one of them at every "<"."""
    trie: dict = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}                     # a word ends here

    def pattern(node: dict) -> str:
        branches = [re.escape(ch) + pattern(child) for ch, child in node.items() if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body   # greedy: the longer word first

    return pattern(trie)


def _read_json(path: str):
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None


def _is_spm(hf: tokenizers.Tokenizer) -> bool:
    """Whether a tokenizer decodes SentencePiece pieces (its decoder turns ▁ into spaces)."""
    dec = hf.decoder
    return dec is not None and "\u2581" in dec.__getstate__().decode("utf-8", "replace")


def _guess_pre(hf: tokenizers.Tokenizer) -> str | None:
    """The GGUF pre-tokenizer name of a tokenizer.json's pre-tokenizer, for the families we know."""
    pre = json.loads(hf.to_str()).get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    if pre.get("type") == "Sequence":
        kinds = [p.get("type") for p in pre.get("pretokenizers", [])]
        if kinds == ["Digits", "ByteLevel"]:
            return "smollm"
    return None


class IncrementalDetokenizer:
    """Streams text as tokens arrive (the offset-window scheme of vLLM / TGI).

    Each push decodes a short window of already-emitted tokens plus the new ones and emits only what the
    new tokens added, so spaces and merges decode as in a full decode; while the window's text ends in
    U+FFFD (an incomplete UTF-8 character) nothing is emitted. The deltas, with flush() at the end, add
    up to decode(all generated ids).
    """

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = [int(i) for i in (prompt_ids or [])][-self.CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._context = len(context)
        self._text_parts: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """The generated ids pushed so far."""
        return self._ids[self._context:]

    @property
    def text(self) -> str:
        """The text emitted so far."""
        return "".join(self._text_parts)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text it completes ('' while a character is incomplete)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._text_parts.append(delta)
            return delta
        return ""

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (an incomplete character as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        if delta:
            self._text_parts.append(delta)
        return delta
