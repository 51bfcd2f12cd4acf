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

from engine.backends import cpu_isa, cpu_repack, cpu_simd
from engine.backends.cpu_cache import flush_stale_caches
from engine.backends.cpu_repack import K_SUPER_BYTES
from engine.backends.cpu_simd import (
    F, U, ld_f, prefetch_l2, st_f, vabs, vadd, vand, vbcast4, vbcast_f, vbcast_i, vcvt, vdot4_x16, vdot8_x16, vdpbusd,
    vdpbusd4_nib, vfma, vhmax, vload_f, vload_h, vload_i8f, vload_w, vmax, vmin, vmul, vor, vround_i, vsll, vsrl, vstore_i8, vsub,
    vsum, vzero_f, vzero_i,
)
from models.quant import QK

# avx2 splits each byte code against vpmaddubsw's saturation: a q8 block's (or q6_k half block's) two
# planes in one int16 dot instead (cpu_isa.emit_dot_u8_x16), the same sum
Q8_X16 = cpu_isa.ISA == "avx2"
# Bytes of q4/q5 codes a tile's first pass reads ahead into L2: with the hardware prefetcher alone, batch-1
# decode streamed its weights well short of the memory's bandwidth (docs/performance.md)
PREFETCH_AHEAD = 4096


@njit(cache=True, fastmath=True)
def quantize_row(xp, xrow, k, qp, dp, sp, i, nb, passes, halves):
    """Row i of x (float32 at xp, the row starting at item xrow) -> int8 planes of row i at qp
    ([M, passes, K]), block scales dp[i, b] ([M, nb]) and block sums at sp (float32 [M, nb], or with
    halves [M, 2 nb]: the sums of each block's two halves of 16, for weights with a scale per 16).

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
        # each sum is one product of an exact integer sum: with two products added, fastmath may factor
        # them (d * (a + b)) in one caller and not in another, and a row's sums, then its logits and a
        # seeded request's tokens, would depend on the batch it runs in
        if passes == 1:
            st_f(dp, so, d)
            scale, n0, n1 = d, vsum(q0), vsum(q1)
        else:
            # the rest, in units of d / 256 (|rest| <= d / 2 -> 128 at most: clamped to 127)
            inv2 = inv * F(256.0)
            lo = vbcast_f(-127.0)
            hi = vbcast_f(127.0)
            r0 = vround_i(vmin(vmax(vmul(vsub(v0, vmul(vcvt(q0), vbcast_f(d))), vbcast_f(inv2)), lo), hi))
            r1 = vround_i(vmin(vmax(vmul(vsub(v1, vmul(vcvt(q1), vbcast_f(d))), vbcast_f(inv2)), lo), hi))
            vstore_i8(qp, qo + U(k), r0)
            vstore_i8(qp, qo + U(k + 16), r1)
            scale = d * F(1.0 / 256.0)
            st_f(dp, so, scale)
            n0 = vsum(vadd(r0, vmul(q0, vbcast_i(256))))
            n1 = vsum(vadd(r1, vmul(q1, vbcast_i(256))))
        if halves:
            st_f(sp, U(2) * so, scale * F(n0))
            st_f(sp, U(2) * so + U(1), scale * F(n1))
        else:
            st_f(sp, so, scale * F(n0 + n1))


@njit(cache=True, fastmath=True)
def block_scales(sp, t, b, nb, ns, size, zero):
    """The two scale vectors of block b of tile t, by the scales' item size (cpu_repack): IEEE halves (2),
    sc [nt, nb, ns, 16] at sp: (d, m) with ns == 2, else (d, zero * d); K-quant bytes (1): the block's two
    int8 multipliers under its super-block's two half scales."""
    if size == 1:
        sup = (t * U(nb >> 3) + (b >> 3)) * U(K_SUPER_BYTES)
        row = sup + U(64) + (b & U(7)) * U(32)
        return (vmul(vload_h(sp, sup >> U(1)), vload_i8f(sp, row)),
                vmul(vload_h(sp, (sup >> U(1)) + U(16)), vload_i8f(sp, row + U(16))))
    so = (t * U(nb) + b) * U(ns * 16)
    d = vload_h(sp, so)
    m = vload_h(sp, so + U(16)) if ns == 2 else vmul(d, vbcast_f(zero))
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
def fifth_bits(l0, l1, l2, l3, h0, h1, h2, h3, wh):
    """The nibbles of a q5 tile block with their fifth bits: bit v of each byte of wh is the fifth bit of the
    code at that byte in vector v (l0..l3, then h0..h3), moved to bit 4 by one shift within the byte."""
    b4 = vbcast_i(0x10101010)
    return (vor(l0, vand(vsll(wh, 4), b4)), vor(l1, vand(vsll(wh, 3), b4)),
            vor(l2, vand(vsll(wh, 2), b4)), vor(l3, vand(vsll(wh, 1), b4)),
            vor(h0, vand(wh, b4)), vor(h1, vand(vsrl(wh, 1), b4)),
            vor(h2, vand(vsrl(wh, 2), b4)), vor(h3, vand(vsrl(wh, 3), b4)))


@njit(cache=True, fastmath=True)
def q4_tile_i8(qp, sp, ns, size, five, xqp, xdp, xsp, k, passes, t, nb, i0, nrows):
    """Tile t against rows i0 .. i0+nrows-1 (nrows 1, 2 or 4) of the int8 x: 4 accumulators.
    Per block: d * xd * sum(code * xq) + m * (sum of the x block). five: q5 blocks, whose fifth bits
    follow the nibbles (codes 0..31 keep the nibble dot exact, vdpbusd4_nib)."""
    a0 = vzero_f()
    a1 = vzero_f()
    a2 = vzero_f()
    a3 = vzero_f()
    mask = vbcast_i(0x0F0F0F0F)
    rs = U(passes * k)  # bytes between rows of xq
    stride = U(320) if five else U(256)
    for b in range(U(nb)):
        base = (t * U(nb) + b) * stride
        if i0 == 0:   # later rows find the tile in the caches
            for c in range(stride // U(64)):
                prefetch_l2(qp, base + U(PREFETCH_AHEAD) + c * U(64))
        w0 = vload_w(qp, base)
        w1 = vload_w(qp, base + U(64))
        w2 = vload_w(qp, base + U(128))
        w3 = vload_w(qp, base + U(192))
        l0, l1, l2, l3 = vand(w0, mask), vand(w1, mask), vand(w2, mask), vand(w3, mask)
        h0, h1 = vand(vsrl(w0, 4), mask), vand(vsrl(w1, 4), mask)
        h2, h3 = vand(vsrl(w2, 4), mask), vand(vsrl(w3, 4), mask)
        if five:
            l0, l1, l2, l3, h0, h1, h2, h3 = fifth_bits(l0, l1, l2, l3, h0, h1, h2, h3, vload_w(qp, base + U(256)))
        d, m = block_scales(sp, t, b, nb, ns, size, F(-16.0) if five else F(-8.0))
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
def _chains16(a, c, w0, w1, w2, w3, xqp, xo):
    """16 values of q8 codes (4 byte groups) against x bytes at xo, continuing two independent vpdpbusd
    chains a and c (one chain would wait on its latency when a tile runs a single row of x)."""
    a = vdpbusd(vdpbusd(a, w0, vbcast4(xqp, xo)), w1, vbcast4(xqp, xo + U(4)))
    c = vdpbusd(vdpbusd(c, w2, vbcast4(xqp, xo + U(8))), w3, vbcast4(xqp, xo + U(12)))
    return a, c


@njit(cache=True, fastmath=True)
def _dot_q8_i8(w0, w1, w2, w3, w4, w5, w6, w7, xqp, xo, k, passes):
    """As _dot_q4_i8, for the 8 byte groups of a q8 block."""
    z = vzero_i()
    a, c = _chains16(z, z, w0, w1, w2, w3, xqp, xo)
    a, c = _chains16(a, c, w4, w5, w6, w7, xqp, xo + U(16))
    if passes == 1:
        return vadd(a, c)
    e, g = _chains16(z, z, w0, w1, w2, w3, xqp, xo + U(k))
    e, g = _chains16(e, g, w4, w5, w6, w7, xqp, xo + U(k + 16))
    return vadd(vsll(vadd(a, c), 8), vadd(e, g))


@njit(cache=True, fastmath=True)
def _dot16_i8(w0, w1, w2, w3, xqp, xo, k, passes):
    """As _dot_q8_i8, for one half of the block (16 values, 4 byte groups)."""
    z = vzero_i()
    a, c = _chains16(z, z, w0, w1, w2, w3, xqp, xo)
    if passes == 1:
        return vadd(a, c)
    e, g = _chains16(z, z, w0, w1, w2, w3, xqp, xo + U(k))
    return vadd(vsll(vadd(a, c), 8), vadd(e, g))


@njit(cache=True, fastmath=True)
def _q8_row(acc, w0, w1, w2, w3, w4, w5, w6, w7, d, m, halves, xqp, xdp, xsp, xo, so, k, passes):
    """acc + one block of codes u against one row of the int8 x.
    Whole block: d * xd * sum(u * xq) + m * (block sum of x).
    halves (d, m are the halves' scales): per half h, scale_h * (xd * sum_h(u * xq) - 32 * (its x sum))."""
    xd = vbcast_f(ld_f(xdp, so))
    if halves:
        if Q8_X16 and passes == 2:
            lo = vdot4_x16(w0, w1, w2, w3, xqp, xo, U(k))
            hi = vdot4_x16(w4, w5, w6, w7, xqp, xo + U(16), U(k))
        else:
            lo = _dot16_i8(w0, w1, w2, w3, xqp, xo, k, passes)
            hi = _dot16_i8(w4, w5, w6, w7, xqp, xo + U(16), k, passes)
        acc = vfma(d, vfma(vcvt(lo), xd, vbcast_f(F(-32.0) * ld_f(xsp, U(2) * so))), acc)
        return vfma(m, vfma(vcvt(hi), xd, vbcast_f(F(-32.0) * ld_f(xsp, U(2) * so + U(1)))), acc)
    if Q8_X16 and passes == 2:
        s = vdot8_x16(w0, w1, w2, w3, w4, w5, w6, w7, xqp, xo, U(k))
    else:
        s = _dot_q8_i8(w0, w1, w2, w3, w4, w5, w6, w7, xqp, xo, k, passes)
    return vfma(m, vbcast_f(ld_f(xsp, so)), vfma(vcvt(s), vmul(d, xd), acc))


@njit(cache=True, fastmath=True)
def q8_tile_i8(qp, sp, ns, size, halves, xqp, xdp, xsp, k, passes, t, nb, i0, nrows):
    """Tile t of byte codes against rows i0 .. i0+nrows-1 (nrows 1, 2 or 4) of the int8 x (_q8_row)."""
    a0 = vzero_f()
    a1 = vzero_f()
    a2 = vzero_f()
    a3 = vzero_f()
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
        d, m = block_scales(sp, t, b, nb, ns, size, F(-128.0))
        xo = i0 * rs + b * U(QK)
        so = i0 * U(nb) + b
        a0 = _q8_row(a0, w0, w1, w2, w3, w4, w5, w6, w7, d, m, halves, xqp, xdp, xsp, xo, so, k, passes)
        if nrows >= 2:
            a1 = _q8_row(a1, w0, w1, w2, w3, w4, w5, w6, w7, d, m, halves, xqp, xdp, xsp, xo + rs, so + U(nb),
                         k, passes)
        if nrows == 4:
            a2 = _q8_row(a2, w0, w1, w2, w3, w4, w5, w6, w7, d, m, halves, xqp, xdp, xsp, xo + U(2) * rs,
                         so + U(2 * nb), k, passes)
            a3 = _q8_row(a3, w0, w1, w2, w3, w4, w5, w6, w7, d, m, halves, xqp, xdp, xsp, xo + U(3) * rs,
                         so + U(3 * nb), k, passes)
    return a0, a1, a2, a3


flush_stale_caches(globals(), "cpu_int8", cpu_simd.__file__, cpu_repack.__file__)
