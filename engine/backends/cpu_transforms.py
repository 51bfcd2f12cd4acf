"""Row transforms that a matmul applies to x on the way in (one kernel call instead of two): rmsnorm(x) * w,
silu(gate) * up and gelu_tanh(gate) * up; the row functions also serve the standalone ops of
cpu_norm_act."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.backends import cpu_simd
from engine.backends.cpu_cache import flush_stale_caches
from engine.backends.cpu_simd import (
    F, U, addr, ld_f, st_f, vadd, vbcast_f, vdiv, vexp, vfma, vload_f, vmul, vstore_f, vsum, vzero_f,
)


# what a matmul does to each row of x on the way in
X_PLAIN, X_RMSNORM, X_SILU_MUL, X_GELU_MUL = 0, 1, 2, 3

_GELU_C = 0.7978845608028654   # sqrt(2 / pi)


@njit(cache=True, fastmath=True)
def rmsnorm_row(xp, xo, wp, d, eps, op, oo):
    """out[oo : oo + d] = x[xo : xo + d] / rms * w (float32 items at the addresses xp, wp, op)."""
    d16 = d - d % 16
    acc = vzero_f()
    for i in range(0, d16, 16):
        v = vload_f(xp, xo + U(i))
        acc = vfma(v, v, acc)
    ss = vsum(acc)
    for i in range(d16, d):
        v = ld_f(xp, xo + U(i))
        ss += v * v
    inv = F(1.0) / np.sqrt(ss / F(d) + F(eps))
    vi = vbcast_f(inv)
    for i in range(0, d16, 16):
        vstore_f(op, oo + U(i), vmul(vmul(vload_f(xp, xo + U(i)), vi), vload_f(wp, U(i))))
    for i in range(d16, d):
        st_f(op, oo + U(i), ld_f(xp, xo + U(i)) * inv * ld_f(wp, U(i)))


@njit(cache=True, fastmath=True)
def silu_mul_row(gp, go, f, op, oo):
    """out[oo : oo + f] = silu(gate) * up for gate | up = the 2f items at gp[go:]."""
    f16 = f - f % 16
    one = vbcast_f(1.0)
    neg = vbcast_f(-1.0)
    for i in range(0, f16, 16):
        g = vload_f(gp, go + U(i))
        vstore_f(op, oo + U(i), vmul(vdiv(g, vadd(one, vexp(vmul(g, neg)))), vload_f(gp, go + U(f + i))))
    for i in range(f16, f):
        g = ld_f(gp, go + U(i))
        st_f(op, oo + U(i), g / (F(1.0) + np.exp(-g)) * ld_f(gp, go + U(f + i)))


@njit(cache=True, fastmath=True)
def gelu_mul_row(gp, go, f, op, oo):
    """out[oo : oo + f] = gelu_tanh(gate) * up for gate | up = the 2f items at gp[go:].
    0.5 g (1 + tanh(u)) is g / (1 + exp(-2u)): one exp, as silu's, with u = sqrt(2/pi) (g + 0.044715 g^3)."""
    f16 = f - f % 16
    one = vbcast_f(1.0)
    c2 = vbcast_f(-2.0 * _GELU_C)
    c3 = vbcast_f(-2.0 * _GELU_C * 0.044715)
    for i in range(0, f16, 16):
        g = vload_f(gp, go + U(i))
        e = vexp(vmul(g, vfma(vmul(g, g), c3, c2)))   # exp(-2u), clamped inside vexp: no inf
        vstore_f(op, oo + U(i), vmul(vdiv(g, vadd(one, e)), vload_f(gp, go + U(f + i))))
    for i in range(f16, f):
        g = ld_f(gp, go + U(i))
        z = min(max(F(-2.0 * _GELU_C) * g * (F(1.0) + F(0.044715) * g * g), F(-87.0)), F(88.0))
        st_f(op, oo + U(i), g / (F(1.0) + np.exp(z)) * ld_f(gp, go + U(f + i)))


@njit(cache=True, fastmath=True)
def _transform_row(x, i, kind, aux, eps, xt):
    k = xt.shape[1]
    if kind == X_RMSNORM:
        rmsnorm_row(addr(x), U(i) * U(x.shape[1]), addr(aux), k, eps, addr(xt), U(i) * U(k))
    elif kind == X_SILU_MUL:
        silu_mul_row(addr(x), U(i) * U(x.shape[1]), k, addr(xt), U(i) * U(k))
    else:
        gelu_mul_row(addr(x), U(i) * U(x.shape[1]), k, addr(xt), U(i) * U(k))


@njit(cache=True, fastmath=True, inline="always")
def transformed(x, kind, aux, eps):
    """x itself (X_PLAIN), or rmsnorm(x) * aux (X_RMSNORM), silu(gate) * up (X_SILU_MUL) or
    gelu_tanh(gate) * up (X_GELU_MUL) as a new array; rows in parallel when there are many."""
    if kind == X_PLAIN:
        return x
    m = x.shape[0]
    xt = np.empty((m, aux.shape[0] if kind == X_RMSNORM else x.shape[1] // 2), np.float32)
    if m >= 16:
        for i in prange(m):
            _transform_row(x, i, kind, aux, eps, xt)
    else:
        for i in range(m):
            _transform_row(x, i, kind, aux, eps, xt)
    return xt


@njit(cache=True, parallel=True, fastmath=True)
def transform(x, kind, aux, eps):
    """transformed as a kernel of its own (the BLAS path, matrices stacked from several formats)."""
    return transformed(x, kind, aux, eps)


flush_stale_caches(globals(), "cpu_transforms", cpu_simd.__file__)
