"""GGML's K-quants: super-blocks of 256 values in sub-blocks with integer scales under float16 super-scales.

Byte layouts (one super-block; llama.cpp's ggml-common.h, read the same way by gguf.quants):
  q4_k  144 B: f16 d, f16 dmin, 12 B of 6-bit scales sc[8] and mins m[8], 128 B of nibbles
               sub-block j (32 values) = d*sc[j] * q - dmin*m[j], q in 0..15
  q5_k  176 B: as q4_k plus 32 B of high bits (bit j of byte l is bit 4 of value l of sub-block j); q in 0..31
  q6_k  210 B: 128 B low nibbles, 64 B high 2-bit pairs, int8 scales sc[16], f16 d
               sub-block j (16 values) = d*sc[j] * (q - 32), q in 0..63
Nibbles of q4_k / q5_k: sub-blocks 2i and 2i+1 are the low and high halves of bytes 32i .. 32i+31.
Nibbles of q6_k: value l of 32-chunk c (c = 4h + 2s + e) is nibble s of byte 64h + 32e + l, its high
pair bits 2(c%4).. of byte 32h + l.

`unpack` gives exact integer fields; `pack` writes them; `quantize` picks fields for a float matrix
(min/max per sub-block, then the 6- or 8-bit scales: simpler than llama.cpp's search, valid blocks).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256
SUPER_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}
CODE_BITS = {"q4_k": 4, "q5_k": 5, "q6_k": 6}
SUB = {"q4_k": 32, "q5_k": 32, "q6_k": 16}   # values per sub-block


@dataclass
class KFields:
    """The integer fields of n super-blocks: w = d * sc * q - dmin * m per sub-block (q6_k: dmin = 0,
    m = 32 * sc, i.e. w = d * sc * (q - 32))."""
    d: np.ndarray      # float32 [n] (float16 values)
    dmin: np.ndarray   # float32 [n] (zero for q6_k)
    sc: np.ndarray     # int32 [n, subs]: q4_k/q5_k 0..63, q6_k -128..127
    m: np.ndarray      # int32 [n, subs]: q4_k/q5_k 0..63; q6_k unused (zeros)
    q: np.ndarray      # uint8 [n, 256] codes in value order

    def scales(self, fmt: str) -> tuple[np.ndarray, np.ndarray]:
        """(scale, offset) float32 [n, subs], exact (a float16 times a small integer): w = scale * q + offset."""
        scale = self.d[:, None] * self.sc.astype(np.float32)
        if fmt == "q6_k":
            return scale, scale * np.float32(-32.0)
        return scale, -(self.dmin[:, None] * self.m.astype(np.float32))


def _f16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16)


def _split_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 packed bytes [n, 12] -> 6-bit scales and mins [n, 8]."""
    b = b.astype(np.int32)
    lo, mid, hi = b[:, 0:4], b[:, 4:8], b[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 2) & 48)], axis=1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 2) & 48)], axis=1)
    return sc, m


def _join_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    sc, m = sc.astype(np.int32), m.astype(np.int32)
    lo = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return np.concatenate([lo, mid, hi], axis=1).astype(np.uint8)


def _nibbles_k(qs: np.ndarray) -> np.ndarray:
    """q4_k/q5_k nibble bytes [n, 128] -> low 4 bits of the 256 values."""
    n = qs.shape[0]
    q = qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & 15).reshape(n, QK_K)


def unpack(fmt: str, blocks: np.ndarray) -> KFields:
    """Super-blocks uint8 [n, SUPER_BYTES] -> their fields."""
    n = blocks.shape[0]
    blocks = np.ascontiguousarray(blocks)
    if fmt == "q6_k":
        ql, qh, sc, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], blocks[:, 208:210]
        lo = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
        hi = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        q = lo.reshape(n, QK_K) | (hi.reshape(n, QK_K) << 4)
        d = d.copy().view(np.float16)[:, 0].astype(np.float32)
        return KFields(d, np.zeros(n, np.float32), sc.copy().view(np.int8).astype(np.int32),
                       np.zeros((n, 16), np.int32), q.astype(np.uint8))
    d = blocks[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float32)
    sc, m = _split_scales(blocks[:, 4:16])
    if fmt == "q4_k":
        q = _nibbles_k(blocks[:, 16:144])
    else:
        qh = blocks[:, 16:48]
        high = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        q = _nibbles_k(blocks[:, 48:176]) | (high.reshape(n, QK_K) << 4)
    return KFields(d, dmin, sc, m, q.astype(np.uint8))


def pack(fmt: str, f: KFields) -> np.ndarray:
    """Fields -> super-blocks uint8 [n, SUPER_BYTES] (the inverse of unpack)."""
    n = f.q.shape[0]
    q = f.q.astype(np.uint8)
    if fmt == "q6_k":
        lo = (q & 15).reshape(n, 2, 2, 64)
        ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(n, 128)
        hi = (q >> 4).reshape(n, 2, 4, 32)
        qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
        sc = f.sc.astype(np.int8).view(np.uint8)
        return np.concatenate([ql, qh, sc, _f16(f.d).reshape(n, 1).view(np.uint8)], axis=1)
    lo = (q & 15).reshape(n, 4, 2, 32)
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(n, 128)
    head = [_f16(f.d).reshape(n, 1).view(np.uint8), _f16(f.dmin).reshape(n, 1).view(np.uint8),
            _join_scales(f.sc, f.m)]
    if fmt == "q4_k":
        return np.concatenate(head + [qs], axis=1)
    bits = ((q >> 4) & 1).reshape(n, 8, 32) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    qh = np.bitwise_or.reduce(bits, axis=1).astype(np.uint8)
    return np.concatenate(head + [qh, qs], axis=1)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1), 0).astype(np.float32)


def quantize(fmt: str, w: np.ndarray) -> np.ndarray:
    """A float matrix [N, K] (K a multiple of 256) -> uint8 [N, K / 256 * SUPER_BYTES]."""
    rows = w.shape[0]
    x = np.asarray(w, np.float32).reshape(-1, QK_K // SUB[fmt], SUB[fmt])
    top = (1 << CODE_BITS[fmt]) - 1
    if fmt == "q6_k":
        amax = np.abs(x).max(axis=2)
        s = amax / np.float32(31.5)
        d = _f16(s.max(axis=1) / 127).astype(np.float32)
        sc = np.clip(np.rint(_ratio(s, d[:, None])), -128, 127)
        q = np.rint(_ratio(x, (d[:, None] * sc)[..., None]) + 32)
        fields = KFields(d, np.zeros_like(d), sc.astype(np.int32), np.zeros_like(sc, np.int32),
                         np.clip(q, 0, top).astype(np.uint8).reshape(-1, QK_K))
    else:
        lo = np.minimum(x.min(axis=2), 0)
        s = (x.max(axis=2) - lo) / np.float32(top)
        d = _f16(s.max(axis=1) / 63).astype(np.float32)
        dmin = _f16(-lo.min(axis=1) / 63).astype(np.float32)
        sc = np.clip(np.rint(_ratio(s, d[:, None])), 0, 63)
        m = np.clip(np.rint(_ratio(-lo, dmin[:, None])), 0, 63)
        q = np.rint(_ratio(x + (dmin[:, None] * m)[..., None], (d[:, None] * sc)[..., None]))
        fields = KFields(d, dmin, sc.astype(np.int32), m.astype(np.int32),
                         np.clip(q, 0, top).astype(np.uint8).reshape(-1, QK_K))
    return pack(fmt, fields).reshape(rows, -1)
