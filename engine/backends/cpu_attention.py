"""Attention over the paged KV cache as numba kernels for the CPU (layouts: tests/reference.py): RoPE and
the cache write, then each query token's causal attention over its sequence's blocks, split into items that
threads take (_attention_plan), inside a parallel region of its own or the layer loop's (cpu_claims).

The kernels use the 16-lane SIMD values of cpu_simd (accumulators in registers, a vector exp), with plain
code for head sizes that are not multiples of 16.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.backends import cpu_claims, cpu_simd
from engine.backends.cpu_cache import flush_stale_caches
from engine.backends.cpu_claims import claim, finish, wait
from engine.backends.cpu_simd import (
    F, U, addr, ld_f, ld_i64, prefetch_l2, st_f, vadd, vbcast_f, vexp, vfma, vhmax, vload_f, vmax, vmul, vpairsum1,
    vpairsum2, vpairsum4, vpairsum8, vstore_f, vsub, vsum, vzero_f,
)

# No weights to read ahead (warm_a, warm_b) during an attention
NOTHING_TO_WARM = np.zeros(0, np.uint8)

# Attention runs on one thread below this much work (query heads x context positions of the step):
# a parallel region costs more than a short decode context's whole attention.
ATTN_PARALLEL_MIN_WORK = 4096
# A one-token step whose context has more than SPLIT_PART_KEYS keys splits its attention over the keys, in
# parts of SPLIT_PART_KEYS (a multiple of 16) that every thread takes, and combines the parts after.
SPLIT_PART_KEYS = 64


@njit(cache=True, nogil=True, inline="always")
def first_key(position, window):
    """The first position a query at `position` attends to: 0, or the start of its sliding window
    (window > 0: the window holds the query's own position and the window - 1 before it)."""
    return max(0, position + 1 - window) if window > 0 else 0


@njit(cache=True, nogil=True, inline="always")
def _item_keys(item, num_kv_heads, token_seq, positions, window):
    """Item `item` of the (token, kv head) grid: (its token t, kv head, sequence, first key, one past its
    last key)."""
    t = item // num_kv_heads
    return t, item % num_kv_heads, token_seq[t], first_key(positions[t], window), positions[t] + 1


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _rotate(v, off, cos, sin, p, half):
    """Rotate-half RoPE of v[off : off + 2*half] at table row p, in place."""
    for i in range(half):
        a = v[off + i]
        b = v[off + half + i]
        c = cos[p, i]
        s = sin[p, i]
        v[off + i] = a * c - b * s
        v[off + half + i] = b * c + a * s


@njit(cache=True, nogil=True, fastmath=True)
def rope_store_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads):
    """Rotate q in place inside qkv; rotate k and write k, v into the paged cache at each token's slot."""
    bs = k_cache.shape[1]
    dh = k_cache.shape[3]
    half = dh // 2
    q_size = num_heads * dh
    kv_size = num_kv_heads * dh
    for t in range(qkv.shape[0]):
        p = positions[t]
        row = qkv[t]
        for h in range(num_heads):
            _rotate(row, h * dh, cos, sin, p, half)
        for h in range(num_kv_heads):
            _rotate(row, q_size + h * dh, cos, sin, p, half)
        slot = slot_mapping[t]
        blk, off = slot // bs, slot % bs
        for h in range(num_kv_heads):
            for i in range(dh):
                k_cache[blk, off, h, i] = row[q_size + h * dh + i]
                v_cache[blk, off, h, i] = row[q_size + kv_size + h * dh + i]


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _softmax_numerators(sp, so, n, n16):
    """The n scores at sp[so:] -> exp(score - max), in place, with the row padded to n16 (a multiple of
    16) by scores of -1e30 (numerators of 0); returns (the max, the numerators' sum)."""
    for j in range(n, n16):
        st_f(sp, so + U(j), F(-1e30))
    mx = vload_f(sp, so)
    for j in range(16, n16, 16):
        mx = vmax(mx, vload_f(sp, so + U(j)))
    m = vbcast_f(vhmax(mx))
    tot = vzero_f()
    for j in range(0, n16, 16):
        e = vexp(vsub(vload_f(sp, so + U(j)), m))
        vstore_f(sp, so + U(j), e)
        tot = vadd(tot, e)
    return vhmax(mx), vsum(tot)


@njit(cache=True, nogil=True, fastmath=True)
def _attend_items(c, stride, qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads,
                  scale, out, scores, o, window):
    """Items c, c + stride, ... of the (token, kv head) grid: the `group` query heads sharing kv head kvh
    attend over the token's positions first_key(p, window)..p (p = positions[t]) through its sequence's
    block table.
    Needs head_dim % 16 == 0. (Raw addresses in the loops: see cpu_int8's note on reference counts.)"""
    bs, dh = k_cache.shape[1], k_cache.shape[3]
    group = num_heads // num_kv_heads
    nitems = qkv.shape[0] * num_kv_heads
    sld = scores.shape[0] // group
    qp, kp, vp, outp, sp, opp = addr(qkv), addr(k_cache), addr(v_cache), addr(out), addr(scores), addr(o)
    qld, old = U(qkv.shape[1]), U(out.shape[1])
    nv = U(dh // 16)
    pos_stride = U(num_kv_heads * dh)  # items between consecutive positions of one block
    for item in range(c, nitems, stride):
        t, kvh, s, lo, end = _item_keys(item, num_kv_heads, token_seq, positions, window)
        n = end - lo
        q0 = U(t) * qld + U(kvh * group * dh)
        # scores = q . k_j * scale, j counted from the first key in the window
        for jb in range(lo // bs, (end + bs - 1) // bs):
            base = U(block_tables[s, jb]) * U(bs) * pos_stride + U(kvh * dh)
            for off in range(max(0, lo - jb * bs), min(bs, end - jb * bs)):
                ko = base + U(off) * pos_stride
                j = U(jb * bs + off - lo)
                for gi in range(U(group)):
                    qo = q0 + gi * U(dh)
                    acc = vmul(vload_f(qp, qo), vload_f(kp, ko))
                    for v in range(U(1), nv):
                        acc = vfma(vload_f(qp, qo + U(16) * v), vload_f(kp, ko + U(16) * v), acc)
                    st_f(sp, gi * U(sld) + j, vsum(acc) * scale)
        # softmax numerators, 1 / sum kept at index n
        n16 = (n + 15) // 16 * 16
        for gi in range(U(group)):
            so = gi * U(sld)
            st_f(sp, so + U(n), F(1.0) / _softmax_numerators(sp, so, n, n16)[1])
            for v in range(nv):
                vstore_f(opp, gi * U(dh) + U(16) * v, vzero_f())
        # o = p @ V
        for jb in range(lo // bs, (end + bs - 1) // bs):
            base = U(block_tables[s, jb]) * U(bs) * pos_stride + U(kvh * dh)
            for off in range(max(0, lo - jb * bs), min(bs, end - jb * bs)):
                vo = base + U(off) * pos_stride
                j = U(jb * bs + off - lo)
                for gi in range(U(group)):
                    p = vbcast_f(ld_f(sp, gi * U(sld) + j))
                    oo = gi * U(dh)
                    for v in range(nv):
                        vstore_f(opp, oo + U(16) * v, vfma(vload_f(vp, vo + U(16) * v), p, vload_f(opp, oo + U(16) * v)))
        for gi in range(U(group)):
            inv = vbcast_f(ld_f(sp, gi * U(sld) + U(n)))
            for v in range(nv):
                vstore_f(outp, U(t) * old + U(kvh * group * dh) + gi * U(dh) + U(16) * v,
                         vmul(vload_f(opp, gi * U(dh) + U(16) * v), inv))


@njit(cache=True, nogil=True, fastmath=True)
def _part(qp, qo, kp, kop, j, nc):
    """q . k_j as a vector of partial sums (q at item qo; k_j at the item offset kop[j]), nc chunks of 64."""
    ko = U(ld_i64(kop, j))
    a = vmul(vload_f(qp, qo), vload_f(kp, ko))
    a = vfma(vload_f(qp, qo + U(16)), vload_f(kp, ko + U(16)), a)
    a = vfma(vload_f(qp, qo + U(32)), vload_f(kp, ko + U(32)), a)
    a = vfma(vload_f(qp, qo + U(48)), vload_f(kp, ko + U(48)), a)
    for c in range(U(1), nc):
        o = U(64) * c
        for v in range(U(4)):
            a = vfma(vload_f(qp, qo + o + U(16) * v), vload_f(kp, ko + o + U(16) * v), a)
    return a


@njit(cache=True, nogil=True, fastmath=True)
def _scores16(qp, qo, kp, kop, j0, nc):
    """q . k_j for the 16 keys j0 .. j0+15, one per lane: 16 partial-sum vectors folded by a tree
    of pair sums (fed in bit-reversed key order, so that the lanes come out in key order)."""
    a0 = vpairsum8(_part(qp, qo, kp, kop, j0, nc), _part(qp, qo, kp, kop, j0 + U(8), nc))
    a1 = vpairsum8(_part(qp, qo, kp, kop, j0 + U(4), nc), _part(qp, qo, kp, kop, j0 + U(12), nc))
    a2 = vpairsum8(_part(qp, qo, kp, kop, j0 + U(2), nc), _part(qp, qo, kp, kop, j0 + U(10), nc))
    a3 = vpairsum8(_part(qp, qo, kp, kop, j0 + U(6), nc), _part(qp, qo, kp, kop, j0 + U(14), nc))
    a4 = vpairsum8(_part(qp, qo, kp, kop, j0 + U(1), nc), _part(qp, qo, kp, kop, j0 + U(9), nc))
    a5 = vpairsum8(_part(qp, qo, kp, kop, j0 + U(5), nc), _part(qp, qo, kp, kop, j0 + U(13), nc))
    a6 = vpairsum8(_part(qp, qo, kp, kop, j0 + U(3), nc), _part(qp, qo, kp, kop, j0 + U(11), nc))
    a7 = vpairsum8(_part(qp, qo, kp, kop, j0 + U(7), nc), _part(qp, qo, kp, kop, j0 + U(15), nc))
    return vpairsum1(vpairsum2(vpairsum4(a0, a1), vpairsum4(a2, a3)), vpairsum2(vpairsum4(a4, a5), vpairsum4(a6, a7)))


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _weighted_v64(vp, kop, co, sp, so, n, dst, do, inv):
    """dst[do : do + 64] = inv * the sum over keys j < n of weight sp[so + j] times the 64 values of V at item
    kop[j] + co (four independent accumulators; every argument an address or item offset)."""
    o0 = vzero_f()
    o1 = vzero_f()
    o2 = vzero_f()
    o3 = vzero_f()
    for j in range(U(n)):
        vo = U(ld_i64(kop, j)) + co
        p = vbcast_f(ld_f(sp, so + j))
        o0 = vfma(vload_f(vp, vo), p, o0)
        o1 = vfma(vload_f(vp, vo + U(16)), p, o1)
        o2 = vfma(vload_f(vp, vo + U(32)), p, o2)
        o3 = vfma(vload_f(vp, vo + U(48)), p, o3)
    vstore_f(dst, do, vmul(o0, inv))
    vstore_f(dst, do + U(16), vmul(o1, inv))
    vstore_f(dst, do + U(32), vmul(o2, inv))
    vstore_f(dst, do + U(48), vmul(o3, inv))


@njit(cache=True, nogil=True, fastmath=True)
def _attend_items64(c, stride, qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads,
                    scale, out, scores, kofs, window):
    """_attend_items for head sizes that are multiples of 64: scores 16 keys at a time, and the
    weighted sum of V with its 64-wide output chunk in registers."""
    bs, dh = k_cache.shape[1], k_cache.shape[3]
    group = num_heads // num_kv_heads
    nitems = qkv.shape[0] * num_kv_heads
    sld = kofs.shape[0]
    qp, kp, vp, outp, sp, kop = addr(qkv), addr(k_cache), addr(v_cache), addr(out), addr(scores), addr(kofs)
    qld, old = U(qkv.shape[1]), U(out.shape[1])
    nc = U(dh // 64)
    pos_stride = num_kv_heads * dh
    vscale = vbcast_f(scale)
    for item in range(c, nitems, stride):
        t, kvh, s, lo, end = _item_keys(item, num_kv_heads, token_seq, positions, window)
        n = end - lo
        n16 = (n + 15) // 16 * 16
        # item offsets of each key's k (and v) in the cache, from the window's first; the padding repeats the last
        j = 0
        for jb in range(lo // bs, (end + bs - 1) // bs):
            base = block_tables[s, jb] * bs * pos_stride + kvh * dh
            for off in range(max(0, lo - jb * bs), min(bs, end - jb * bs)):
                kofs[j] = base + off * pos_stride
                j += 1
        for j in range(n, n16):
            kofs[j] = kofs[n - 1]
        q0 = U(t) * qld + U(kvh * group * dh)
        for gi in range(U(group)):
            qo = q0 + gi * U(dh)
            so = gi * U(sld)
            for j0 in range(0, n16, 16):
                vstore_f(sp, so + U(j0), vmul(_scores16(qp, qo, kp, kop, U(j0), nc), vscale))
            inv = vbcast_f(F(1.0) / _softmax_numerators(sp, so, n, n16)[1])
            for ch in range(nc):
                co = U(64) * ch
                _weighted_v64(vp, kop, co, sp, so, n, outp, U(t) * old + U(kvh * group * dh) + gi * U(dh) + co, inv)


@njit(cache=True, nogil=True, fastmath=True)
def _attend_part(part, qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads, scale,
                 partial, window, scores):
    """Part `part` of a one-token step's attention split over its keys (SPLIT_PART_KEYS a part), for head
    sizes that are multiples of 64: per query head, the part's largest score m, the sum l of exp(score - m)
    and the sum of exp(score - m) * v, into partial[part, head] (dh sums, then m and l). The scores go
    16 keys at a time through every kv head's row of those keys (one key's heads lie side by side).
    scores: scratch of num_heads * (SPLIT_PART_KEYS + 16)."""
    bs, dh = k_cache.shape[1], k_cache.shape[3]
    group = num_heads // num_kv_heads
    s = token_seq[0]
    k0 = first_key(positions[0], window) + part * SPLIT_PART_KEYS
    n = min(positions[0] + 1 - k0, SPLIT_PART_KEYS)
    n16 = (n + 15) // 16 * 16
    sld = SPLIT_PART_KEYS + 16
    kofs = np.empty(sld, np.int64)
    pos_stride = num_kv_heads * dh
    for j in range(n):     # item offset of each key's row (every kv head) in the cache; the padding repeats the last
        key = k0 + j
        kofs[j] = (block_tables[s, key // bs] * bs + key % bs) * pos_stride
    for j in range(n, n16):
        kofs[j] = kofs[n - 1]
    qp, kp, vp, sp, kop, pp = addr(qkv), addr(k_cache), addr(v_cache), addr(scores), addr(kofs), addr(partial)
    nc = U(dh // 64)
    vscale = vbcast_f(scale)
    row = U(4 * pos_stride)      # bytes of a key's row
    for j in range(n):          # V is read after the scores: its lines come in meanwhile
        for line in range(U(0), row, U(64)):
            prefetch_l2(vp, U(4) * U(kofs[j]) + line)
    for j0 in range(0, n16, 16):
        for j in range(j0 + 16, min(j0 + 32, n)):    # the next 16 keys' rows
            for line in range(U(0), row, U(64)):
                prefetch_l2(kp, U(4) * U(kofs[j]) + line)
        for h in range(num_heads):
            kh = kp + U(4 * (h // group) * dh)     # bytes: this head's kv head within a key's row
            vstore_f(sp, U(h) * U(sld) + U(j0), vmul(_scores16(qp, U(h) * U(dh), kh, kop, U(j0), nc), vscale))
    for h in range(num_heads):
        so = U(h) * U(sld)
        m, total = _softmax_numerators(sp, so, n, n16)
        po = (U(part) * U(num_heads) + U(h)) * U(dh + 2)
        vh = U(h // group) * U(dh)
        for ch in range(nc):
            _weighted_v64(vp, kop, U(64) * ch + vh, sp, so, n, pp, po + U(64) * ch, vbcast_f(F(1.0)))
        st_f(pp, po + U(dh), m)
        st_f(pp, po + U(dh + 1), total)


@njit(cache=True, nogil=True, fastmath=True)
def _combine_parts(parts, partial, out):
    """out[0] from the parts of a split attention: each part's sums scaled by exp(its max - the largest),
    over the scaled numerators' total."""
    num_heads, dh = partial.shape[1], partial.shape[2] - 2
    for h in range(num_heads):
        mx = partial[0, h, dh]
        for k in range(1, parts):
            mx = max(mx, partial[k, h, dh])
        total = F(0.0)
        for i in range(dh):
            out[0, h * dh + i] = 0.0
        for k in range(parts):
            w = np.exp(partial[k, h, dh] - mx)
            total += w * partial[k, h, dh + 1]
            for i in range(dh):
                out[0, h * dh + i] += w * partial[k, h, i]
        inv = F(1.0) / total
        for i in range(dh):
            out[0, h * dh + i] *= inv


@njit(cache=True, nogil=True, inline="always")
def split_parts(positions):
    """The most parts a split attention can have at a step's positions (the room split_scratch and
    paged_attention give it): none unless the step has one token."""
    return (positions.max() + SPLIT_PART_KEYS) // SPLIT_PART_KEYS if positions.shape[0] == 1 else 0


def split_scratch(positions: np.ndarray, num_heads: int, head_dim: int) -> np.ndarray:
    """Room for the parts of a split attention (rope_attention_claimed's `partial`) at a step's positions."""
    return np.empty((split_parts(positions), num_heads, head_dim + 2), np.float32)


# How a step's attention is split into items (_attention_plan): one (token, kv head) an item in plain
# code (head sizes not a multiple of 16); the whole attention as one item, with the warming of the next
# matmul's weights as a second where given (small attentions); up to 16 interleaved chunks of items; or,
# for one token with a long context, the warming first where given, then parts of its keys that a last
# pass combines.
_PLAIN_ITEMS, _ONE_ITEM, _CHUNKS, _SPLIT = 0, 1, 2, 3


@njit(cache=True, nogil=True, inline="always")
def _warming(warm_a, warm_b):
    """1 where there are next weights to warm (an item of their own), else 0."""
    return np.int64(1 if warm_a.shape[0] + warm_b.shape[0] > 0 else 0)


@njit(cache=True, nogil=True, inline="always")
def _attention_plan(qkv, positions, k_cache, num_heads, num_kv_heads, window, warm_a, warm_b, split_room):
    """(how, items, the longest context) of the step's attention: items run in parallel.
    Items (token, kv head) run on one thread when the step's attention is small (short decodes), else
    spread over threads round-robin (a prefill's later tokens see longer contexts). While one thread
    does a small attention, another reads warm_a and warm_b (the next matmul's weights) into the
    caches: memory would sit idle otherwise. One token with a long context (a decode at batch 1) has
    too few (token, kv head) items to keep every thread busy: its keys split into parts instead, where
    split_room (the parts the caller has room for) allows."""
    max_n = 0
    work = 0
    for t in range(qkv.shape[0]):
        keys = positions[t] + 1 - first_key(positions[t], window)
        max_n = max(max_n, keys)
        work += keys
    nitems = qkv.shape[0] * num_kv_heads
    if k_cache.shape[3] % 16:
        return _PLAIN_ITEMS, np.int64(nitems), np.int64(max_n)
    parts = (max_n + SPLIT_PART_KEYS - 1) // SPLIT_PART_KEYS
    if qkv.shape[0] == 1 and k_cache.shape[3] % 64 == 0 and 2 <= parts <= split_room:
        return _SPLIT, parts + _warming(warm_a, warm_b), np.int64(max_n)
    if work * num_heads < ATTN_PARALLEL_MIN_WORK or nitems == 1:
        return _ONE_ITEM, 1 + _warming(warm_a, warm_b), np.int64(max_n)
    return _CHUNKS, np.int64(min(nitems, 16)), np.int64(max_n)


@njit(cache=True, nogil=True, fastmath=True)
def _attention_item(how, j, items, qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads,
                    num_kv_heads, scale, out, max_n, window, warm_a, warm_b, sink, partial):
    """Item j of the plan's `items`."""
    if how == _SPLIT and j >= _warming(warm_a, warm_b):
        scores = np.empty(num_heads * (SPLIT_PART_KEYS + 16), np.float32)
        _attend_part(j - _warming(warm_a, warm_b), qkv, k_cache, v_cache, block_tables, positions, token_seq,
                     num_heads, num_kv_heads, scale, partial, window, scores)
    elif how == _PLAIN_ITEMS:
        _attend_scalar(j, qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads,
                       scale, out, window)
    elif how == _CHUNKS:
        _attend(j, items, qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads,
                scale, out, max_n, window)
    elif how == _ONE_ITEM and j == 0:
        _attend(np.int64(0), np.int64(1), qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads,
                num_kv_heads, scale, out, max_n, window)
    else:
        _touch(warm_a, warm_b, sink)


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _paged_attention(qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads, scale, out,
                     warm_a, warm_b, sink, window):
    """Causal attention over the paged cache: query token t of sequence token_seq[t] at positions[t]
    attends to that sequence's positions 0..positions[t] (the last `window` of them when window > 0),
    found through its block table. Its items (_attention_plan) in parallel."""
    dh = k_cache.shape[3]
    partial = np.empty((split_parts(positions), num_heads, dh + 2), np.float32)
    how, items, mx = _attention_plan(qkv, positions, k_cache, num_heads, num_kv_heads, window, warm_a, warm_b,
                                     partial.shape[0])
    # the helpers get exactly one signature each (a prange index is unsigned; literals are not)
    sc, win = F(scale), np.int64(window)
    if items == 1:
        _attention_item(how, np.int64(0), items, qkv, k_cache, v_cache, block_tables, positions, token_seq,
                        num_heads, num_kv_heads, sc, out, mx, win, warm_a, warm_b, sink, partial)
    else:
        for j in prange(items):
            _attention_item(how, np.int64(j), items, qkv, k_cache, v_cache, block_tables, positions, token_seq,
                            num_heads, num_kv_heads, sc, out, mx, win, warm_a, warm_b, sink, partial)
    if how == _SPLIT:
        _combine_parts(items - _warming(warm_a, warm_b), partial, out)


@njit(cache=True, nogil=True, fastmath=True)
def _attend(c, stride, qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads,
            scale, out, max_n, window):
    """The scratch lives here, not in the items functions: they use it only through raw addresses,
    which would not keep it alive (see cpu_simd.addr)."""
    group = num_heads // num_kv_heads
    sld = max_n + 16  # scores padded to a multiple of 16, plus a slot for 1 / sum
    scores = np.empty(group * sld, np.float32)
    if k_cache.shape[3] % 64 == 0:
        kofs = np.empty(sld, np.int64)
        _attend_items64(c, stride, qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads,
                        num_kv_heads, scale, out, scores, kofs, window)
    else:
        o = np.empty(group * k_cache.shape[3], np.float32)
        _attend_items(c, stride, qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads,
                      num_kv_heads, scale, out, scores, o, window)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def paged_attention(qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads, scale, out,
                    window=0):
    """Causal attention over the paged cache: query token t of sequence token_seq[t] at positions[t]
    attends to that sequence's positions 0..positions[t] (the last `window` of them when window > 0),
    found through its block table."""
    _paged_attention(qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads, scale, out,
                     NOTHING_TO_WARM, NOTHING_TO_WARM, np.zeros(1, np.int64), window)


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def rope_attention(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables, token_seq, num_heads,
                   num_kv_heads, scale, out, warm_a, warm_b, window=0):
    """rope_store_kv then paged_attention, in one call; warm_a, warm_b (uint8 views, may be empty): the
    next matmul's weights, read into the caches by an otherwise idle thread during a small attention."""
    rope_store_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
    _paged_attention(qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads, scale, out,
                     warm_a, warm_b, np.zeros(1, np.int64), window)


@njit(cache=True, nogil=True, fastmath=True)
def rope_attention_claimed(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables, token_seq,
                           num_heads, num_kv_heads, scale, out, warm_a, warm_b, window, partial, counters, phase):
    """One thread's part of rope_attention inside a parallel region that runs the whole layer loop
    (cpu_claims): the rotation and cache write as phase `phase` (one item), the attention's items as
    phase + 1, and a split attention's combining as phase + 2 (one item). partial: split_scratch's room
    for a split attention's parts, shared by the threads."""
    if claim(counters, phase, 1) == 0:
        rope_store_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
        finish(counters, phase, 1)
    wait(counters, phase, 1)
    how, items, mx = _attention_plan(qkv, positions, k_cache, num_heads, num_kv_heads, window, warm_a, warm_b,
                                     partial.shape[0])
    sink = np.zeros(1, np.int64)
    j = claim(counters, phase + 1, 1)
    while j < items:
        _attention_item(how, j, items, qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads,
                        num_kv_heads, F(scale), out, mx, np.int64(window), warm_a, warm_b, sink, partial)
        finish(counters, phase + 1, 1)
        j = claim(counters, phase + 1, 1)
    wait(counters, phase + 1, items)
    if how == _SPLIT:
        if claim(counters, phase + 2, 1) == 0:
            _combine_parts(items - _warming(warm_a, warm_b), partial, out)
            finish(counters, phase + 2, 1)
        wait(counters, phase + 2, 1)


@njit(cache=True, nogil=True)
def _touch(a, b, sink):
    """Read one byte of every cache line of a and b (so that they come into the caches)."""
    s = 0
    for i in range(0, a.shape[0], 64):
        s += a[i]
    for i in range(0, b.shape[0], 64):
        s += b[i]
    sink[0] = s


@njit(cache=True, nogil=True, fastmath=True)
def _attend_scalar(item, qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads,
                   scale, out, window):
    """The plain form of one (token, kv head) item, for head sizes that are not multiples of 16."""
    bs, dh = k_cache.shape[1], k_cache.shape[3]
    group = num_heads // num_kv_heads
    t, kvh, s, lo, end = _item_keys(item, num_kv_heads, token_seq, positions, window)
    n = end - lo
    scores = np.empty(n, np.float32)
    o = np.empty(dh, np.float32)
    for h in range(kvh * group, (kvh + 1) * group):
        mx = F(-np.inf)
        for j in range(n):
            blk, off = block_tables[s, (lo + j) // bs], (lo + j) % bs
            acc = F(0.0)
            for i in range(dh):
                acc += qkv[t, h * dh + i] * k_cache[blk, off, kvh, i]
            scores[j] = acc * scale
            mx = max(mx, scores[j])
        total = F(0.0)
        for j in range(n):
            scores[j] = np.exp(scores[j] - mx)
            total += scores[j]
        o[:] = 0.0
        for j in range(n):
            blk, off = block_tables[s, (lo + j) // bs], (lo + j) % bs
            for i in range(dh):
                o[i] += scores[j] * v_cache[blk, off, kvh, i]
        for i in range(dh):
            out[t, h * dh + i] = o[i] / total


flush_stale_caches(globals(), "cpu_attention", cpu_simd.__file__, cpu_claims.__file__)
