"""Matrix products on weights kept in their stored format, as numba kernels for the CPU.

At load time every matrix is repacked into a row-interleaved ("tiled") layout: rows are grouped into
tiles of TILE rows, and inside a tile the bytes of one quantized block position are contiguous across
the tile's rows. The innermost loop then runs over TILE contiguous rows, which LLVM vectorizes, and
each thread streams one contiguous slice of memory. In GGML's own row-major block order the same
products ran 6x slower (see shared/notes/numba-cuda-offline.md).

Tiled layouts (K = columns, nb = K // 32 blocks, nt = row tiles):
  q4 (q4_0, q4_1)  qs uint8 [nt, nb, 16, TILE], d f32 [nt, nb, TILE], m f32 [nt, nb, TILE]
                   w = d * nibble + m   (q4_0 stored with m = -8 d)
  q8 (q8_0)        qs uint8 [nt, nb, 32, TILE] holding q + 128, d f32 [nt, nb, TILE]
                   w = d * (stored - 128)   (uint8 widens to float in 16-wide vectors, int8 does not)
  f32              w f32    [nt, K, TILE]
  f16 / bf16       w uint16 [nt, K, TILE], widened to float32 in the kernel
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

TILE = 32      # rows per tile: 2 AVX-512 vectors of float32; keeps 2 threads balanced on small matrices
QK = 32        # values per quantization block
GEMV_MAX_ROWS = 4  # up to this many input rows, decode straight from the quantized bytes


# ---------------------------------------------------------------------------------------- repacking
def _tiles(a: np.ndarray, tile: int = TILE) -> np.ndarray:
    """[N, ...] -> [nt, tile, ...] with zero rows padding N to a multiple of tile."""
    n = a.shape[0]
    nt = -(-n // tile)
    out = np.zeros((nt * tile,) + a.shape[1:], a.dtype)
    out[:n] = a
    return out.reshape((nt, tile) + a.shape[1:])


def repack(fmt: str, data: np.ndarray, shape) -> tuple:
    """GGML-ordered weight data -> the tiled arrays of its kernel family."""
    n, k = shape
    nb = k // QK
    if fmt in ("q4_0", "q4_1"):
        bytes_per_block = 18 if fmt == "q4_0" else 20
        blocks = data.reshape(n, nb, bytes_per_block)
        d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if fmt == "q4_1":
            m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            qs = blocks[:, :, 4:20]
        else:
            m = -8.0 * d
            qs = blocks[:, :, 2:18]
        qs_t = np.ascontiguousarray(_tiles(qs).transpose(0, 2, 3, 1))       # [nt, nb, 16, TILE]
        d_t = np.ascontiguousarray(_tiles(d).transpose(0, 2, 1))             # [nt, nb, TILE]
        m_t = np.ascontiguousarray(_tiles(m).transpose(0, 2, 1))
        return ("q4", qs_t, d_t, m_t)
    if fmt == "q8_0":
        blocks = data.reshape(n, nb, 34)
        d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = (blocks[:, :, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        qs_t = np.ascontiguousarray(_tiles(qs).transpose(0, 2, 3, 1))       # [nt, nb, 32, TILE]
        d_t = np.ascontiguousarray(_tiles(d).transpose(0, 2, 1))
        return ("q8", qs_t, d_t)
    if fmt == "f32":
        return ("f32", np.ascontiguousarray(_tiles(np.asarray(data, np.float32)).transpose(0, 2, 1)))
    if fmt == "f16":
        return ("f16", np.ascontiguousarray(_tiles(np.asarray(data).view(np.uint16)).transpose(0, 2, 1)))
    if fmt == "bf16":
        return ("bf16", np.ascontiguousarray(_tiles(np.asarray(data).view(np.uint16)).transpose(0, 2, 1)))
    raise ValueError(f"no CPU kernel for weight format {fmt!r}")


# ------------------------------------------------------------------------------- half-float widening
@njit(cache=True, inline="always")
def _f16_bits_to_f32_bits(h):
    """IEEE half bits -> single bits (normals, subnormals, zero, inf, nan)."""
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = (h >> np.uint32(10)) & np.uint32(0x1F)
    man = h & np.uint32(0x3FF)
    if exp == 0:
        if man == 0:
            return sign
        e = np.uint32(113)  # renormalize a subnormal
        while (man & np.uint32(0x400)) == 0:
            man <<= np.uint32(1)
            e -= np.uint32(1)
        return sign | (e << np.uint32(23)) | ((man & np.uint32(0x3FF)) << np.uint32(13))
    if exp == 31:
        return sign | np.uint32(0x7F800000) | (man << np.uint32(13))
    return sign | ((exp + np.uint32(112)) << np.uint32(23)) | (man << np.uint32(13))


@njit(cache=True, inline="always")
def _widen_row(src, is_bf16, bits, out):
    """uint16 half or bfloat16 values -> float32 `out` (bits: a uint32 scratch viewed as float32)."""
    for i in range(src.shape[0]):
        if is_bf16:
            bits[i] = np.uint32(src[i]) << np.uint32(16)
        else:
            bits[i] = _f16_bits_to_f32_bits(src[i])
    f = bits.view(np.float32)
    for i in range(src.shape[0]):
        out[i] = f[i]


# Index arithmetic below is unsigned (U = uint64) on purpose: numba guards signed indices against
# negative wraparound, and that guard turns contiguous vector loads into byte-by-byte gathers
# (13 vs 29 GB/s measured). Mixing uint64 with a signed int gives float64 in numba, so every
# literal in index math is wrapped in U(...).
U = np.uint64
F = np.float32


# ---------------------------------------------------------------------------------- block decoding
@njit(cache=True, inline="always", fastmath=True)
def _decode_q4_block(qs, d, m, t, b, w):
    """Tile t, block b of a q4 matrix -> w [32, TILE] float32.

    A byte q holds nibbles lo = q - 16*hi and hi = floor(q / 16); computing them in float32 keeps
    the loop in 16-wide float vectors (integer ops on bytes widen to int64 in numba)."""
    for j in range(U(16)):
        for r in range(U(TILE)):
            qf = F(qs[t, b, j, r])
            hi = np.floor(qf * F(0.0625))
            w[j, r] = (qf - F(16.0) * hi) * d[t, b, r] + m[t, b, r]
            w[j + U(16), r] = hi * d[t, b, r] + m[t, b, r]


@njit(cache=True, inline="always", fastmath=True)
def _decode_q8_block(qs, d, t, b, w):
    for j in range(U(QK)):
        for r in range(U(TILE)):
            w[j, r] = (F(qs[t, b, j, r]) - F(128.0)) * d[t, b, r]


@njit(cache=True, inline="always", fastmath=True)
def _accumulate_block(x, w, k0, acc):
    """acc[i, :] += x[i, k0:k0+32] @ w  (w: [32, TILE] float32)."""
    for i in range(U(x.shape[0])):
        for j in range(U(w.shape[0])):
            xv = x[i, k0 + j]
            for r in range(U(TILE)):
                acc[i, r] += w[j, r] * xv


@njit(cache=True, inline="always")
def _store(acc, t, out, col0, n_out, accumulate):
    r0 = t * TILE
    rn = min(TILE, n_out - r0)
    for i in range(acc.shape[0]):
        if accumulate:
            for r in range(rn):
                out[i, col0 + r0 + r] += acc[i, r]
        else:
            for r in range(rn):
                out[i, col0 + r0 + r] = acc[i, r]


@njit(cache=True, fastmath=True)
def _block_sums(x, nb):
    """Sum of each row of x over each 32-value block: [rows, nb]."""
    xsum = np.empty((x.shape[0], nb), np.float32)
    for i in range(x.shape[0]):
        for b in range(nb):
            s = F(0.0)
            for j in range(QK):
                s += x[i, b * QK + j]
            xsum[i, b] = s
    return xsum


# -------------------------------------------------------------------------------------- q4 kernels
@njit(cache=True, parallel=True, fastmath=True)
def gemv_q4(x, qs, d, m, out, col0, n_out, accumulate):
    """out[i, col0 + r] (+)= sum_k x[i, k] * W[r, k], reading W's 4-bit bytes directly (few rows of x).

    With lo = q - 16 hi:  lo*x_lo + hi*x_hi = q*x_lo + hi*(x_hi - 16 x_lo), one floor per byte."""
    nt, nb = qs.shape[0], qs.shape[1]
    mrows = x.shape[0]
    xsum = _block_sums(x, nb)
    for ti in prange(nt):
        t = U(ti)
        acc = np.zeros((mrows, TILE), np.float32)
        tmp = np.empty(TILE, np.float32)
        for i in range(U(mrows)):
            for b in range(U(nb)):
                for r in range(U(TILE)):
                    tmp[r] = 0.0
                base = b * U(QK)
                for j in range(U(16)):
                    xl = x[i, base + j]
                    xc = x[i, base + j + U(16)] - F(16.0) * xl
                    for r in range(U(TILE)):
                        qf = F(qs[t, b, j, r])
                        tmp[r] += qf * xl + np.floor(qf * F(0.0625)) * xc
                xs = xsum[i, b]
                for r in range(U(TILE)):
                    acc[i, r] += d[t, b, r] * tmp[r] + m[t, b, r] * xs
        _store(acc, ti, out, col0, n_out, accumulate)


@njit(cache=True, parallel=True, fastmath=True)
def gemm_q4(x, qs, d, m, out, col0, n_out, accumulate):
    """Same product for many rows of x: decode each block once to float32, reuse it for every row."""
    nt, nb = qs.shape[0], qs.shape[1]
    mrows = x.shape[0]
    for ti in prange(nt):
        acc = np.zeros((mrows, TILE), np.float32)
        w = np.empty((QK, TILE), np.float32)
        for b in range(U(nb)):
            _decode_q4_block(qs, d, m, U(ti), b, w)
            _accumulate_block(x, w, b * U(QK), acc)
        _store(acc, ti, out, col0, n_out, accumulate)


# -------------------------------------------------------------------------------------- q8 kernels
@njit(cache=True, parallel=True, fastmath=True)
def gemv_q8(x, qs, d, out, col0, n_out, accumulate):
    nt, nb = qs.shape[0], qs.shape[1]
    mrows = x.shape[0]
    xsum = _block_sums(x, nb)
    for ti in prange(nt):
        t = U(ti)
        acc = np.zeros((mrows, TILE), np.float32)
        tmp = np.empty(TILE, np.float32)
        for i in range(U(mrows)):
            for b in range(U(nb)):
                for r in range(U(TILE)):
                    tmp[r] = 0.0
                base = b * U(QK)
                for j in range(U(16)):
                    x0 = x[i, base + j]
                    x1 = x[i, base + j + U(16)]
                    for r in range(U(TILE)):
                        tmp[r] += F(qs[t, b, j, r]) * x0 + F(qs[t, b, j + U(16), r]) * x1
                xs = xsum[i, b] * F(128.0)
                for r in range(U(TILE)):
                    acc[i, r] += d[t, b, r] * (tmp[r] - xs)
        _store(acc, ti, out, col0, n_out, accumulate)


@njit(cache=True, parallel=True, fastmath=True)
def gemm_q8(x, qs, d, out, col0, n_out, accumulate):
    nt, nb = qs.shape[0], qs.shape[1]
    mrows = x.shape[0]
    for ti in prange(nt):
        acc = np.zeros((mrows, TILE), np.float32)
        w = np.empty((QK, TILE), np.float32)
        for b in range(U(nb)):
            _decode_q8_block(qs, d, U(ti), b, w)
            _accumulate_block(x, w, b * U(QK), acc)
        _store(acc, ti, out, col0, n_out, accumulate)


# ------------------------------------------------------------------------------ float-weight kernels
@njit(cache=True, parallel=True, fastmath=True)
def gemm_f32(x, wt, out, col0, n_out, accumulate):
    nt, k = wt.shape[0], wt.shape[1]
    mrows = x.shape[0]
    for ti in prange(nt):
        acc = np.zeros((mrows, TILE), np.float32)
        for b in range(0, k, QK):
            _accumulate_block(x, wt[ti, b:b + QK], U(b), acc)
        _store(acc, ti, out, col0, n_out, accumulate)


@njit(cache=True, parallel=True, fastmath=True)
def gemm_half(x, wt, is_bf16, out, col0, n_out, accumulate):
    nt, k = wt.shape[0], wt.shape[1]
    mrows = x.shape[0]
    for ti in prange(nt):
        acc = np.zeros((mrows, TILE), np.float32)
        w = np.empty((QK, TILE), np.float32)
        bits = np.empty(TILE, np.uint32)
        for b in range(0, k, QK):
            for j in range(QK):
                _widen_row(wt[ti, b + j], is_bf16, bits, w[j])
            _accumulate_block(x, w, U(b), acc)
        _store(acc, ti, out, col0, n_out, accumulate)


# --------------------------------------------------------------------------- dequantize for BLAS
@njit(cache=True, parallel=True, fastmath=True)
def dequantize_q4(qs, d, m, n_out, out):
    """The whole matrix as float32 [n_out, K] (for large prefill batches that BLAS multiplies faster)."""
    nt, nb = qs.shape[0], qs.shape[1]
    for t in prange(nt):
        w = np.empty((QK, TILE), np.float32)
        r0 = t * TILE
        rn = min(TILE, n_out - r0)
        for b in range(nb):
            _decode_q4_block(qs, d, m, U(t), U(b), w)
            for r in range(rn):
                for j in range(QK):
                    out[r0 + r, b * QK + j] = w[j, r]


@njit(cache=True, parallel=True, fastmath=True)
def dequantize_q8(qs, d, n_out, out):
    nt, nb = qs.shape[0], qs.shape[1]
    for t in prange(nt):
        w = np.empty((QK, TILE), np.float32)
        r0 = t * TILE
        rn = min(TILE, n_out - r0)
        for b in range(nb):
            _decode_q8_block(qs, d, U(t), U(b), w)
            for r in range(rn):
                for j in range(QK):
                    out[r0 + r, b * QK + j] = w[j, r]


@njit(cache=True)
def gather_rows_q8(qs, d, rows, out):
    """Embedding lookup on a tiled q8 matrix: out[i] = W[rows[i]]."""
    nb = qs.shape[1]
    for i in range(rows.shape[0]):
        t, r = rows[i] // TILE, rows[i] % TILE
        for b in range(nb):
            for j in range(QK):
                out[i, b * QK + j] = (np.float32(qs[t, b, j, r]) - np.float32(128.0)) * d[t, b, r]


@njit(cache=True)
def gather_rows_q4(qs, d, m, rows, out):
    nb = qs.shape[1]
    for i in range(rows.shape[0]):
        t, r = rows[i] // TILE, rows[i] % TILE
        for b in range(nb):
            for j in range(16):
                q = np.int32(qs[t, b, j, r])
                out[i, b * QK + j] = np.float32(q & 15) * d[t, b, r] + m[t, b, r]
                out[i, b * QK + j + 16] = np.float32(q >> 4) * d[t, b, r] + m[t, b, r]
