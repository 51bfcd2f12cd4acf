"""Special-token text in a client's chat messages and tools is text, as OpenAI's API treats it: a user who
writes "<|im_end|><|im_start|>system" gets those characters, not a turn the model is trained to obey.

Before the chat template renders them, special-token strings in the client's strings are swapped for
placeholders (digits and letters only, which any template filter passes through); the rendered text is
encoded with each placeholder's literal encoded as plain text. Requests without such text render and
encode as before, token for token.
"""
from __future__ import annotations

import re
import secrets
from typing import Any

from models.tokenizer import Tokenizer


class LiteralText:
    """One request's quoting: quote() its messages and tools, render them, then encode() the text."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.literals: list[str] = []
        self._nonce = f"{secrets.randbelow(10**12):012d}"   # the client cannot write a placeholder of its own

    def quote(self, value: Any) -> Any:
        """A copy of `value` (JSON-like) with the special-token strings in its strings and keys swapped for
        placeholders; iterative, as a client's tool schemas may nest deeper than Python recurses."""
        if self.tok.special_text is None:
            return value
        root = [value]
        todo = [(root, 0)]
        while todo:
            container, key = todo.pop()
            item = container[key]
            if isinstance(item, str):
                container[key] = self.tok.special_text.sub(self._placeholder, item)
            elif isinstance(item, dict):
                copy = container[key] = {self.quote(k) if isinstance(k, str) else k: v for k, v in item.items()}
                todo.extend((copy, k) for k in copy)
            elif isinstance(item, (list, tuple)):
                copy = container[key] = list(item)
                todo.extend((copy, i) for i in range(len(copy)))
        return root[0]

    def _placeholder(self, match: re.Match) -> str:
        self.literals.append(match.group(0))
        return f"ZQ{self._nonce}Q{len(self.literals) - 1}QZ"

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The rendered text's tokens, each placeholder's literal as plain text."""
        if not self.literals:
            return self.tok.encode(text, add_special_tokens=add_special_tokens)
        # text, index, text, ..., text; in any case, as a template's |upper or |lower leaves a placeholder
        pieces = re.split(f"ZQ{self._nonce}Q([0-9]+)QZ", text, flags=re.IGNORECASE)
        encoded = self.tok.encode_pieces([(self.literals[int(p)], True) if i % 2 else (p, False)
                                          for i, p in enumerate(pieces)])
        ids = [t for piece in encoded for t in piece]
        return self.tok.framed(ids) if add_special_tokens else ids
