"""The CPU sampler: one numba kernel over the whole batch's logits (the parameters' semantics are in
engine/sampling.py).

The draw is a pure function of (seed, step): u = splitmix64(splitmix64(seed) + step) / 2^64, and the
token is the inverse CDF of u over the kept tokens walked in "draw order" (cpu_sampler_primitives). No
RNG state is carried, so a seeded request samples the same tokens whatever else is in the batch and
wherever its row is.

Nothing sorts the vocabulary: a row is seen as nb = ceil(V / BLOCK) strided blocks, so block maxima and
block sums are element-wise passes that vectorize. Cuts use the order (logit desc, token id asc):
  - top-k and the top logprobs gather candidates through the block maxima: the c-th largest block maximum
    is a lower bound of the c-th largest logit, and the c blocks that reach it hold every logit above it;
  - top-p starts from a few blocks and widens (x8) only while the gathered mass is below p; past
    _TOPP_MAX_BLOCKS (or for top-k > _SMALL_K) the cut runs over the whole row;
  - a cut is a weighted quickselect, after bisection on the logit value when there are many values.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.backends import cpu_sampler_primitives
from engine.backends.cpu_cache import flush_stale_caches
from engine.backends.cpu_sampler_primitives import (
    NEG_INF32, BLOCK, argmax, before, block_kept_sum, block_max, exp_neg, exp_sum, gather,
    kth_block_threshold, mass_ge, select, sum64, uniform01, weighted_range, weights,
)
from engine.backends.sampling_batch import SampleResult, SamplingBatch

_TOPP_FIRST_BLOCKS = 4     # top-p's first try gathers this many blocks, then x8 per widening ...
_TOPP_MAX_BLOCKS = 32      # ... up to this many; past it the cut runs over the whole row
_SMALL_K = 1024            # top-k up to this gathers candidates; larger k cuts over the whole row
_BISECT_MIN = 1024         # cuts over more values than this bisect on the value first ...
_BAND = 256                # ... until at most this many values are left for the quickselect


@njit(cache=True)
def _apply_allowed(w, words):
    """-inf on every token whose bit in the packed mask row `words` is clear (tokens past it too)."""
    V = w.size
    for k in range(words.size):
        word = words[k]
        if word == np.uint32(0xFFFFFFFF):
            continue
        t0 = k * 32
        for b in range(min(32, V - t0)):
            if not (word >> np.uint32(b)) & np.uint32(1):
                w[t0 + b] = NEG_INF32
    for t in range(words.size * 32, V):
        w[t] = NEG_INF32


@njit(cache=True)
def _process_row(w, i, bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids,
                 hist_indptr, hist_ids, hist_num_prompt, rep, pres, freq, allowed_row, allowed_mask):
    """Bias, min_tokens mask, penalties and the grammar's allowed tokens applied in place to w (a copy
    of row i's logits)."""
    for j in range(bias_indptr[i], bias_indptr[i + 1]):
        w[bias_ids[j]] += bias_vals[j]
    for j in range(mask_indptr[i], mask_indptr[i + 1]):
        w[mask_ids[j]] = NEG_INF32
    if allowed_row[i] >= 0:
        _apply_allowed(w, allowed_mask[allowed_row[i]])
    h0, h1 = hist_indptr[i], hist_indptr[i + 1]
    if h1 == h0:
        return
    # cnt[t]: generated count in the low bits, DONE once t's penalties are applied
    done = np.int32(1 << 30)
    cnt = np.zeros(w.size, np.int32)
    for j in range(h0 + hist_num_prompt[i], h1):
        cnt[hist_ids[j]] += 1
    r, p, f = rep[i], pres[i], freq[i]
    for j in range(h0, h1):
        t = hist_ids[j]
        c = cnt[t]
        if c & done:
            continue
        cnt[t] = c | done
        v = w[t]
        if r != np.float32(1.0):
            v = v / r if v > np.float32(0.0) else v * r
        if c > 0:
            v = v - f * np.float32(c)
            v = v - p
        w[t] = v



@njit(cache=True)
def _cut(vals, ids, wts, target):
    """The (value, id) of the first element in (value desc, id asc) order at which the cumulative weight
    reaches target (the last weighted element if it never does). An empty ids means ids are positions.
    Many values are first narrowed by bisection on the value (vectorized passes), then a quickselect runs
    on the band that is left."""
    n = vals.size
    lo, hi = weighted_range(vals, wts)
    acc = 0.0
    if n > _BISECT_MIN and lo < hi:
        m_lo, c_lo = mass_ge(vals, wts, lo)
        m_hi, c_hi = mass_ge(vals, wts, hi)
        target = min(target, m_lo)
        if m_hi >= target:      # the cut is among the ties at the top value
            lo, c_lo = hi, c_hi
            hi, m_hi, c_hi = np.float32(np.inf), 0.0, 0
        # invariant: mass(>= lo) >= target > mass(>= hi)
        while c_lo - c_hi > _BAND:
            mid = lo + (hi - lo) * np.float32(0.5)
            if not (lo < mid < hi):
                break
            m_mid, c_mid = mass_ge(vals, wts, mid)
            if m_mid >= target:
                lo, c_lo = mid, c_mid
            else:
                hi, m_hi, c_hi = mid, m_mid, c_mid
        acc = m_hi
    else:
        lo = NEG_INF32
        hi = np.float32(np.inf)
    # the band lo <= value < hi, with everything >= hi (mass acc) before it
    nb = 0
    for j in range(n):
        if lo <= vals[j] < hi:
            nb += 1
    bv = np.empty(nb, np.float32)
    bi = np.empty(nb, np.int32)
    bw = np.empty(nb, np.float64)
    c = 0
    identity = ids.size == 0
    for j in range(n):
        if lo <= vals[j] < hi:
            bv[c], bi[c], bw[c] = vals[j], j if identity else ids[j], wts[j]
            c += 1
    pos = select(bv, bi, bw, bv.size, target - acc)
    return bv[pos], bi[pos]


@njit(cache=True)
def _draw_full(w, bmax, m, inv_t, min_p, bval, bid, u):
    """Inverse CDF of u over every kept token of the row, in draw order (block sums first)."""
    nb = bmax.size
    bsum = np.empty(nb, np.float64)
    total = block_kept_sum(w, m, inv_t, min_p, bval, bid, bsum)
    target = u * total
    cum = 0.0
    b = 0
    while b < nb - 1 and (cum + bsum[b] <= target or bsum[b] == 0.0):
        cum += bsum[b]
        b += 1
    last = -1
    for t in range(b, w.size, nb):
        v = w[t]
        e = exp_neg((v - m) * inv_t)
        if (v > bval or (v == bval and t <= bid)) and e >= min_p and e > 0:
            cum += e
            last = t
            if cum > target:
                return t
    return last if last >= 0 else argmax(w, bmax, m)


@njit(cache=True)
def _draw_candidates(cid, cval, cw, bval, bid, min_p, u):
    """Inverse CDF of u over the kept candidates (given in draw order)."""
    total = 0.0
    for j in range(cid.size):
        if (cval[j] > bval or (cval[j] == bval and cid[j] <= bid)) and cw[j] >= min_p:
            total += cw[j]
    target = u * total
    cum = 0.0
    last = -1
    for j in range(cid.size):
        if (cval[j] > bval or (cval[j] == bval and cid[j] <= bid)) and cw[j] >= min_p and cw[j] > 0:
            cum += cw[j]
            last = j
            if cum > target:
                return cid[j]
    return cid[last] if last >= 0 else cid[0]


@njit(cache=True)
def _draw_row(w, bmax, m, temp, top_k, top_p, min_p, u):
    """Token drawn from row logits w (already processed) with block maxima bmax and max m."""
    V = w.size
    if not NEG_INF32 < m < np.float32(np.inf):   # all -inf, NaN, or +inf logits: the first maximum
        return argmax(w, bmax, m)
    inv_t = np.float32(1.0) / temp
    k_on = 0 < top_k < V
    p_on = top_p < np.float32(1.0)
    if not k_on and not p_on:   # nothing cut by rank: min-p is a filter of the draw
        return _draw_full(w, bmax, m, inv_t, min_p, NEG_INF32, np.int32(V), u)
    # small candidate sets, gathered through the block maxima
    if k_on and top_k <= _SMALL_K:
        thr = kth_block_threshold(bmax, np.int64(top_k))
        cid, cval = gather(w, bmax, thr)
        bval, bid = _cut(cval, cid, np.ones(cid.size, np.float32), np.float64(top_k))
        nk = 0
        for j in range(cid.size):
            if cval[j] > bval or (cval[j] == bval and cid[j] <= bid):
                cid[nk], cval[nk] = cid[j], cval[j]
                nk += 1
        cid, cval = cid[:nk], cval[:nk]
        cw = weights(cval, m, inv_t)
        if p_on:
            bval, bid = _cut(cval, cid, cw, top_p * sum64(cw))
        return _draw_candidates(cid, cval, cw, bval, bid, min_p, u)
    if not k_on:
        target = top_p * exp_sum(w, m, inv_t)
        c = np.int64(_TOPP_FIRST_BLOCKS)
        while c <= _TOPP_MAX_BLOCKS:
            thr = kth_block_threshold(bmax, c)
            cid, cval = gather(w, bmax, thr)
            cw = weights(cval, m, inv_t)
            if sum64(cw) >= target:
                bval, bid = _cut(cval, cid, cw, target)
                return _draw_candidates(cid, cval, cw, bval, bid, min_p, u)
            c *= 8
    # large sets: cut over the whole row
    ids = np.empty(0, np.int32)   # ids are positions
    e = weights(w, m, inv_t)
    bval, bid = NEG_INF32, np.int32(V)
    if k_on:
        bval, bid = _cut(w, ids, np.ones(V, np.float32), np.float64(top_k))
        for t in range(V):
            if not (w[t] > bval or (w[t] == bval and t <= bid)):
                e[t] = 0
    if p_on:
        bval, bid = _cut(w, ids, e, top_p * sum64(e))
    return _draw_full(w, bmax, m, inv_t, min_p, bval, bid, u)


@njit(cache=True)
def _top_logprobs(raw, bmax, k, lse, out_ids, out_lp):
    """The k largest raw logits as (id, logprob), descending (ties: smaller id first)."""
    thr = kth_block_threshold(bmax, np.int64(k))
    cid, cval = gather(raw, bmax, thr)
    n = cid.size
    kk = min(k, n)
    pos = select(cval, cid, np.ones(n), n, np.float64(kk))
    # the first pos+1 entries are the top kk in some order: insertion sort them
    for a in range(1, pos + 1):
        v, t = cval[a], cid[a]
        b = a - 1
        while b >= 0 and before(v, t, cval[b], cid[b]):
            cval[b + 1], cid[b + 1] = cval[b], cid[b]
            b -= 1
        cval[b + 1], cid[b + 1] = v, t
    for a in range(kk):
        out_ids[a] = cid[a]
        out_lp[a] = np.float32(np.float64(cval[a]) - lse)


@njit(cache=True)
def _sample_row(i, raw, temperature, top_p, top_k, min_p, rep, pres, freq, seed, step, num_logprobs,
                bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids, hist_indptr, hist_ids, hist_num_prompt,
                allowed_row, allowed_mask, out_tok, out_lp, out_top_ids, out_top_lp):
    V = raw.size
    nb = (V + BLOCK - 1) // BLOCK
    bmax_raw = np.empty(nb, np.float32)
    m_raw = block_max(raw, bmax_raw)
    lse = np.float64(m_raw) + np.log(exp_sum(raw, m_raw, np.float32(1.0)))
    if (bias_indptr[i + 1] > bias_indptr[i] or mask_indptr[i + 1] > mask_indptr[i]
            or hist_indptr[i + 1] > hist_indptr[i] or allowed_row[i] >= 0):
        w = raw.copy()
        _process_row(w, i, bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids,
                     hist_indptr, hist_ids, hist_num_prompt, rep, pres, freq, allowed_row, allowed_mask)
        bmax = np.empty(nb, np.float32)
        m = block_max(w, bmax)
    else:
        w, bmax, m = raw, bmax_raw, m_raw
    if temperature[i] == np.float32(0.0):
        tok = argmax(w, bmax, m)
    else:
        tok = _draw_row(w, bmax, m, temperature[i], top_k[i], top_p[i], min_p[i],
                        uniform01(seed[i], step[i]))
    tok = min(max(tok, 0), V - 1)
    out_tok[i] = tok
    out_lp[i] = np.float32(np.float64(raw[tok]) - lse)
    if num_logprobs[i] > 0:
        _top_logprobs(raw, bmax_raw, num_logprobs[i], lse, out_top_ids[i], out_top_lp[i])


@njit(parallel=True, cache=True)
def _sample_kernel(logits, temperature, top_p, top_k, min_p, rep, pres, freq, seed, step, num_logprobs,
                   bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids, hist_indptr, hist_ids, hist_num_prompt,
                   allowed_row, allowed_mask, out_tok, out_lp, out_top_ids, out_top_lp):
    """Sample every row of logits [S, V]; rows are independent."""
    for i in prange(logits.shape[0]):
        _sample_row(np.int64(i), logits[i], temperature, top_p, top_k, min_p, rep, pres, freq, seed, step, num_logprobs,
                    bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids, hist_indptr, hist_ids, hist_num_prompt,
                    allowed_row, allowed_mask, out_tok, out_lp, out_top_ids, out_top_lp)


@njit(cache=True)
def _process_rows(logits, out, rep, pres, freq, bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids,
                  hist_indptr, hist_ids, hist_num_prompt, allowed_row, allowed_mask):
    for i in range(logits.shape[0]):
        out[i] = logits[i]
        _process_row(out[i], i, bias_indptr, bias_ids, bias_vals, mask_indptr, mask_ids,
                     hist_indptr, hist_ids, hist_num_prompt, rep, pres, freq, allowed_row, allowed_mask)


# --------------------------------------------------------------------------- entry points

def _check_logits(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    batch.check_logits_shape(logits.shape)
    return logits


def sample(logits: np.ndarray, batch: SamplingBatch) -> SampleResult:
    """Sample one token per row of logits [S, V] float32."""
    logits = _check_logits(logits, batch)
    S, K = batch.num_rows, batch.max_num_logprobs
    res = SampleResult.empty(S, K)
    if S == 0:
        return res
    b = batch
    _sample_kernel(logits, b.temperature, b.top_p, b.top_k, b.min_p, b.repetition_penalty, b.presence_penalty,
                   b.frequency_penalty, b.seed, b.step, b.num_logprobs,
                   b.bias_indptr, b.bias_token_ids, b.bias_values, b.mask_indptr, b.mask_token_ids,
                   b.hist_indptr, b.hist_token_ids, b.hist_num_prompt, b.allowed_row, b.allowed_mask,
                   res.token_ids, res.logprobs, res.top_token_ids, res.top_logprobs)
    return res


def processed_logits(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """The logits after bias, min_tokens masking, penalties and the allowed-token mask (what `sample` draws from before
    temperature), computed by the kernel's own code; for tests and debugging."""
    logits = _check_logits(logits, batch)
    out = np.empty_like(logits)
    b = batch
    if b.num_rows:
        _process_rows(logits, out, b.repetition_penalty, b.presence_penalty, b.frequency_penalty,
                        b.bias_indptr, b.bias_token_ids, b.bias_values, b.mask_indptr, b.mask_token_ids,
                        b.hist_indptr, b.hist_token_ids, b.hist_num_prompt, b.allowed_row, b.allowed_mask)
    return out


# the kernels above are built from the primitives module: recompile them when it changes
flush_stale_caches(globals(), "cpu_sampler", cpu_sampler_primitives.__file__)
