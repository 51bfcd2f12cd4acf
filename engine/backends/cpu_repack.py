"""Weights repacked at load time into the row-interleaved ("tiled") layout of the CPU kernels.

Rows are grouped into tiles of TILE = 16 rows, one 16-lane SIMD register of float32 or int32, and inside
a tile the data of one block position are contiguous across the tile's rows. Each kernel step loads one
register of weights that feeds 16 output rows at once, and each thread streams one contiguous slice of
memory.

Tiled layouts (N = rows, K = columns, nb = K // 32 blocks, nt = N / 16 row tiles, zero-padded):
  q4 (q4_0, q4_1, q4_k)  qs uint8 [nt, nb, 4, 16, 4]: [t, b, g, r, c] = byte 4g+c of row 16t+r, block b
                   (its low nibble is value 4g+c of the block, its high nibble value 16+4g+c)
                   sc [nt, nb, S, 16]: scales d (and with S = 2 the offset m); w = d * nibble + m
                   (S = 1: m = -8 d; q4_k: K-quant bytes, below)
  q5 (q5_0, q5_1, q5_k)  qs uint8 [nt, nb, 5, 16, 4]: g < 4 the low four bits of the codes, as q4's nibbles;
                   g = 4, byte c of row r: bit v is the fifth bit of the code at byte c of row r in nibble
                   vector v (v < 4: the low nibbles of g = v, value 4v+c; v >= 4: the high ones of g = v-4,
                   value 16+4(v-4)+c); sc [nt, nb, S, 16]: (d, m), w = d * u + m (q5_0: S = 1, m = -16 d;
                   q5_k: K-quant bytes)
  q8 (q8_0)        qs uint8 [nt, nb, 8, 16, 4] of unsigned codes u (as the int8 dot wants them)
                   sc [nt, nb, 1, 16]: w = d * (u - 128) (u = q + 128)
  q8h (q6_k)       qs as q8, u = the 6-bit code; sc (K-quant bytes): the scales of the block's two halves
                   of 16 values, w = d_half * (u - 32)
A code's offset stays near the middle of its range (m = -16 d for q5_0 rather than a signed code): the
int8 kernels subtract the offset's product from the codes' product in float32, and an offset far larger
than the codes' spread would cancel most of the result's digits.
  f32              w float32 [nt, K, 16]
  f16 / bf16       w uint16  [nt, K, 16], widened to float32 in the kernel
Scales are IEEE halves (uint16) where the file stores them per block of 32 (the legacy formats). The
K-quants' scale per 32 (16) values is a half super-scale times a 6-bit (8-bit) integer: exact in float32,
not in float16, and float32 per block would read a third more than the file. They keep the file's form
as bytes instead, sc uint8 [nt, nb / 8, 20, 16] per super-block of 256 values: rows 0-1 the tile's 16
half scales s0 and rows 2-3 its s1 (q4_k, q5_k: d and -dmin; q6_k: d twice), then for each block j rows
4 + 2j and 5 + 2j its two int8 multipliers (q4_k, q5_k: sc and m; q6_k: the sc of its two halves); the
kernels take d = s0 * first and m (q6_k: the second half's scale) = s1 * second, the same float32 as the
file's. Bytes per weight in these layouts: q8_0 1.0625, q4_0 0.5625, q4_1 0.625, q5_0 0.6875, q5_1 0.75
(all as stored), q4_k 0.578 (stored 0.5625), q5_k 0.703 (0.6875), q6_k 1.078 (0.8203): 6-bit codes take
a byte so that the q8 kernels serve them.
The four bytes of one int32 lane are four consecutive values of one row: the layout of vpdpbusd
(AVX-512 VNNI, AVX-VNNI), which vpmaddubsw + vpmaddwd (AVX2) read the same way.
"""
from __future__ import annotations

import numpy as np

from models.kquants import KFields
from models.quant import CODE_ZERO, K_FORMATS, QuantTensor

TILE = 16  # rows per tile: one 16-lane register
K_SUPER_BYTES = 320  # a tile's K-quant scales per super-block of 256 values (layout above)
QUANT_FAMILIES = ("q4", "q5", "q8", "q8h")  # the block layouts below (the rest are float)


def _tiles(a: np.ndarray) -> np.ndarray:
    """[N, ...] -> [nt, TILE, ...], zero rows padding N to a multiple of TILE."""
    n = a.shape[0]
    nt = -(-n // TILE)
    out = np.zeros((nt * TILE,) + a.shape[1:], a.dtype)
    out[:n] = a
    return out.reshape((nt, TILE) + a.shape[1:])


def _tile_bytes(qs: np.ndarray) -> np.ndarray:
    """Row-major block bytes [N, nb, B] -> [nt, nb, B/4, TILE, 4] (4 consecutive bytes of a row per lane)."""
    n, nb, nbytes = qs.shape
    t = _tiles(qs).reshape(-1, TILE, nb, nbytes // 4, 4)
    return np.ascontiguousarray(t.transpose(0, 2, 3, 1, 4))


def _tile_scales(*scales: np.ndarray) -> np.ndarray:
    """Scales [N, nb] each (float16 values) -> IEEE half bits [nt, nb, S, TILE]."""
    s = np.stack([np.asarray(x, np.float16).view(np.uint16) for x in scales], axis=-1)  # [N, nb, S]
    return np.ascontiguousarray(_tiles(s).transpose(0, 2, 3, 1))


def _k_scales(fmt: str, f: KFields, n: int, k: int) -> np.ndarray:
    """A K-quant's scales as bytes [nt, nb / 8, 20, 16] (layout above), from its fields."""
    d = f.d.reshape(n, k // 256)
    if fmt == "q6_k":   # one super-scale; each block's two halves of 16 values have a multiplier
        sc = f.sc.reshape(n, k // 16)
        supers, mults = (d, d), (sc[:, 0::2], sc[:, 1::2])
    else:
        supers, mults = (d, -f.dmin.reshape(n, k // 256)), (f.sc.reshape(n, k // 32), f.m.reshape(n, k // 32))
    sup = _tiles(np.stack(supers, axis=-1).astype(np.float16))   # [nt, 16, nsup, 2]
    nt = sup.shape[0]
    sup = np.ascontiguousarray(sup.transpose(0, 2, 3, 1)).view(np.uint8).reshape(nt, k // 256, 4, 16)
    mul = _tiles(np.stack(mults, axis=-1).astype(np.int8))   # [nt, 16, nb, 2]
    mul = np.ascontiguousarray(mul.transpose(0, 2, 3, 1)).view(np.uint8).reshape(nt, k // 256, 16, 16)
    return np.ascontiguousarray(np.concatenate([sup, mul], axis=2))


def _repack_block(t: QuantTensor) -> tuple:
    """A block format: its codes (QuantTensor.affine's, or a K-quant's fields) and scales, tiled."""
    n, k = t.shape
    if t.format in K_FORMATS:
        f = t.k_fields()
        codes, sc = f.q, _k_scales(t.format, f, n, k)
    else:
        codes, d, m, _ = t.affine()
        sc = _tile_scales(*((d,) if t.format in CODE_ZERO else (d, m)))
    codes = codes.reshape(n, k // 32, 32)
    if t.format == "q6_k":   # two scale groups of 16 per block
        return ("q8h", _tile_bytes(codes), sc)
    if t.format in ("q4_0", "q4_1", "q4_k"):
        return ("q4", _tile_bytes(codes[:, :, :16] | (codes[:, :, 16:] << 4)), sc)
    if t.format == "q8_0":   # w = d * (u - 128), u = code
        return ("q8", _tile_bytes(codes), sc)
    # q5_0, q5_1, q5_k: q4's nibbles, then each row's fifth bits as 4 bytes (layout above)
    low = codes & 15
    nibbles = low[:, :, :16] | (low[:, :, 16:] << 4)
    fifth = (codes >> 4).reshape(n, k // 32, 2, 4, 4)   # [row, block, half, g, c]
    bits = np.zeros((n, k // 32, 4), np.uint8)
    for v in range(8):
        bits |= fifth[:, :, v // 4, v % 4, :] << v
    return ("q5", _tile_bytes(np.concatenate([nibbles, bits], axis=2)), sc)


def repack(t: QuantTensor) -> tuple:
    """A stored matrix (GGML-ordered data) -> (family, *tiled arrays)."""
    fmt, data = t.format, t.data
    if fmt == "f32":
        return ("f32", np.ascontiguousarray(_tiles(np.asarray(data, np.float32)).transpose(0, 2, 1)))
    if fmt in ("f16", "bf16"):
        return (fmt, np.ascontiguousarray(_tiles(np.asarray(data).view(np.uint16)).transpose(0, 2, 1)))
    return _repack_block(t)
