"""Weights repacked at load time into the row-interleaved ("tiled") layout of the CPU kernels.

Rows are grouped into tiles of TILE = 16 rows, one 16-lane SIMD register of float32 or int32, and inside
a tile the data of one block position are contiguous across the tile's rows. Each kernel step loads one
register of weights that feeds 16 output rows at once, and each thread streams one contiguous slice of
memory.

Tiled layouts (N = rows, K = columns, nb = K // 32 blocks, nt = N / 16 row tiles, zero-padded):
  q4 (q4_0, q4_1)  qs uint8  [nt, nb, 4, 16, 4]: [t, b, g, r, c] = byte 4g+c of row 16t+r, block b
                             (its low nibble is value 4g+c of the block, its high nibble value 16+4g+c)
                   sc uint16 [nt, nb, S, 16]: IEEE half scales d (and for q4_1, S = 2, the min m)
                   w = d * nibble + m   (q4_0: m = -8 d)
  q8 (q8_0)        qs uint8  [nt, nb, 8, 16, 4] holding q + 128 (unsigned, as the int8 dot wants it)
                   sc uint16 [nt, nb, 1, 16]: half scales d;  w = d * (stored - 128)
  f32              w float32 [nt, K, 16]
  f16 / bf16       w uint16  [nt, K, 16], widened to float32 in the kernel
So a quantized matrix takes exactly its GGUF size (scales stay f16), and the four bytes of one int32
lane are four consecutive values of one row: the layout of vpdpbusd (AVX-512 VNNI,
AVX-VNNI), which vpmaddubsw + vpmaddwd (AVX2) read the same way.
"""
from __future__ import annotations

import numpy as np

from models.quant import QuantTensor

TILE = 16  # rows per tile: one 16-lane register


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
    """Half scales [N, nb] each -> uint16 [nt, nb, S, TILE]."""
    s = np.stack([np.asarray(x, np.float16).view(np.uint16) for x in scales], axis=-1)  # [N, nb, S]
    return np.ascontiguousarray(_tiles(s).transpose(0, 2, 3, 1))


def repack(t: QuantTensor) -> tuple:
    """A stored matrix (GGML-ordered data) -> (family, *tiled arrays)."""
    fmt, data = t.format, t.data
    if fmt in ("q4_0", "q4_1"):
        d, m, qs = t.block_fields()
        return ("q4", _tile_bytes(qs), _tile_scales(d) if m is None else _tile_scales(d, m))
    if fmt == "q8_0":
        d, _, qs = t.block_fields()
        return ("q8", _tile_bytes((qs.view(np.int8).astype(np.int16) + 128).astype(np.uint8)), _tile_scales(d))
    if fmt == "f32":
        return ("f32", np.ascontiguousarray(_tiles(np.asarray(data, np.float32)).transpose(0, 2, 1)))
    if fmt in ("f16", "bf16"):
        return (fmt, np.ascontiguousarray(_tiles(np.asarray(data).view(np.uint16)).transpose(0, 2, 1)))
    raise ValueError(f"no CPU kernel for weight format {fmt!r}")
