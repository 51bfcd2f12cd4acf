"""BlockPool and KVCacheManager: reference counts, LRU eviction, prefix hashing."""
import pytest

from engine.kv_cache import BlockPool, KVCacheManager
from engine.request import EngineRequest
from engine.sampling import SamplingParams
from engine.sequence import Sequence


def _seq(seq_id, tokens):
    return Sequence(seq_id, EngineRequest(f"r{seq_id}", "m", list(tokens), SamplingParams()), 0, seed=0)


def test_allocate_free_and_double_free():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free_blocks == 1 and pool.usage == 0.75
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    pool.free(a)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([a[0]])


def test_cached_blocks_survive_free_and_evict_least_recent_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"111")
    pool.cache(b, b"222")
    pool.free([b, a, c])          # b freed first -> evicted first
    assert pool.lookup(b"111") == a and pool.lookup(b"222") == b
    (first,) = pool.allocate(1)
    assert first == b and pool.lookup(b"222") is None and pool.lookup(b"111") == a
    pool.touch([a])               # a hit takes the block out of the free queue
    assert pool.ref_cnt[a] == 1 and pool.num_free_blocks == 1
    pool.check_invariants([[first], [a]])


def test_prefix_hits_share_blocks_and_keep_one_token_to_compute():
    pool = BlockPool(16)
    kv = KVCacheManager(pool, block_size=4, model_id="m")
    s1 = _seq(1, range(10))
    assert kv.allocate_slots(s1, 10)
    s1.num_computed_tokens = 10
    kv.cache_computed_blocks(s1)             # 2 full blocks cached
    s2 = _seq(2, list(range(8)) + [99, 98])
    blocks, hit = kv.find_cached_prefix(s2)
    assert blocks == s1.block_table[:2] and hit == 8
    assert kv.allocate_slots(s2, 2, blocks)
    assert s2.block_table[:2] == s1.block_table[:2] and pool.ref_cnt[blocks[0]] == 2
    s3 = _seq(3, range(8))                   # fully cached prompt: the last block is recomputed
    assert kv.find_cached_prefix(s3)[1] == 4
    s4 = _seq(4, [5] + list(range(1, 10)))   # the chain: a changed first block misses everything
    assert kv.find_cached_prefix(s4) == ([], 0)
    kv.free(s1)
    kv.free(s2)
    pool.check_invariants([])


def test_allocate_slots_is_all_or_nothing():
    pool = BlockPool(3)
    kv = KVCacheManager(pool, block_size=4, model_id="m")
    s = _seq(1, range(20))
    assert not kv.allocate_slots(s, 20)
    assert s.block_table == [] and pool.num_free_blocks == 3
    assert kv.allocate_slots(s, 12) and len(s.block_table) == 3


def test_hash_depends_on_model():
    pool = BlockPool(8)
    a = KVCacheManager(pool, 4, "model-a")
    b = KVCacheManager(pool, 4, "model-b")
    s = _seq(1, range(9))
    a.allocate_slots(s, 9)
    s.num_computed_tokens = 9
    a.cache_computed_blocks(s)
    assert b.find_cached_prefix(_seq(2, range(9)))[1] == 0
    assert a.find_cached_prefix(_seq(3, range(9)))[1] == 8


def test_a_block_is_found_by_its_tokens_not_by_pythons_hash(monkeypatch):
    """Every org's prompts share the cache: keys that Python's hash() made equal (its tuple hash can be
    collided) would run one prompt on another's K/V. The digests do not go through hash() at all."""
    import builtins
    monkeypatch.setattr(builtins, "hash", lambda value: 0)     # every key it makes collides
    kv = KVCacheManager(BlockPool(8), 4, "m")
    s = _seq(1, range(9))
    kv.allocate_slots(s, 9)
    s.num_computed_tokens = 9
    kv.cache_computed_blocks(s)
    assert kv.find_cached_prefix(_seq(2, range(100, 109)))[1] == 0
    assert kv.find_cached_prefix(_seq(3, range(9)))[1] == 8
    assert all(len(h) == 32 for h in s.block_hashes)
