"""Paged attention for decode and prefill: one kernel, online softmax over chunks of the context.

Work item = (tile, kv head g, split): a tile is up to rows/G consecutive query tokens of one sequence at
consecutive positions (a decode token is a tile of one), G = num_heads / num_kv_heads query heads share each
K/V load, and the context 0..last position of the tile is walked `chunk` positions at a time:
  1. stage K[chunk] of head g in shared memory (gathered through the block table)
  2. scores s[r, j] = q_r . k_j * scale for the tile's rows r = (token, head), causal mask per row
  3. stage V[chunk]; per row: new max m', p = exp(s - m'), l = l e^(m - m') + sum p   (online softmax)
  4. acc[r] = acc[r] e^(m - m') + sum_j p[r, j] v_j
With one split the kernel writes out = acc / l; with several (long contexts and few work items), split z
covers positions [z*split_size, (z+1)*split_size) and writes (acc, m, l) for `attention_reduce` to merge.

Launch: grid = (tiles, num_kv_heads, splits), block = any power of two >= 32 (attn_threads).
Shared: 2*rows*dh_max + chunk*(dh_max+1) + rows*chunk + 3*rows floats (launch.py checks the 48 KiB limit).
"""
from __future__ import annotations

import functools
import math

from numba import cuda, float32

from cuda.kernels.common import F0, NEG, NEG_HALF


@functools.lru_cache(maxsize=None)
def attend(rows: int, chunk: int, dh_max: int):
    """The work item (nq query tokens tok0.. of sequence seq, kv head g, split z of nsplit) as a device function,
    shared by the per-op kernel and the persistent decode step. Shared buffers: q_s, acc_s rows*dh_max,
    kv_s chunk*(dh_max+1), s_s rows*chunk, m_s, l_s, c_s rows floats."""
    kv_stride = dh_max + 1  # padding: consecutive positions j of one column d fall in distinct banks

    @cuda.jit(device=True, fastmath=True)
    def attend_item(tok0, nq, seq, g, split, nsplit, qkv, k_cache, v_cache, block_tables, positions, num_heads,
                    num_kv_heads, scale, split_size, window, out, part_acc, part_ml, q_s, acc_s, kv_s, s_s, m_s, l_s,
                    c_s):
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        bs = k_cache.shape[1]
        dh = k_cache.shape[3]
        group = num_heads // num_kv_heads
        nrows = nq * group
        lo = split * split_size
        hi = min(lo + split_size, positions[tok0 + nq - 1] + 1)  # the tile's last token sees the most
        for e in range(tid, nrows * dh, nt):
            r = e // dh
            d = e - r * dh
            qi = r // group
            h = g * group + (r - qi * group)
            q_s[r * dh_max + d] = qkv[tok0 + qi, h * dh + d] * scale
            acc_s[r * dh_max + d] = F0
        for r in range(tid, rows, nt):
            m_s[r] = NEG
            l_s[r] = F0
            c_s[r] = F0
        cuda.syncthreads()  # q rows and running state initialised

        for c0 in range(lo, hi, chunk):
            jn = min(chunk, hi - c0)  # positions of this chunk
            # 1. K chunk -> shared
            for e in range(tid, jn * dh, nt):
                j = e // dh
                d = e - j * dh
                kp = c0 + j
                blk = block_tables[seq, kp // bs]
                kv_s[j * kv_stride + d] = k_cache[blk, kp % bs, g, d]
            cuda.syncthreads()  # K chunk staged
            # 2. scores with the causal mask of each row's own position
            for e in range(tid, nrows * jn, nt):
                r = e // jn
                j = e - r * jn
                kp = c0 + j
                sc = NEG
                qpos = positions[tok0 + r // group]
                if kp <= qpos and (window == 0 or kp > qpos - window):   # causal, and in a sliding window
                    sc = F0
                    for d in range(dh):
                        sc += q_s[r * dh_max + d] * kv_s[j * kv_stride + d]
                s_s[r * chunk + j] = sc
            cuda.syncthreads()  # scores complete, K no longer read
            # 3. V chunk -> shared, and the online-softmax update of each row (disjoint data)
            for e in range(tid, jn * dh, nt):
                j = e // dh
                d = e - j * dh
                kp = c0 + j
                blk = block_tables[seq, kp // bs]
                kv_s[j * kv_stride + d] = v_cache[blk, kp % bs, g, d]
            for r in range(tid, nrows, nt):
                m_old = m_s[r]
                mx = m_old
                for j in range(jn):
                    mx = max(mx, s_s[r * chunk + j])
                tot = F0
                for j in range(jn):
                    sc = s_s[r * chunk + j]
                    p = F0
                    if sc > NEG_HALF:
                        p = math.exp(sc - mx)
                    s_s[r * chunk + j] = p
                    tot += p
                corr = math.exp(m_old - mx)  # 0 on the first chunk with scores, 1 while all are masked
                l_s[r] = l_s[r] * corr + tot
                m_s[r] = mx
                c_s[r] = corr
            cuda.syncthreads()  # V chunk and probabilities ready
            # 4. rescale and accumulate p V
            for e in range(tid, nrows * dh, nt):
                r = e // dh
                d = e - r * dh
                a = acc_s[r * dh_max + d] * c_s[r]
                for j in range(jn):
                    a += s_s[r * chunk + j] * kv_s[j * kv_stride + d]
                acc_s[r * dh_max + d] = a
            cuda.syncthreads()  # kv_s and s_s are overwritten by the next chunk

        single = nsplit == 1
        for e in range(tid, nrows * dh, nt):
            r = e // dh
            d = e - r * dh
            qi = r // group
            h = g * group + (r - qi * group)
            t = tok0 + qi
            if single:
                out[t, h * dh + d] = acc_s[r * dh_max + d] / l_s[r]
            elif lo < hi:
                part_acc[t, h, split, d] = acc_s[r * dh_max + d]
                if d == 0:
                    part_ml[t, h, split, 0] = m_s[r]
                    part_ml[t, h, split, 1] = l_s[r]

        cuda.syncthreads()  # the shared buffers are reused by the next work item

    return attend_item


@functools.lru_cache(maxsize=None)
def paged_attention(rows: int, chunk: int, dh_max: int):
    q_size = rows * dh_max
    kv_size = chunk * (dh_max + 1)
    s_size = rows * chunk
    item = attend(rows, chunk, dh_max)

    @cuda.jit(fastmath=True)
    def paged_attention_kernel(qkv, k_cache, v_cache, block_tables, positions, token_seq, tile_tok0, tile_len,
                               num_heads, num_kv_heads, scale, split_size, window, out, part_acc, part_ml):
        """Causal attention of a tile's query rows over their sequence's paged K/V (see the module doc)."""
        q_s = cuda.shared.array(q_size, float32)
        acc_s = cuda.shared.array(q_size, float32)
        kv_s = cuda.shared.array(kv_size, float32)
        s_s = cuda.shared.array(s_size, float32)
        m_s = cuda.shared.array(rows, float32)
        l_s = cuda.shared.array(rows, float32)
        c_s = cuda.shared.array(rows, float32)
        tok0 = tile_tok0[cuda.blockIdx.x]
        item(tok0, tile_len[cuda.blockIdx.x], token_seq[tok0], cuda.blockIdx.y, cuda.blockIdx.z, cuda.gridDim.z,
             qkv, k_cache, v_cache, block_tables, positions, num_heads, num_kv_heads, scale, split_size, window,
             out, part_acc, part_ml, q_s, acc_s, kv_s, s_s, m_s, l_s, c_s)

    return paged_attention_kernel


@cuda.jit(device=True, fastmath=True)
def merge_split(t, h, d, part_acc, part_ml, positions, split_size, out):
    """out[t, h*dh + d] from the split-K partials: sum_z acc_z e^(m_z - M) / sum_z l_z e^(m_z - M) over the
    splits z that hold positions <= positions[t]."""
    dh = part_acc.shape[3]
    nsplit = positions[t] // split_size + 1
    mx = NEG
    for z in range(nsplit):
        mx = max(mx, part_ml[t, h, z, 0])
    num = F0
    den = F0
    for z in range(nsplit):
        w = math.exp(part_ml[t, h, z, 0] - mx)
        num += part_acc[t, h, z, d] * w
        den += part_ml[t, h, z, 1] * w
    out[t, h * dh + d] = num / den


@cuda.jit(fastmath=True)
def attention_reduce(part_acc, part_ml, positions, split_size, out):
    """Merge the split-K partials of token t (grid = T), see merge_split."""
    t = cuda.blockIdx.x
    nh = part_acc.shape[1]
    dh = part_acc.shape[3]
    for e in range(cuda.threadIdx.x, nh * dh, cuda.blockDim.x):
        h = e // dh
        merge_split(t, h, e - h * dh, part_acc, part_ml, positions, split_size, out)
