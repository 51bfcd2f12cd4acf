"""Matrix products on weights kept in their stored, tiled format (cpu_repack), as numba kernels for the CPU.

Two ways to multiply quantized weights:
  int8 (default on every ISA level but portable, cpu_isa): x rounded to int8 on the fly (cpu_int8),
     vpdpbusd dots (or vpmaddubsw + vpmaddwd on avx2).
  float (exact; the portable level's default, or CpuLinear(int8=False)): each tile dequantized to float32
     in a small scratch, then the float kernel (cpu_dequant.matmul_quant_exact).
Float formats always use the float kernels here (4 rows x 16 outputs of accumulators in registers).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.backends import cpu_claims, cpu_int8, cpu_simd, cpu_transforms
from engine.backends.cpu_cache import flush_stale_caches
from engine.backends.cpu_claims import chunk_of, claim, finish, wait
from engine.backends.cpu_int8 import q4_tile_i8, q8_tile_i8, quantize_row
from engine.backends.cpu_simd import (
    U, addr, ld_f, st_f, vadd, vbcast_f, vfma, vget, vload_bf, vload_f, vload_h, vstore_f, vzero_f,
)
from engine.backends.cpu_transforms import transformed
from models.quant import QK


@njit(cache=True, fastmath=True)
def store_tile_row(op, ld, i, col, acc, rn, accumulate):
    """out[i, col : col + rn] (+)= acc[:rn] for out (float32 at op) with row length ld."""
    o = i * U(ld) + U(col)
    if rn == 16:
        if accumulate:
            vstore_f(op, o, vadd(vload_f(op, o), acc))
        else:
            vstore_f(op, o, acc)
    else:
        for r in range(rn):
            v = vget(acc, r)
            if accumulate:
                v += ld_f(op, o + U(r))
            st_f(op, o + U(r), v)


@njit(cache=True, fastmath=True)
def float_tile(wp, kind, xp, k, t, i0, nrows):
    """kind 0: float32 weights, 1: f16, 2: bf16 ([nt, K, 16] at wp); x float32 at xp."""
    a0 = vzero_f()
    a1 = vzero_f()
    a2 = vzero_f()
    a3 = vzero_f()
    base = t * U(k) * U(16)
    x0 = i0 * U(k)
    for j in range(U(k)):
        if kind == 0:
            w = vload_f(wp, base + j * U(16))
        elif kind == 1:
            w = vload_h(wp, base + j * U(16))
        else:
            w = vload_bf(wp, base + j * U(16))
        a0 = vfma(w, vbcast_f(ld_f(xp, x0 + j)), a0)
        if nrows == 4:
            a1 = vfma(w, vbcast_f(ld_f(xp, x0 + U(k) + j)), a1)
            a2 = vfma(w, vbcast_f(ld_f(xp, x0 + U(2 * k) + j)), a2)
            a3 = vfma(w, vbcast_f(ld_f(xp, x0 + U(3 * k) + j)), a3)
    return a0, a1, a2, a3


# Each public kernel is a parallel loop over row tiles whose body is one call of a plain compiled
# function (`_rows_*`): a small parallel body keeps numba's compile time down (with the whole tile
# loop inlined into it, numba's parfor passes took tens of seconds per kernel).
@njit(cache=True, fastmath=True)
def _quantize_x_row(x, i, passes, xq, xd, xs):
    k = x.shape[1]
    halves = xs.shape[1] != xd.shape[1]
    quantize_row(addr(x), U(i) * U(k), k, addr(xq), addr(xd), addr(xs), U(i), k // QK, passes, halves)


@njit(cache=True, fastmath=True, inline="always")
def prepare_x(x, passes, halves=False):
    """x [M, K] -> int8 planes xq ([M, passes, K]), block scales xd [M, nb] and sums xs [M, nb] (with
    halves [M, 2 nb], per 16 values); rows in parallel when there are many."""
    m, k = x.shape
    nb = k // QK
    xq = np.empty((m, passes, k), np.int8)
    xd = np.empty((m, nb), np.float32)
    xs = np.empty((m, nb * (2 if halves else 1)), np.float32)
    if m >= 16:
        for i in prange(m):
            _quantize_x_row(x, i, passes, xq, xd, xs)
    else:
        for i in range(m):
            _quantize_x_row(x, i, passes, xq, xd, xs)
    return xq, xd, xs


@njit(cache=True, fastmath=True)
def quantize_activations(x, passes=1):
    """The int8 form of x [M, K] that the int8 kernels use: xq [M, passes, K] int8, xd and xs [M, nb];
    per 32-block x ~ xq[:, 0] * xd (passes 1) or (256 * xq[:, 0] + xq[:, 1]) * xd (passes 2).
    For tests and tools; the kernels quantize on the fly."""
    m, k = x.shape
    nb = k // QK
    xq = np.empty((m, passes, k), np.int8)
    xd = np.empty((m, nb), np.float32)
    xs = np.empty((m, nb), np.float32)
    for i in range(m):
        _quantize_x_row(x, i, passes, xq, xd, xs)
    return xq, xd, xs


@njit(cache=True, fastmath=True, inline="always")
def _rows_i8(is_q4, five, halves, qs, sc, xq, xd, xs, t, out, col, rn, accumulate):
    """Tile t against every row of x: 4 rows at a time (4 x 16 accumulators in registers), then the rest.
    Scales: float32, IEEE halves or K-quant bytes (sc's item size, cpu_repack); five: q5 blocks (q4's with fifth bits);
    halves: q8 codes with a scale per 16 values."""
    m, passes, k = xq.shape
    nb, ns, ld = qs.shape[1], sc.shape[2], out.shape[1]
    qp, sp, xqp, xdp, xsp, op = addr(qs), addr(sc), addr(xq), addr(xd), addr(xs), addr(out)
    m4 = m - m % 4
    for i0 in range(0, m4, 4):
        i = U(i0)
        if is_q4:
            a0, a1, a2, a3 = q4_tile_i8(qp, sp, ns, sc.itemsize, five, xqp, xdp, xsp, k, passes, t, nb, i, 4)
        else:
            a0, a1, a2, a3 = q8_tile_i8(qp, sp, ns, sc.itemsize, halves, xqp, xdp, xsp, k, passes, t, nb, i, 4)
        store_tile_row(op, ld, i, col, a0, rn, accumulate)
        store_tile_row(op, ld, i + U(1), col, a1, rn, accumulate)
        store_tile_row(op, ld, i + U(2), col, a2, rn, accumulate)
        store_tile_row(op, ld, i + U(3), col, a3, rn, accumulate)
    for i0 in range(m4, m):
        if is_q4:
            a0, a1, a2, a3 = q4_tile_i8(qp, sp, ns, sc.itemsize, five, xqp, xdp, xsp, k, passes, t, nb, U(i0), 1)
        else:
            a0, a1, a2, a3 = q8_tile_i8(qp, sp, ns, sc.itemsize, halves, xqp, xdp, xsp, k, passes, t, nb, U(i0), 1)
        store_tile_row(op, ld, U(i0), col, a0, rn, accumulate)


@njit(cache=True, fastmath=True)
def _rows_q4_i8(qs, sc, xq, xd, xs, t, out, col, rn, accumulate):
    _rows_i8(True, False, False, qs, sc, xq, xd, xs, t, out, col, rn, accumulate)


@njit(cache=True, fastmath=True)
def _rows_q5_i8(qs, sc, xq, xd, xs, t, out, col, rn, accumulate):
    _rows_i8(True, True, False, qs, sc, xq, xd, xs, t, out, col, rn, accumulate)


@njit(cache=True, fastmath=True)
def _rows_q8_i8(qs, sc, xq, xd, xs, t, out, col, rn, accumulate):
    _rows_i8(False, False, False, qs, sc, xq, xd, xs, t, out, col, rn, accumulate)


@njit(cache=True, fastmath=True)
def _rows_q8h_i8(qs, sc, xq, xd, xs, t, out, col, rn, accumulate):
    _rows_i8(False, False, True, qs, sc, xq, xd, xs, t, out, col, rn, accumulate)


@njit(cache=True, fastmath=True)
def rows_float(kind, w, wp, x, t, out, col, rn, accumulate):
    """Tile t of a float matrix (at wp: [nt, K, 16]; w keeps it alive) against every row of x."""
    m, k = x.shape
    xp, op, ld = addr(x), addr(out), out.shape[1]
    m4 = m - m % 4
    for i0 in range(0, m4, 4):
        i = U(i0)
        a0, a1, a2, a3 = float_tile(wp, kind, xp, k, t, i, 4)
        store_tile_row(op, ld, i, col, a0, rn, accumulate)
        store_tile_row(op, ld, i + U(1), col, a1, rn, accumulate)
        store_tile_row(op, ld, i + U(2), col, a2, rn, accumulate)
        store_tile_row(op, ld, i + U(3), col, a3, rn, accumulate)
    for i0 in range(m4, m):
        a0, a1, a2, a3 = float_tile(wp, kind, xp, k, t, U(i0), 1)
        store_tile_row(op, ld, U(i0), col, a0, rn, accumulate)


# Public kernels: out[:, col0 : col0 + n_out] (+)= x @ W.T for one tiled matrix (x [M, K] and out
# C-contiguous float32; qs, sc / w: the arrays of `repack`). One parallel loop over row tiles.
@njit(cache=True, parallel=True, fastmath=True)
def matmul_q4_i8(x, qs, sc, out, col0, n_out, accumulate, passes, kind, aux, eps):
    xq, xd, xs = prepare_x(transformed(x, kind, aux, eps), passes)
    for ti in prange(qs.shape[0]):
        _rows_q4_i8(qs, sc, xq, xd, xs, U(ti), out, col0 + ti * 16, min(16, n_out - ti * 16), accumulate)


@njit(cache=True, parallel=True, fastmath=True)
def matmul_q5_i8(x, qs, sc, out, col0, n_out, accumulate, passes, kind, aux, eps):
    xq, xd, xs = prepare_x(transformed(x, kind, aux, eps), passes)
    for ti in prange(qs.shape[0]):
        _rows_q5_i8(qs, sc, xq, xd, xs, U(ti), out, col0 + ti * 16, min(16, n_out - ti * 16), accumulate)


@njit(cache=True, parallel=True, fastmath=True)
def matmul_q8_i8(x, qs, sc, out, col0, n_out, accumulate, passes, kind, aux, eps):
    xq, xd, xs = prepare_x(transformed(x, kind, aux, eps), passes)
    for ti in prange(qs.shape[0]):
        _rows_q8_i8(qs, sc, xq, xd, xs, U(ti), out, col0 + ti * 16, min(16, n_out - ti * 16), accumulate)


@njit(cache=True, parallel=True, fastmath=True)
def matmul_q8h_i8(x, qs, sc, out, col0, n_out, accumulate, passes, kind, aux, eps):
    xq, xd, xs = prepare_x(transformed(x, kind, aux, eps), passes, True)
    for ti in prange(qs.shape[0]):
        _rows_q8h_i8(qs, sc, xq, xd, xs, U(ti), out, col0 + ti * 16, min(16, n_out - ti * 16), accumulate)


@njit(cache=True, parallel=True, fastmath=True)
def matmul_float(wkind, x, w, out, col0, n_out, accumulate, kind, aux, eps):
    """Float weights w [nt, K, 16]: wkind 0 float32, 1 f16, 2 bf16 (w uint16 for both)."""
    wp = addr(w)
    xt = transformed(x, kind, aux, eps)
    for ti in prange(w.shape[0]):
        rows_float(wkind, w, wp, xt, U(ti), out, col0 + ti * 16, min(16, n_out - ti * 16), accumulate)


@njit(cache=True, fastmath=True)
def tiles_i8(family, qs, sc, xq, xd, xs, out, col0, n_out, t0, t1, accumulate):
    """Row tiles t0 .. t1-1 of a q4 (family 0), q5 (1), q8 (2) or q8h (3) matrix against the int8 x: one
    thread's share of a product that the threads of a parallel region claim tile by tile (cpu_claims)."""
    for ti in range(t0, t1):
        col, rn = col0 + ti * 16, min(16, n_out - ti * 16)
        if family == 0:
            _rows_q4_i8(qs, sc, xq, xd, xs, U(ti), out, col, rn, accumulate)
        elif family == 1:
            _rows_q5_i8(qs, sc, xq, xd, xs, U(ti), out, col, rn, accumulate)
        elif family == 2:
            _rows_q8_i8(qs, sc, xq, xd, xs, U(ti), out, col, rn, accumulate)
        else:
            _rows_q8h_i8(qs, sc, xq, xd, xs, U(ti), out, col, rn, accumulate)


@njit(cache=True, fastmath=True)
def matmul_i8_claimed(x, qs, sc, out, n_out, accumulate, passes, kind, aux, eps, counters, phase, threads):
    """One thread's part of out[:, :n_out] (+)= x @ W.T for a q4 / q5 / q8 matrix inside a parallel region
    that runs several products (cpu_claims): row tiles claimed from the phase's counter, then a wait for all
    of them. Every thread transforms and rounds x itself (a few rows: cheaper than a phase of its own)."""
    # not a parallel function: the prange loops inlined from prepare_x and transformed run as plain loops
    xq, xd, xs = prepare_x(transformed(x, kind, aux, eps), passes)
    family = 0 if qs.shape[2] == 4 else (1 if qs.shape[2] == 5 else 2)
    nt = qs.shape[0]
    chunk = chunk_of(nt, threads)
    t0 = claim(counters, phase, chunk)
    while t0 < nt:
        t1 = min(t0 + chunk, nt)
        tiles_i8(family, qs, sc, xq, xd, xs, out, 0, n_out, t0, t1, accumulate)
        finish(counters, phase, t1 - t0)
        t0 = claim(counters, phase, chunk)
    wait(counters, phase, nt)


FLOAT_KIND = {"f32": 0, "f16": 1, "bf16": 2}


flush_stale_caches(globals(), "cpu_matmul", cpu_simd.__file__, cpu_int8.__file__, cpu_transforms.__file__,
                   cpu_claims.__file__)
