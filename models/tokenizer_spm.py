"""A SentencePiece BPE vocabulary (GGUF tokenizer model "llama": Gemma's, Llama 2's) as a `tokenizers` BPE.

The GGUF file holds pieces with scores and no merges. SentencePiece's BPE (and llama.cpp's "spm" tokenizer)
encodes by repeatedly joining the adjacent pair whose joined piece is in the vocabulary with the highest
score; a BPE whose merges are every (left, right) split of every piece, ranked by the joined piece's score,
makes the same choices (how transformers converts these vocabularies too). A Unigram model over the same
scores would not: the scores here are merge ranks, not log-probabilities.

Spaces become U+2581 ("▁"); no space is prepended when add_space_prefix is false (Gemma); bytes that no piece
covers fall back to the <0xXX> pieces; control pieces are special tokens, user-defined pieces (Gemma's runs
of newlines and spaces) are matched in the raw text first, as llama.cpp does.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

import tokenizers
from tokenizers import AddedToken, decoders, normalizers

SPACE = "\u2581"
# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of every normal piece into two pieces of the vocabulary, best joined score first."""
    ids = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == TOKEN_NORMAL:
            ids.setdefault(t, i)
    ranked = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, ids[left], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def spm_tokenizer(fields: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """The `tokenizers` object of a GGUF "llama" vocabulary (fields: `tokenizer.*` keys without the prefix);
    BOS/EOS are left to the caller's post-processor."""
    tokens = fields.get("ggml.tokens")
    scores = fields.get("ggml.scores")
    if not tokens or scores is None or len(scores) != len(tokens):
        raise ValueError("GGUF SentencePiece tokenizer has no vocabulary or no scores for it")
    types = list(fields.get("ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    unk_id = fields.get("ggml.unknown_token_id")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    has_bytes = all(f"<0x{b:02X}>" in vocab for b in range(256))
    model_json = {
        "type": "BPE", "dropout": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
        "unk_token": tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None,
        "fuse_unk": True, "byte_fallback": has_bytes, "ignore_merges": False, "vocab": vocab,
        "merges": [list(m) for m in spm_merges(list(tokens), list(scores), types)],
    }
    doc = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": None, "post_processor": None, "decoder": None, "model": model_json,
    }
    hf = tokenizers.Tokenizer.from_str(json.dumps(doc))
    space = [normalizers.Replace(" ", SPACE)]
    if fields.get("ggml.add_space_prefix", True):
        space.insert(0, normalizers.Prepend(SPACE))
    hf.normalizer = normalizers.Sequence(space)
    strip = [decoders.Strip(" ", 1, 0)] if fields.get("ggml.add_space_prefix", True) else []
    hf.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
            if ty == TOKEN_USER_DEFINED]
    if special:
        hf.add_special_tokens(special)
    if user:
        hf.add_tokens(user)
    return hf


def spm_piece_bytes(piece: str) -> bytes:
    """The bytes a SentencePiece piece stands for: <0xXX> is that byte, ▁ a space."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace(SPACE, " ").encode("utf-8")
