"""Which node likely holds a prompt's prefix in its prefix cache: a bounded map of prefix-block hashes to nodes,
learnt from the router's own routing history (per gateway worker process).

The gateway does not tokenize (the node does), so a prompt's blocks are approximated on its text: a canonical
serialization of the input (the text prompt; each chat message as role and content between separators; token
ids as decimal text), cut into fixed-size character chunks, each hashed together with the hash before it
(seeded with the model and quantization: a node's prefix cache belongs to one resident model). The hash is
Python's own (SipHash, keyed per process): several times faster than hashlib on the gateway's hot path, and a
client cannot craft collisions; it suits an index that lives in one process. Two prompts
share their first k block hashes exactly when they share their first k·block_chars characters, as the node's
KV blocks are shared when the token prefixes match. Only full chunks count, as only full KV blocks are cached.

Every routed request records its block hashes against the node chosen; the map keeps the most recently used
`max_blocks` hashes (LRU), each with the few most recent nodes that were sent it. The expected cached tokens
on a node are the request's estimated prompt tokens times the share of its characters matched there.
Approximate by design: a node may have evicted the blocks since (KV memory pressure, model unloaded), and
another worker's routing is not seen; the score weighs this credit against load, so a wrong guess costs one
prefill, not a pinned queue.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from app.inference import message_text

NODES_PER_BLOCK = 4          # a hot prefix lands on a few nodes once load spreads it; older holders drop
_MESSAGE = "\x1e"            # record separator before each chat message
_FIELD = "\x1f"              # unit separator between a message's role and content


def canonical_prompt(prompt: str | None = None, prompt_token_ids: Iterable[int] | None = None,
                     messages: Iterable[dict] | None = None) -> str:
    """One string per input whose prefixes follow the prompt's: a conversation that grows by a turn keeps
    every character of its shorter form at the front."""
    if prompt is not None:
        return prompt
    if prompt_token_ids is not None:
        return ",".join(map(str, prompt_token_ids)) + ","
    return "".join(f"{_MESSAGE}{m['role']}{_FIELD}{message_text(m)}" for m in messages or ())


def block_hashes(text: str, seed: str, block_chars: int) -> list[int]:
    """Chained hashes of the full `block_chars`-character chunks of `text`: hash i covers chunks 0..i."""
    hashes, previous = [], hash(seed)
    for start in range(0, len(text) - block_chars + 1, block_chars):
        previous = hash((previous, text[start:start + block_chars]))
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Prefix-block hash -> the nodes recently sent a prompt with that prefix; LRU, `max_blocks` hashes."""

    def __init__(self, block_chars: int, max_blocks: int) -> None:
        if block_chars < 1 or max_blocks < 1:
            raise ValueError("block_chars and max_blocks must be >= 1")
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self._nodes: OrderedDict[int, list[str]] = OrderedDict()   # hash -> nodes, most recent last
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._nodes)

    def hashes(self, text: str, seed: str) -> list[int]:
        return block_hashes(text, seed, self.block_chars)

    def matched_blocks(self, hashes: list[int]) -> dict[str, int]:
        """For each node that holds the first block: how many leading blocks it holds."""
        matched: dict[str, int] = {}
        with self._lock:
            alive: set[str] | None = None
            found = 0
            for i, h in enumerate(hashes):
                nodes = self._nodes.get(h)
                if not nodes:
                    break
                alive = set(nodes) if alive is None else alive.intersection(nodes)
                if not alive:
                    break
                found = i + 1
                for url in alive:
                    matched[url] = found
            self._touch(hashes[:found])
        return matched

    def _touch(self, hashes: list[int]) -> None:
        """Most recently used, the leading blocks last: a prompt's shared beginning is evicted after its end."""
        for h in reversed(hashes):
            self._nodes.move_to_end(h)

    def record(self, hashes: list[int], url: str) -> None:
        """`url` was sent a prompt with these blocks: it holds them now (until its cache evicts them)."""
        with self._lock:
            for h in hashes:
                nodes = self._nodes.setdefault(h, [])
                if url in nodes:
                    nodes.remove(url)
                nodes.append(url)
                del nodes[:-NODES_PER_BLOCK]
            self._touch(hashes)
            while len(self._nodes) > self.max_blocks:
                self._nodes.popitem(last=False)

    def forget(self, url: str) -> None:
        """A node left (or restarted): nothing it held is there any more."""
        with self._lock:
            for h in [h for h, nodes in self._nodes.items() if url in nodes]:
                nodes = self._nodes[h]
                nodes.remove(url)
                if not nodes:
                    del self._nodes[h]

    def expected_cached_tokens(self, hashes: list[int], text_chars: int, prompt_tokens: int) -> dict[str, float]:
        """Per node, the prompt tokens it likely has cached: prompt tokens × matched chars / prompt chars."""
        if not hashes or text_chars <= 0:
            return {}
        return {url: prompt_tokens * min(1.0, blocks * self.block_chars / text_chars)
                for url, blocks in self.matched_blocks(hashes).items()}
