"""The int8 kernels for q4/q8 weights: activations rounded to int8, products by vpdpbusd.

Each 32-block of a row of x is rounded to int8 (scale xd = max|x| / 127), as llama.cpp does; one vpdpbusd
then does 64 multiply-adds, exactly in int32, and a block is scaled once: d * xd * sum(q * xq) + m *
(block sum of x). By default (passes = 2) the rounding error is rounded again into a second int8 plane at
scale xd / 256, and the dot runs over both planes (256 * sum0 + sum1 in int32): x to ~16 bits for twice
the dot work, as one plane loses too much over a model's layers (docs/performance.md, "Explicit SIMD,
int8 activations in two planes").

Hot code here takes raw addresses (addr(array), an integer) rather than arrays: numba reference-counts
arrays handed to inlined helpers, which left NRT_incref calls (and every vector register spilled around
them) in the innermost loops. The callers keep the arrays alive: every address is of a parameter, or of
a local used as an array after it (see cpu_simd.addr).
"""
from __future__ import annotations

from numba import njit

from engine.backends import cpu_simd
from engine.backends.cpu_cache import flush_stale_caches
from engine.backends.cpu_simd import (
    F, U, ld_f, st_f, vabs, vadd, vand, vbcast4, vbcast_f, vbcast_i, vcvt, vdpbusd, vdpbusd4_nib, vfma, vhmax,
    vload_f, vload_h, vload_w, vmax, vmin, vmul, vround_i, vsll, vsrl, vstore_i8, vsub, vsum, vzero_f, vzero_i,
)
from models.quant import QK


@njit(cache=True, fastmath=True)
def quantize_row(xp, xrow, k, qp, dp, sp, i, nb, passes):
    """Row i of x (float32 at xp, the row starting at item xrow) -> int8 planes of row i at qp
    ([M, passes, K]), block scales dp[i, b] and block sums sp[i, b] ([M, nb] float32).

    Plane 0 rounds x to int8 with scale d = max|x| / 127. With passes == 2, plane 1 rounds what plane 0
    left over (at most d / 2) with scale d / 256, so x ~ (256 * plane0 + plane1) * d / 256: about
    16 bits, and the kernels fold both planes into one int32 sum (shifting by 8 in between).
    sp holds the block's sum as dequantized: the kernels' min / offset term."""
    for b in range(U(nb)):
        o = xrow + b * U(QK)
        v0 = vload_f(xp, o)
        v1 = vload_f(xp, o + U(16))
        amax = vhmax(vmax(vabs(v0), vabs(v1)))
        d = amax / F(127.0)
        inv = F(127.0) / amax if amax > F(0.0) else F(0.0)
        q0 = vround_i(vmul(v0, vbcast_f(inv)))
        q1 = vround_i(vmul(v1, vbcast_f(inv)))
        qo = i * U(passes * k) + b * U(QK)
        vstore_i8(qp, qo, q0)
        vstore_i8(qp, qo + U(16), q1)
        so = i * U(nb) + b
        if passes == 1:
            st_f(dp, so, d)
            st_f(sp, so, d * F(vsum(vadd(q0, q1))))
        else:
            # the rest, in units of d / 256 (|rest| <= d / 2 -> 128 at most: clamped to 127)
            inv2 = inv * F(256.0)
            lo = vbcast_f(-127.0)
            hi = vbcast_f(127.0)
            r0 = vround_i(vmin(vmax(vmul(vsub(v0, vmul(vcvt(q0), vbcast_f(d))), vbcast_f(inv2)), lo), hi))
            r1 = vround_i(vmin(vmax(vmul(vsub(v1, vmul(vcvt(q1), vbcast_f(d))), vbcast_f(inv2)), lo), hi))
            vstore_i8(qp, qo + U(k), r0)
            vstore_i8(qp, qo + U(k + 16), r1)
            d256 = d * F(1.0 / 256.0)
            st_f(dp, so, d256)
            st_f(sp, so, d256 * F(vsum(vadd(vadd(r0, r1), vmul(vadd(q0, q1), vbcast_i(256))))))


@njit(cache=True, fastmath=True)
def q4_scales(sp, t, b, nb, ns):
    so = (t * U(nb) + b) * U(ns * 16)
    d = vload_h(sp, so)
    if ns == 2:
        m = vload_h(sp, so + U(16))
    else:
        m = vmul(d, vbcast_f(-8.0))
    return d, m


@njit(cache=True, fastmath=True)
def _dot_q4_i8(l0, l1, l2, l3, h0, h1, h2, h3, xqp, xo, k, passes):
    """int32 per lane: sum of the block's 32 nibble * int8 products for the x block at byte xo; with
    two planes, 256 * (that sum) + the same sum for the second plane (at xo + k).
    Two (four) independent vpdpbusd chains: one chain of 8 (16) would wait on its latency when a tile
    runs a single row of x (decode)."""
    z = vzero_i()
    a = vdpbusd4_nib(z, l0, vbcast4(xqp, xo), l1, vbcast4(xqp, xo + U(4)),
                     h0, vbcast4(xqp, xo + U(16)), h1, vbcast4(xqp, xo + U(20)))
    c = vdpbusd4_nib(z, l2, vbcast4(xqp, xo + U(8)), l3, vbcast4(xqp, xo + U(12)),
                     h2, vbcast4(xqp, xo + U(24)), h3, vbcast4(xqp, xo + U(28)))
    if passes == 1:
        return vadd(a, c)
    x1 = xo + U(k)
    e = vdpbusd4_nib(z, l0, vbcast4(xqp, x1), l1, vbcast4(xqp, x1 + U(4)),
                     h0, vbcast4(xqp, x1 + U(16)), h1, vbcast4(xqp, x1 + U(20)))
    g = vdpbusd4_nib(z, l2, vbcast4(xqp, x1 + U(8)), l3, vbcast4(xqp, x1 + U(12)),
                     h2, vbcast4(xqp, x1 + U(24)), h3, vbcast4(xqp, x1 + U(28)))
    return vadd(vsll(vadd(a, c), 8), vadd(e, g))


@njit(cache=True, fastmath=True)
def q4_tile_i8(qp, sp, ns, xqp, xdp, xsp, k, passes, t, nb, i0, nrows):
    """Tile t against rows i0 .. i0+nrows-1 (nrows 1, 2 or 4) of the int8 x: 4 accumulators.
    Per block: d * xd * sum(nibble * xq) + m * (sum of the x block)."""
    a0 = vzero_f()
    a1 = vzero_f()
    a2 = vzero_f()
    a3 = vzero_f()
    mask = vbcast_i(0x0F0F0F0F)
    rs = U(passes * k)  # bytes between rows of xq
    for b in range(U(nb)):
        base = (t * U(nb) + b) * U(256)
        w0 = vload_w(qp, base)
        w1 = vload_w(qp, base + U(64))
        w2 = vload_w(qp, base + U(128))
        w3 = vload_w(qp, base + U(192))
        l0, l1, l2, l3 = vand(w0, mask), vand(w1, mask), vand(w2, mask), vand(w3, mask)
        h0, h1 = vand(vsrl(w0, 4), mask), vand(vsrl(w1, 4), mask)
        h2, h3 = vand(vsrl(w2, 4), mask), vand(vsrl(w3, 4), mask)
        d, m = q4_scales(sp, t, b, nb, ns)
        xo = i0 * rs + b * U(QK)
        so = i0 * U(nb) + b
        s = _dot_q4_i8(l0, l1, l2, l3, h0, h1, h2, h3, xqp, xo, k, passes)
        a0 = vfma(m, vbcast_f(ld_f(xsp, so)), vfma(vcvt(s), vmul(d, vbcast_f(ld_f(xdp, so))), a0))
        if nrows >= 2:
            s = _dot_q4_i8(l0, l1, l2, l3, h0, h1, h2, h3, xqp, xo + rs, k, passes)
            so1 = so + U(nb)
            a1 = vfma(m, vbcast_f(ld_f(xsp, so1)), vfma(vcvt(s), vmul(d, vbcast_f(ld_f(xdp, so1))), a1))
        if nrows == 4:
            s = _dot_q4_i8(l0, l1, l2, l3, h0, h1, h2, h3, xqp, xo + U(2) * rs, k, passes)
            so2 = so + U(2 * nb)
            a2 = vfma(m, vbcast_f(ld_f(xsp, so2)), vfma(vcvt(s), vmul(d, vbcast_f(ld_f(xdp, so2))), a2))
            s = _dot_q4_i8(l0, l1, l2, l3, h0, h1, h2, h3, xqp, xo + U(3) * rs, k, passes)
            so3 = so + U(3 * nb)
            a3 = vfma(m, vbcast_f(ld_f(xsp, so3)), vfma(vcvt(s), vmul(d, vbcast_f(ld_f(xdp, so3))), a3))
    return a0, a1, a2, a3


@njit(cache=True, fastmath=True)
def _dot_q8_i8(w0, w1, w2, w3, w4, w5, w6, w7, xqp, xo, k, passes):
    """As _dot_q4_i8, for the 8 byte groups of a q8 block."""
    z = vzero_i()
    a = vdpbusd(vdpbusd(z, w0, vbcast4(xqp, xo)), w1, vbcast4(xqp, xo + U(4)))
    c = vdpbusd(vdpbusd(z, w2, vbcast4(xqp, xo + U(8))), w3, vbcast4(xqp, xo + U(12)))
    a = vdpbusd(vdpbusd(a, w4, vbcast4(xqp, xo + U(16))), w5, vbcast4(xqp, xo + U(20)))
    c = vdpbusd(vdpbusd(c, w6, vbcast4(xqp, xo + U(24))), w7, vbcast4(xqp, xo + U(28)))
    if passes == 1:
        return vadd(a, c)
    x1 = xo + U(k)
    e = vdpbusd(vdpbusd(z, w0, vbcast4(xqp, x1)), w1, vbcast4(xqp, x1 + U(4)))
    g = vdpbusd(vdpbusd(z, w2, vbcast4(xqp, x1 + U(8))), w3, vbcast4(xqp, x1 + U(12)))
    e = vdpbusd(vdpbusd(e, w4, vbcast4(xqp, x1 + U(16))), w5, vbcast4(xqp, x1 + U(20)))
    g = vdpbusd(vdpbusd(g, w6, vbcast4(xqp, x1 + U(24))), w7, vbcast4(xqp, x1 + U(28)))
    return vadd(vsll(vadd(a, c), 8), vadd(e, g))


@njit(cache=True, fastmath=True)
def q8_tile_i8(qp, sp, xqp, xdp, xsp, k, passes, t, nb, i0, nrows):
    """Per block: d * xd * (sum((q + 128) * xq) - 128 * sum(xq)), from the stored unsigned bytes."""
    a0 = vzero_f()
    a1 = vzero_f()
    a2 = vzero_f()
    a3 = vzero_f()
    c = F(-128.0)
    rs = U(passes * k)
    for b in range(U(nb)):
        base = (t * U(nb) + b) * U(512)
        w0 = vload_w(qp, base)
        w1 = vload_w(qp, base + U(64))
        w2 = vload_w(qp, base + U(128))
        w3 = vload_w(qp, base + U(192))
        w4 = vload_w(qp, base + U(256))
        w5 = vload_w(qp, base + U(320))
        w6 = vload_w(qp, base + U(384))
        w7 = vload_w(qp, base + U(448))
        d = vload_h(sp, (t * U(nb) + b) * U(16))
        xo = i0 * rs + b * U(QK)
        so = i0 * U(nb) + b
        s = _dot_q8_i8(w0, w1, w2, w3, w4, w5, w6, w7, xqp, xo, k, passes)
        a0 = vfma(d, vbcast_f(ld_f(xsp, so) * c), vfma(vcvt(s), vmul(d, vbcast_f(ld_f(xdp, so))), a0))
        if nrows >= 2:
            s = _dot_q8_i8(w0, w1, w2, w3, w4, w5, w6, w7, xqp, xo + rs, k, passes)
            so1 = so + U(nb)
            a1 = vfma(d, vbcast_f(ld_f(xsp, so1) * c), vfma(vcvt(s), vmul(d, vbcast_f(ld_f(xdp, so1))), a1))
        if nrows == 4:
            s = _dot_q8_i8(w0, w1, w2, w3, w4, w5, w6, w7, xqp, xo + U(2) * rs, k, passes)
            so2 = so + U(2 * nb)
            a2 = vfma(d, vbcast_f(ld_f(xsp, so2) * c), vfma(vcvt(s), vmul(d, vbcast_f(ld_f(xdp, so2))), a2))
            s = _dot_q8_i8(w0, w1, w2, w3, w4, w5, w6, w7, xqp, xo + U(3) * rs, k, passes)
            so3 = so + U(3 * nb)
            a3 = vfma(d, vbcast_f(ld_f(xsp, so3) * c), vfma(vcvt(s), vmul(d, vbcast_f(ld_f(xdp, so3))), a3))
    return a0, a1, a2, a3


flush_stale_caches(globals(), "cpu_int8", cpu_simd.__file__)
