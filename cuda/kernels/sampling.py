"""Sampling on the device: one block per row of logits, the semantics of engine/backends/cpu_sampler.py.

Per row: logit_bias, the min_tokens mask, the grammar's allowed-token mask (packed uint32 bits; a row
without a constraint has allowed_row -1 and reads none), repetition/frequency/presence penalties (once per distinct token
of the history), then greedy argmax (temperature 0) or a draw from softmax((w - max) / T) restricted by
top-k, then top-p on the top-k set, then min-p, as the inverse CDF of u(seed, step) over the kept tokens in
the CPU sampler's draw order (token t at (t mod nb, t div nb), nb = ceil(V / 64)). Logprobs are those of the
raw logits; the top ones are ordered (logit desc, token id asc).

Nothing is sorted: cuts are found by bisection over an order-preserving int key of the logits (32 steps)
and then over token ids for ties (~log2 V steps), each step one block-wide reduction.
u = splitmix64(splitmix64(seed) + step) in 64-bit integer arithmetic; its top 24 bits give a float32 in
[0, 1) (the CPU uses 53 bits in float64: the two can differ only when u lands within 2^-24 of a CDF step).

Launch: grid = S, block = sample_threads (power of two <= 1024).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, int64, uint64

from cuda.kernels.common import F0, F1, MAX_BLOCK, NEG, SIMULATOR, block_argmax, block_max, block_sum

DRAW_BLOCK = 64                      # cpu_sampler_primitives.BLOCK: the draw order's block length
NO_CUT_KEY = np.int64(-(1 << 31) - 1)  # below every key: "no cut"
KEY_MIN = np.int64(-(1 << 31))
KEY_MAX = np.int64((1 << 31) - 1)
DONE = np.int32(1 << 30)             # cnt flag: this token's penalties are applied
U24 = np.float32(1.0 / (1 << 24))
SM_INC = np.uint64(0x9E3779B97F4A7C15)
SM_M1 = np.uint64(0xBF58476D1CE4E5B9)
SM_M2 = np.uint64(0x94D049BB133111EB)
S30 = np.uint64(30)
S27 = np.uint64(27)
S31 = np.uint64(31)
S40 = np.uint64(40)
FLIP = np.int64(0x7FFFFFFF)

if SIMULATOR:
    def float_as_int(v):
        return int(np.array([v], np.float32).view(np.int32)[0])

    def splitmix64(x):
        x = int(x)
        m = (1 << 64) - 1
        z = (x + int(SM_INC)) & m
        z = ((z ^ (z >> 30)) * int(SM_M1)) & m
        z = ((z ^ (z >> 27)) * int(SM_M2)) & m
        return np.uint64(z ^ (z >> 31))
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def float_as_int(v):
        return libdevice.float_as_int(v)

    @cuda.jit(device=True)
    def splitmix64(x):
        z = x + SM_INC
        z = (z ^ (z >> S30)) * SM_M1
        z = (z ^ (z >> S27)) * SM_M2
        return z ^ (z >> S31)


@cuda.jit(device=True)
def uniform01(seed, step):
    """u in [0, 1) from (seed, step): float32 of the top 24 bits of splitmix64(splitmix64(seed) + step)."""
    z = splitmix64(splitmix64(uint64(seed)) + uint64(step))
    return float32(z >> S40) * U24


@cuda.jit(device=True)
def order_key(v):
    """An int whose order is the order of the float32 v (for finite v)."""
    k = int64(float_as_int(v))
    if k < 0:
        k = k ^ FLIP
    return k


@cuda.jit(device=True)
def at_or_before(key, t, cut_key, cut_id):
    """Token (key, t) comes no later than (cut_key, cut_id) in the order (logit desc, id asc)."""
    return key > cut_key or (key == cut_key and t <= cut_id)


@cuda.jit(device=True)
def mass_through(w, i, vocab, m, inv_t, use_z, ck, cid, key, tid_cut, buf):
    """Sum over tokens within both cuts (ck, cid) and (key, tid_cut) of z = exp((w - m) / T), or of 1."""
    s = F0
    for t in range(cuda.threadIdx.x, vocab, cuda.blockDim.x):
        v = w[i, t]
        k = order_key(v)
        if at_or_before(k, t, ck, cid) and at_or_before(k, t, key, tid_cut):
            if use_z:
                s += math.exp((v - m) * inv_t)
            else:
                s += F1
    return block_sum(s, buf)


@cuda.jit(device=True)
def select_cut(w, i, vocab, m, inv_t, use_z, ck, cid, target, buf):
    """The first token (key, id), in (logit desc, id asc) order among those within (ck, cid), at which the
    cumulative mass (z or count) reaches target."""
    lo = KEY_MIN
    hi = KEY_MAX
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if mass_through(w, i, vocab, m, inv_t, use_z, ck, cid, mid, int64(vocab), buf) >= target:
            lo = mid
        else:
            hi = mid - 1
    blo = int64(0)
    bhi = int64(vocab - 1)
    while blo < bhi:
        mid = (blo + bhi) >> 1
        if mass_through(w, i, vocab, m, inv_t, use_z, ck, cid, lo, mid, buf) >= target:
            bhi = mid
        else:
            blo = mid + 1
    return lo, blo


@cuda.jit(device=True, fastmath=True)
def sample_row(i, logits, work, cnt, temperature, top_p, top_k, min_p, rep, pres, freq, seed, step, num_logprobs,
               bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids, hist_indptr, hist_ids, hist_num_prompt,
               allowed_row, allowed, out_tok, out_lp, out_top_ids, out_top_lp, buf, ibuf, found):
    """Sample row i of logits [S, V] with the whole block (see the module doc); work, cnt: [S, V] scratch;
    allowed [R, ceil(V/32)] uint32: the grammar's allowed tokens of row i when allowed_row[i] >= 0;
    buf, ibuf: blockDim floats and ints, found: one int of shared memory. Shared by the per-op kernel and the
    persistent decode step."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    vocab = logits.shape[1]

    # raw log-sum-exp (logprobs are of the raw logits)
    mx = NEG
    for t in range(tid, vocab, nt):
        mx = max(mx, logits[i, t])
    m_raw = block_max(mx, buf)
    s = F0
    for t in range(tid, vocab, nt):
        s += math.exp(logits[i, t] - m_raw)
    lse = m_raw + math.log(block_sum(s, buf))

    # 1-3. bias, min_tokens mask, penalties on a copy of the row
    b0, b1 = bias_indptr[i], bias_indptr[i + 1]
    k0, k1 = mask_indptr[i], mask_indptr[i + 1]
    h0, h1 = hist_indptr[i], hist_indptr[i + 1]
    a = allowed_row[i]
    processed = b1 > b0 or k1 > k0 or h1 > h0 or a >= 0
    w = logits
    if processed:
        w = work
        for t in range(tid, vocab, nt):
            work[i, t] = logits[i, t]
        cuda.syncthreads()  # copy complete before bias lands on it
        for j in range(b0 + tid, b1, nt):
            work[i, bias_ids[j]] += bias_vals[j]
        cuda.syncthreads()  # bias before the mask (a masked token stays masked)
        for j in range(k0 + tid, k1, nt):
            work[i, mask_ids[j]] = NEG
        if a >= 0:  # bit t % 32 of word t // 32 clear: the grammar does not allow token t
            for t in range(tid, vocab, nt):
                if (allowed[a, t >> 5] >> (t & 31)) & 1 == 0:
                    work[i, t] = NEG
        for j in range(h0 + tid, h1, nt):
            cnt[i, hist_ids[j]] = 0
        cuda.syncthreads()  # counters cleared
        for j in range(h0 + hist_num_prompt[i] + tid, h1, nt):
            cuda.atomic.add(cnt, (i, hist_ids[j]), 1)
        cuda.syncthreads()  # output counts complete
        r = rep[i]
        for j in range(h0 + tid, h1, nt):
            t = hist_ids[j]
            c = cuda.atomic.or_(cnt, (i, t), DONE)
            if (c & DONE) == 0:  # the first history entry of t applies its penalties once
                v = work[i, t]
                if r != F1:
                    if v > F0:
                        v = v / r
                    elif v > NEG:
                        v = v * r
                if c > 0:
                    v = v - freq[i] * float32(c)
                    v = v - pres[i]
                work[i, t] = max(v, NEG)  # a masked token stays finite
        cuda.syncthreads()  # processed row complete

    # 4. greedy, or the draw
    best = NEG
    best_t = int32(vocab)
    for t in range(tid, vocab, nt):
        v = w[i, t]
        if v > best:
            best = v
            best_t = t
    m, am = block_argmax(best, best_t, buf, ibuf)
    temp = temperature[i]
    tok = int64(am)
    if temp != F0 and m > NEG:
        inv_t = F1 / temp
        k = top_k[i]
        p = top_p[i]
        ck = NO_CUT_KEY
        cid = int64(vocab)
        if 0 < k < vocab:
            ck, cid = select_cut(w, i, vocab, m, inv_t, False, NO_CUT_KEY, int64(vocab), float32(k), buf)
        if p < F1:
            total = mass_through(w, i, vocab, m, inv_t, True, ck, cid, KEY_MIN, int64(vocab), buf)
            ck, cid = select_cut(w, i, vocab, m, inv_t, True, ck, cid, p * total, buf)
        # inverse CDF in draw order: thread tid walks draw positions [q0, q1)
        mp = min_p[i]
        nb = (vocab + DRAW_BLOCK - 1) // DRAW_BLOCK
        nq = nb * DRAW_BLOCK
        per = (nq + nt - 1) // nt
        q0 = min(tid * per, nq)
        q1 = min(q0 + per, nq)
        own = F0
        last_q = int32(-1)
        for q in range(q0, q1):
            t = q // DRAW_BLOCK + (q % DRAW_BLOCK) * nb
            if t < vocab:
                v = w[i, t]
                z = math.exp((v - m) * inv_t)
                if at_or_before(order_key(v), t, ck, cid) and z >= mp and z > F0:
                    own += z
                    last_q = q
        # inclusive scan of the threads' masses (Hillis-Steele)
        buf[tid] = own
        if tid == 0:
            found[0] = -1
        cuda.syncthreads()  # masses written
        off = 1
        while off < nt:
            a = F0
            if tid >= off:
                a = buf[tid - off]
            cuda.syncthreads()  # everyone read before anyone writes
            buf[tid] += a
            cuda.syncthreads()  # level written
            off <<= 1
        total = buf[nt - 1]
        excl = buf[tid] - own
        target = uniform01(seed[i], step[i]) * total
        if own > F0 and excl <= target and target < excl + own:
            cum = excl
            pick = -1
            for q in range(q0, q1):
                t = q // DRAW_BLOCK + (q % DRAW_BLOCK) * nb
                if t < vocab:
                    v = w[i, t]
                    z = math.exp((v - m) * inv_t)
                    if at_or_before(order_key(v), t, ck, cid) and z >= mp and z > F0:
                        cum += z
                        pick = t
                        if cum > target:
                            break
            found[0] = pick
        cuda.syncthreads()  # the walker has written its token
        pick = found[0]
        cuda.syncthreads()  # read before buf is reused
        lq, _ = block_argmax(float32(last_q), last_q, buf, ibuf)
        if pick >= 0:
            tok = int64(pick)
        elif lq >= F0:  # rounding left the target past the last kept token: take that token
            qq = int64(lq)
            tok = qq // DRAW_BLOCK + (qq % DRAW_BLOCK) * nb
    tok = min(max(tok, int64(0)), int64(vocab - 1))
    if tid == 0:
        out_tok[i] = tok
        out_lp[i] = logits[i, tok] - lse

    # top logprobs of the raw logits: the next in (logit desc, id asc) order, num_logprobs[i] times
    pv = float32(3.0e38)
    pt = int32(-1)
    for a in range(num_logprobs[i]):
        best = NEG
        best_t = int32(vocab)
        for t in range(tid, vocab, nt):
            v = logits[i, t]
            if (v < pv or (v == pv and t > pt)) and (v > best or (v == best and t < best_t)):
                best = v
                best_t = t
        pv, pt = block_argmax(best, best_t, buf, ibuf)
        if tid == 0 and pt < vocab:
            out_top_ids[i, a] = pt
            out_top_lp[i, a] = pv - lse
    cuda.syncthreads()  # the shared buffers are reused by the next row


@cuda.jit(fastmath=True)
def sample_rows(logits, work, cnt, temperature, top_p, top_k, min_p, rep, pres, freq, seed, step, num_logprobs,
                bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids, hist_indptr, hist_ids, hist_num_prompt,
                allowed_row, allowed, out_tok, out_lp, out_top_ids, out_top_lp):
    """Sample row i = blockIdx.x of logits [S, V] (see sample_row)."""
    buf = cuda.shared.array(MAX_BLOCK, float32)
    ibuf = cuda.shared.array(MAX_BLOCK, int32)
    found = cuda.shared.array(1, int32)
    sample_row(cuda.blockIdx.x, logits, work, cnt, temperature, top_p, top_k, min_p, rep, pres, freq, seed, step,
               num_logprobs, bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids, hist_indptr, hist_ids,
               hist_num_prompt, allowed_row, allowed, out_tok, out_lp, out_top_ids, out_top_lp, buf, ibuf, found)
