"""Tiled weights back as float32: W^T for the BLAS path, the exact q4/q8 product (tiles dequantized into
a scratch), and rows of W for the embedding lookup."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.backends import cpu_int8, cpu_matmul, cpu_repack, cpu_simd, cpu_transforms
from engine.backends.cpu_cache import flush_stale_caches
from engine.backends.cpu_int8 import block_scales
from engine.backends.cpu_matmul import rows_float
from engine.backends.cpu_repack import TILE
from engine.backends.cpu_simd import (
    F, U, addr, f32_from_bits, vadd, vand, vbcast_f, vbcast_i, vcvt, vfma, vload_bf, vload_f, vload_h, vload_w,
    vmul, vsll, vsrl, vstore_f,
)
from engine.backends.cpu_transforms import transformed
from models.quant import QK


@njit(cache=True, fastmath=True, inline="always")
def _dequant_q5_block(ap, base, b, d, m, mask, wtp, ldw, col):
    """One q5 block: q4's nibbles plus the fifth bit of each code from the block's bit plane (cpu_repack)."""
    one = vbcast_i(0x1)
    bits = vload_w(ap, base + U(256))
    for g in range(U(4)):
        w = vload_w(ap, base + g * U(64))
        for c in range(U(4)):
            j = b * U(QK) + U(4) * g + c
            lo = vsll(vand(vsrl(bits, U(8) * c + g), one), 4)
            hi = vsll(vand(vsrl(bits, U(8) * c + g + U(4)), one), 4)
            vstore_f(wtp, j * U(ldw) + U(col), vfma(vcvt(vadd(vand(vsrl(w, U(8) * c), mask), lo)), d, m))
            vstore_f(wtp, (j + U(16)) * U(ldw) + U(col),
                     vfma(vcvt(vadd(vand(vsrl(w, U(8) * c + U(4)), mask), hi)), d, m))


@njit(cache=True, fastmath=True)
def _dequant_quant_tile(ap, sp, ns, size, groups, halves, t, nb, wtp, ldw, col):
    """Tile t of a q4/q5/q8/q8h matrix (at ap, scales at sp; groups: 4, 5 or 8 byte groups a block) as
    float32: item j * ldw + col + r of wtp is W[16 t + r, j], i.e. W transposed."""
    five = groups == 5
    for b in range(U(nb)):
        if groups <= 5:
            d, m = block_scales(sp, t, b, nb, ns, size, F(-16.0) if five else F(-8.0))
            mask = vbcast_i(0x0F)
            base = (t * U(nb) + b) * U(64 * groups)
            if five:
                _dequant_q5_block(ap, base, b, d, m, mask, wtp, ldw, col)
            else:
                for g in range(U(4)):
                    w = vload_w(ap, base + g * U(64))
                    for c in range(U(4)):
                        j = b * U(QK) + U(4) * g + c
                        vstore_f(wtp, j * U(ldw) + U(col), vfma(vcvt(vand(vsrl(w, U(8) * c), mask)), d, m))
                        vstore_f(wtp, (j + U(16)) * U(ldw) + U(col),
                                 vfma(vcvt(vand(vsrl(w, U(8) * c + U(4)), mask)), d, m))
        else:
            d, m = block_scales(sp, t, b, nb, ns, size, F(-128.0))
            mask = vbcast_i(0xFF)
            for g in range(U(8)):
                w = vload_w(ap, (t * U(nb) + b) * U(512) + g * U(64))
                if halves:   # u - 32 under the half's scale
                    s = d if g < U(4) else m
                    off = vmul(s, vbcast_f(-32.0))
                else:
                    s, off = d, m
                for c in range(U(4)):
                    j = b * U(QK) + U(4) * g + c
                    vstore_f(wtp, j * U(ldw) + U(col), vfma(vcvt(vand(vsrl(w, U(8) * c), mask)), s, off))


@njit(cache=True, fastmath=True)
def _dequant_float_tile(kind, ap, t, k, wtp, ldw, col):
    for j in range(U(k)):
        o = (t * U(k) + j) * U(16)
        if kind == 0:
            v = vload_f(ap, o)
        elif kind == 1:
            v = vload_h(ap, o)
        else:
            v = vload_bf(ap, o)
        vstore_f(wtp, j * U(ldw) + U(col), v)


@njit(cache=True, parallel=True)
def dequantize_quant_t(qs, sc, wt, col0, halves):
    """W^T of a tiled q4/q5/q8/q8h (halves) matrix into columns col0 : col0 + 16 nt of wt [K, ldw] float32."""
    ap, sp, wtp = addr(qs), addr(sc), addr(wt)
    for ti in prange(qs.shape[0]):
        _dequant_quant_tile(ap, sp, sc.shape[2], sc.itemsize, qs.shape[2], halves, U(ti), qs.shape[1],
                            wtp, wt.shape[1], col0 + ti * 16)


@njit(cache=True, parallel=True)
def dequantize_float_t(kind, w, wt, col0):
    ap, wtp = addr(w), addr(wt)
    for ti in prange(w.shape[0]):
        _dequant_float_tile(kind, ap, U(ti), w.shape[1], wtp, wt.shape[1], col0 + ti * 16)


@njit(cache=True, fastmath=True)
def _rows_quant_exact(qs, sc, halves, t0, t1, x, out, col0, n_out, accumulate):
    """Tiles t0..t1-1: each dequantized to float32 [K, 16] in a scratch (L1/L2) and multiplied there."""
    k = x.shape[1]
    w = np.empty(k * 16, np.float32)
    ap, sp, wp = addr(qs), addr(sc), addr(w)
    for ti in range(t0, t1):
        _dequant_quant_tile(ap, sp, sc.shape[2], sc.itemsize, qs.shape[2], halves, U(ti), qs.shape[1],
                            wp, 16, 0)
        rows_float(0, w, wp, x, U(0), out, col0 + ti * 16, min(16, n_out - ti * 16), accumulate)


@njit(cache=True, parallel=True, fastmath=True)
def matmul_quant_exact(x, qs, sc, halves, out, col0, n_out, accumulate, kind, aux, eps):
    """The q4/q5/q8/q8h product with x as it is (no int8 rounding): exact, slower; the portable level's default."""
    nt = qs.shape[0]
    nch = min(nt, 8)
    xt = transformed(x, kind, aux, eps)
    for c in prange(nch):
        _rows_quant_exact(qs, sc, halves, c * nt // nch, (c + 1) * nt // nch, xt, out, col0, n_out, accumulate)


@njit(cache=True)
def _half(bits):
    """IEEE half bits -> float32 (scalar)."""
    h = np.uint32(bits)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = (h >> np.uint32(10)) & np.uint32(0x1F)
    man = h & np.uint32(0x3FF)
    if exp == 0:
        v = np.float32(man) * np.float32(5.960464477539063e-08)  # subnormal: man * 2^-24
        return -v if sign else v
    if exp == 31:
        f = sign | np.uint32(0x7F800000) | (man << np.uint32(13))
    else:
        f = sign | ((exp + np.uint32(112)) << np.uint32(23)) | (man << np.uint32(13))
    return f32_from_bits(f)


@njit(cache=True)
def _scale(sc, t, b, s, r):
    """Scale s of block b, row r of tile t, from IEEE half (uint16) or K-quant byte scales (cpu_repack)."""
    if sc.itemsize == 1:
        sup = sc[t, b // 8].reshape(-1)   # the super-block's 320 bytes
        half = _half(np.uint16(sup[32 * s + 2 * r]) | (np.uint16(sup[32 * s + 2 * r + 1]) << 8))
        return half * np.float32(np.int8(sup[64 + 32 * (b % 8) + 16 * s + r]))
    return _half(sc[t, b, s, r])


@njit(cache=True)
def gather_quant(a, sc, halves, rows, out):
    """out[i] = W[rows[i]] as float32 for a tiled q4, q5, q8 or q8h (halves) matrix (the embedding lookup)."""
    nb = a.shape[1]
    groups = a.shape[2]
    for i in range(rows.shape[0]):
        t, r = rows[i] // TILE, rows[i] % TILE
        for b in range(nb):
            d = _scale(sc, t, b, 0, r)
            if groups <= 5:
                mn = _scale(sc, t, b, 1, r) if sc.shape[2] == 2 or sc.itemsize == 1 else np.float32(-8.0 if groups == 4 else -16.0) * d
                for j in range(16):
                    q = np.int32(a[t, b, j // 4, r, j % 4])
                    lo, hi = q & 15, q >> 4
                    if groups == 5:   # the fifth bits (cpu_repack)
                        bits = np.int32(a[t, b, 4, r, j % 4])
                        lo += ((bits >> (j // 4)) & 1) << 4
                        hi += ((bits >> (j // 4 + 4)) & 1) << 4
                    out[i, b * QK + j] = np.float32(lo) * d + mn
                    out[i, b * QK + j + 16] = np.float32(hi) * d + mn
            else:
                for j in range(QK):
                    u = np.float32(a[t, b, j // 4, r, j % 4])
                    if halves:
                        out[i, b * QK + j] = (u - np.float32(32.0)) * _scale(sc, t, b, j // 16, r)
                    elif sc.shape[2] == 2:
                        out[i, b * QK + j] = u * d + _scale(sc, t, b, 1, r)
                    else:
                        out[i, b * QK + j] = (u - np.float32(128.0)) * d


def gather_float(kind: int, w: np.ndarray, rows: np.ndarray) -> np.ndarray:
    v = w[rows // TILE, :, rows % TILE]
    if kind == 0:
        return v.astype(np.float32, copy=False)
    if kind == 1:
        return v.view(np.float16).astype(np.float32)
    return (v.astype(np.uint32) << 16).view(np.float32)


flush_stale_caches(globals(), "cpu_dequant", cpu_simd.__file__, cpu_int8.__file__, cpu_transforms.__file__,
                   cpu_matmul.__file__, cpu_repack.__file__)
