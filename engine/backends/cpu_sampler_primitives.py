"""Building blocks of the CPU sampler (engine/backends/cpu_sampler.py): a vectorizing exp and
min/max, per-block reductions over a row of logits, the weighted quickselect and the seeded uniform.

Blocks are strided: block b of a row of V logits holds tokens b, b + nb, b + 2 nb, ... (BLOCK of them,
nb = ceil(V / BLOCK)), so per-block reductions are element-wise over BLOCK contiguous slices of nb
values and vectorize. A row's "draw order" is (block, position in block) = (t mod nb, t div nb).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

BLOCK = 64                 # logits per block for the block-maxima candidate search


@intrinsic
def bits_as_f32(typingctx, x):
    """Reinterpret the low 32 bits of an integer as a float32."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if v.type.width > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif v.type.width < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())
    return types.float32(x), codegen


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_MIN = np.float32(-87.0)
NEG_INF32 = np.float32(-np.inf)


@njit(cache=True, fastmath=True)
def exp_neg(x):
    """exp(x) for float32 x <= 0 (Cephes expf: ~1 ulp), 0 below -87; branch-free so loops vectorize."""
    xc = max(x, _EXP_MIN)
    n = np.floor(xc * _LOG2E + np.float32(0.5))
    r = xc - n * _LN2_HI - n * _LN2_LO
    y = ((((np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)) * r
           + np.float32(8.3334519073e-3)) * r + np.float32(4.1665795894e-2)) * r
         + np.float32(1.6666665459e-1)) * r + np.float32(5.0000001201e-1)
    y = y * (r * r) + r + np.float32(1.0)
    scale = bits_as_f32((np.int32(n) + 127) << 23)
    return y * scale if x >= _EXP_MIN else np.float32(0.0)


def _minmax_intrinsic(name):
    def impl(typingctx, a, b):
        if a != types.float32 or b != types.float32:
            return None

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType(), ir.FloatType()])
            fn = cgutils.get_or_insert_function(builder.module, fnty, name)
            return builder.call(fn, args)
        return types.float32(a, b), codegen
    return intrinsic(impl)


# llvm.maxnum / llvm.minnum: a max and min that LLVM vectorizes (numba's max() does not); NaN loses
fmax = _minmax_intrinsic("llvm.maxnum.f32")
fmin = _minmax_intrinsic("llvm.minnum.f32")


@njit(cache=True, fastmath=True)
def block_max(x, out):
    """out[b] = max of x over block b; returns the overall max."""
    nb, n = out.size, x.size
    for b in range(nb):
        out[b] = x[b]
    for j in range(1, BLOCK):
        lo = j * nb
        if lo >= n:
            break
        xs = x[lo:min(lo + nb, n)]
        for b in range(xs.size):
            out[b] = fmax(out[b], xs[b])
    m = NEG_INF32
    for b in range(nb):
        m = fmax(m, out[b])
    return m


@njit(cache=True, fastmath=True)
def exp_sum(x, m, inv_t):
    """sum_t exp((x[t] - m) * inv_t), m = max x."""
    s = np.float32(0.0)
    for j in range(x.size):
        s += exp_neg((x[j] - m) * inv_t)
    return np.float64(s)


@njit(cache=True, fastmath=True)
def block_kept_sum(x, m, inv_t, min_e, bval, bid, out):
    """out[b] = sum over block b of e = exp((x - m) * inv_t) over kept tokens: those at or before the cut
    (bval, bid) in (value desc, id asc) order with e >= min_e. Returns the total."""
    nb, n = out.size, x.size
    acc = np.zeros(nb, np.float32)
    for j in range(BLOCK):
        lo = j * nb
        if lo >= n:
            break
        xs = x[lo:min(lo + nb, n)]
        for b in range(xs.size):
            v = xs[b]
            e = exp_neg((v - m) * inv_t)
            kept = (v > bval or (v == bval and lo + b <= bid)) and e >= min_e
            acc[b] += e if kept else np.float32(0.0)
    total = 0.0
    for b in range(nb):
        out[b] = acc[b]
        total += acc[b]
    return total


@njit(cache=True, fastmath=True)
def mass_ge(vals, wts, thr):
    """(sum of wts, count) over vals >= thr."""
    s = 0.0
    c = 0
    for j in range(vals.size):
        ge = vals[j] >= thr
        s += np.float64(wts[j]) if ge else 0.0
        c += 1 if ge else 0
    return s, c


@njit(cache=True)
def before(va, ia, vb, ib):
    """Sort order for cuts: larger value first, then smaller token id."""
    return va > vb or (va == vb and ia < ib)


@njit(cache=True)
def select(vals, ids, wts, n, target):
    """Weighted quickselect: the position (after partial reordering of the arrays) of the first element,
    in (value desc, id asc) order, at which the cumulative weight reaches `target` (the last element
    if it never does). With unit weights and target k it is the k-th element."""
    lo, hi = 0, n
    acc = 0.0
    last = -1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        # median of three as pivot, moved to hi - 1
        a, b, c = lo, mid, hi - 1
        if before(vals[b], ids[b], vals[a], ids[a]):
            a, b = b, a
        if before(vals[c], ids[c], vals[b], ids[b]):
            b, c = c, b
            if before(vals[b], ids[b], vals[a], ids[a]):
                a, b = b, a
        p = b
        vals[p], vals[hi - 1] = vals[hi - 1], vals[p]
        ids[p], ids[hi - 1] = ids[hi - 1], ids[p]
        wts[p], wts[hi - 1] = wts[hi - 1], wts[p]
        pv, pi = vals[hi - 1], ids[hi - 1]
        store = lo
        mass = 0.0
        for j in range(lo, hi - 1):
            if before(vals[j], ids[j], pv, pi):
                vals[j], vals[store] = vals[store], vals[j]
                ids[j], ids[store] = ids[store], ids[j]
                wts[j], wts[store] = wts[store], wts[j]
                mass += wts[store]
                store += 1
        vals[store], vals[hi - 1] = vals[hi - 1], vals[store]
        ids[store], ids[hi - 1] = ids[hi - 1], ids[store]
        wts[store], wts[hi - 1] = wts[hi - 1], wts[store]
        if acc + mass >= target:
            hi = store
        elif acc + mass + wts[store] >= target:
            return store
        else:
            acc += mass + wts[store]
            last = store
            lo = store + 1
    if hi - lo == 1:
        return lo
    return last if last >= 0 else 0


@njit(cache=True)
def kth_block_threshold(bmax, c):
    """The c-th largest block maximum (-inf when c >= number of blocks: every logit is a candidate)."""
    nb = bmax.size
    if c >= nb:
        return NEG_INF32
    vals = np.empty(nb, np.float32)
    ids = np.empty(nb, np.int32)
    wts = np.ones(nb)
    for b in range(nb):
        vals[b], ids[b] = bmax[b], b
    return vals[select(vals, ids, wts, nb, np.float64(c))]


@njit(cache=True)
def gather(x, bmax, thr):
    """Token ids and values of every x >= thr, in draw order (only blocks whose max reaches thr are read)."""
    nb, n = bmax.size, x.size
    nblk = 0
    for b in range(nb):
        if bmax[b] >= thr:
            nblk += 1
    ids = np.empty(nblk * BLOCK, np.int32)
    vals = np.empty(nblk * BLOCK, np.float32)
    cnt = 0
    for b in range(nb):
        if bmax[b] >= thr:
            for t in range(b, n, nb):
                if x[t] >= thr:
                    ids[cnt] = t
                    vals[cnt] = x[t]
                    cnt += 1
    return ids[:cnt], vals[:cnt]


@njit(cache=True, fastmath=True)
def weights(vals, m, inv_t):
    out = np.empty(vals.size, np.float32)
    for j in range(vals.size):
        out[j] = exp_neg((vals[j] - m) * inv_t)
    return out


@njit(cache=True, fastmath=True)
def sum64(a):
    s = 0.0
    for j in range(a.size):
        s += a[j]
    return s


@njit(cache=True)
def argmax(x, bmax, m):
    """First index of the maximum m (blocks located through their maxima)."""
    nb = bmax.size
    best = x.size
    for b in range(nb):
        if bmax[b] == m:
            for t in range(b, min(best, x.size), nb):
                if x[t] == m:
                    best = t
                    break
    return best if best < x.size else 0  # 0: all NaN


@njit(cache=True)
def uniform01(seed, step):
    """A uniform in [0, 1) that is a pure function of (seed, step): splitmix64 of splitmix64(seed) + step."""
    z = splitmix64(splitmix64(np.uint64(seed)) + np.uint64(step))
    return np.float64(z >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@njit(cache=True)
def splitmix64(x):
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))



@njit(cache=True, fastmath=True)
def weighted_range(vals, wts):
    """(min, max) of vals over positive weights."""
    lo = np.float32(np.inf)
    hi = NEG_INF32
    for j in range(vals.size):
        pos = wts[j] > 0
        lo = fmin(lo, vals[j] if pos else np.float32(np.inf))
        hi = fmax(hi, vals[j] if pos else NEG_INF32)
    return lo, hi


