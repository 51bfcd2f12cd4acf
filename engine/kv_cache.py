"""PagedAttention KV memory: a pool of fixed-size blocks and the per-sequence manager on top of it.

BlockPool owns the blocks: reference counts, the free queue (least recently used first) and the
prefix cache (digest of a full block and all before it -> block). The digest is a cryptographic hash
(BLAKE2b): every org's requests share the cache, and a key another prompt could be made to collide
with would run that prompt on the first one's K/V. A block whose count drops to zero stays in the
prefix cache until the pool hands it out again, so a later request with the same prefix reuses its K/V.
KVCacheManager turns a sequence's needs into block-table changes; the scheduler holds policy only.

Sliding-window models (Gemma 3) keep their layers' K/V in groups of equally many layers, a pool block
holding one group's K/V for block_size positions: the global layers' group in seq.block_table, each
group of local layers in seq.window_tables. A local group's blocks that fall out of the window of every
query still to come go back to the pool after each step (the entry becomes -1), and are never taken for
positions already out of it; `window_saved_blocks` counts the blocks live sequences do not hold thanks to
that. Prefix caching is off for such models (a cached prefix would need its window's local blocks too).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict

from engine.sequence import Sequence


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV-cache budget holds no block; raise the memory budget")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[bytes, int] = {}   # block digest -> block id
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences."""
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (ref 1), evicting the least recently freed cached blocks first."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                del self._cached[h]
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Share cached blocks with one more sequence."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; pass them tail first so a sequence's last blocks,
        least likely to be shared, are evicted first."""
        for b in blocks:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free[b] = None

    def cache(self, block: int, block_hash: bytes) -> None:
        """Register a full, computed block under its hash (the first block with a hash wins)."""
        if block_hash not in self._cached and self.block_hash[block] is None:
            self._cached[block_hash] = block
            self.block_hash[block] = block_hash

    def record_prefix_query(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_query_tokens += queried_tokens
        self.prefix_hit_tokens += hit_tokens

    def check_invariants(self, live_tables: list[list[int]]) -> None:
        """Every reference is held by a live sequence and every unreferenced block is free."""
        counts = [0] * self.num_blocks
        for table in live_tables:
            for b in table:
                counts[b] += 1
        assert counts == self.ref_cnt, "reference counts disagree with the live block tables"
        assert all((self.ref_cnt[b] == 0) == (b in self._free) for b in range(self.num_blocks))
        assert all(self.block_hash[b] == h for h, b in self._cached.items())


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, model_id: str, enable_prefix_caching: bool = True,
                 window_groups: int = 0, window: int = 0):
        """window_groups: how many groups of local layers attend over a sliding window of `window`
        positions (0: none, every layer's K/V in seq.block_table)."""
        if window_groups and window < 1:
            raise ValueError("window groups need a window of at least one position")
        self.pool = pool
        self.block_size = block_size
        self.model_id = model_id
        self._root_digest = hashlib.blake2b(model_id.encode(), digest_size=32).digest()
        self.window_groups = window_groups
        self.window = window
        self.enable_prefix_caching = enable_prefix_caching and not window_groups
        self.window_saved_blocks = 0   # local blocks live sequences released (or never took): out of the window

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_window_block(self, num_computed_tokens: int) -> int:
        """The first block a local layer still reads once num_computed_tokens are computed: the next
        query (at that position) sees the window - 1 positions before it."""
        return max(0, num_computed_tokens + 1 - self.window) // self.block_size if self.window_groups else 0

    def blocks_for_tokens(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks one sequence of num_tokens holds at once, computed in chunks of chunk_tokens."""
        n = self.blocks_needed(num_tokens)
        live = self.blocks_needed(self.window + chunk_tokens) + 1
        return n + self.window_groups * min(n, live)

    def max_tokens(self, chunk_tokens: int) -> int:
        """The longest sequence whose blocks the whole pool holds."""
        n = self.pool.num_blocks // (1 + self.window_groups) * self.block_size
        while self.blocks_for_tokens(n + self.block_size, chunk_tokens) <= self.pool.num_blocks:
            n += self.block_size
        return n

    def live_tables(self, seq: Sequence) -> list[list[int]]:
        """seq's block tables with the blocks it holds (for BlockPool.check_invariants)."""
        return [seq.block_table] + [[b for b in t if b >= 0] for t in seq.window_tables]

    def _update_hashes(self, seq: Sequence) -> None:
        """Extend seq.block_hashes over its full blocks: BLAKE2b(parent's digest, block tokens), the first
        block's parent being the model."""
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), seq.num_tokens // bs):
            digest = hashlib.blake2b(hashes[-1] if hashes else self._root_digest, digest_size=32)
            digest.update(array("q", seq.token_ids[i * bs:(i + 1) * bs]).tobytes())
            hashes.append(digest.digest())

    def find_cached_prefix(self, seq: Sequence) -> tuple[list[int], int]:
        """The longest run of cached full blocks at the start of seq, and the tokens they hold.
        At least one token is always left to compute, so the step yields the next token's logits. The
        scheduler records the query (pool.record_prefix_query) once it admits seq."""
        if not self.enable_prefix_caching:
            return [], 0
        self._update_hashes(seq)
        blocks = []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for h in seq.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return blocks, len(blocks) * self.block_size

    def _end_block(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int]) -> int:
        """How many blocks seq's table spans once num_new_tokens more tokens (after cached_blocks) are in."""
        return self.blocks_needed(seq.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens)

    def free_blocks_needed(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> int:
        """The free blocks allocate_slots(seq, num_new_tokens, cached_blocks) takes."""
        num_cached_free = sum(1 for b in cached_blocks if self.pool.ref_cnt[b] == 0)
        end = self._end_block(seq, num_new_tokens, cached_blocks)
        need = end - len(seq.block_table) - len(cached_blocks)
        local_end = len(seq.window_tables[0]) if seq.window_tables else 0
        # every local group takes the same blocks: from where its table ends, or the window starts
        need_local = max(0, end - max(local_end, self.first_window_block(seq.num_computed_tokens)))
        return max(need, 0) + self.window_groups * need_local + num_cached_free

    def blocks_freed_by(self, seqs: list[Sequence]) -> int:
        """The blocks that freeing all of seqs would give back to the pool (those no other sequence holds)."""
        held = Counter(b for seq in seqs for table in self.live_tables(seq) for b in table)
        return sum(1 for b, n in held.items() if self.pool.ref_cnt[b] == n)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make room for num_new_tokens more computed tokens; False (and no change) if the pool can't."""
        if self.free_blocks_needed(seq, num_new_tokens, cached_blocks) > self.pool.num_free_blocks:
            return False
        end = self._end_block(seq, num_new_tokens, cached_blocks)
        need = end - len(seq.block_table) - len(cached_blocks)
        if len(seq.window_tables) != self.window_groups:
            seq.window_tables = [[] for _ in range(self.window_groups)]
        first = self.first_window_block(seq.num_computed_tokens)
        if cached_blocks:
            self.pool.touch(list(cached_blocks))
            seq.block_table.extend(cached_blocks)
        if need > 0:
            seq.block_table.extend(self.pool.allocate(need))
        for table in seq.window_tables:
            skipped = max(0, first - len(table))
            table.extend([-1] * skipped)
            self.window_saved_blocks += skipped
            if end > len(table):
                table.extend(self.pool.allocate(end - len(table)))
        return True

    def release_out_of_window(self, seq: Sequence) -> None:
        """After a step: the local groups' blocks that no query still to come reads go back to the pool."""
        first = self.first_window_block(seq.num_computed_tokens)
        for table in seq.window_tables:
            dead = [b for b in table[:first] if b >= 0]
            if dead:
                self.pool.free(list(reversed(dead)))
                self.window_saved_blocks += len(dead)
                table[:first] = [-1] * min(first, len(table))

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """After a step: register the blocks that became full and computed."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(seq)
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes), len(seq.block_table))
        for i in range(full):
            self.pool.cache(seq.block_table[i], seq.block_hashes[i])

    def free(self, seq: Sequence) -> None:
        for table in seq.window_tables:
            self.pool.free([b for b in reversed(table) if b >= 0])
            self.window_saved_blocks -= sum(1 for b in table if b < 0)
        self.pool.free(list(reversed(seq.block_table)))
        seq.block_table = []
        seq.window_tables = []
