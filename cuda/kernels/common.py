"""Shared pieces of the kernels: float32 constants, block reductions, weight element loaders.

Every constant a kernel uses is a float32 (a bare `0.0` literal would make the arithmetic float64), and every
reduction goes through shared memory and `syncthreads` (the CUDA simulator has no warp shuffles), so the code
that the simulator tests is the code that runs on the GPU.

Weight layouts on the device (repacked once when the backend uploads a matrix, see cuda/backend.py):
  q4    qs uint32 [N, K/8] (GGML's 16 nibble bytes of a block as 4 words), d, m float16 [N, K/32]: w = d*q + m
        (q4_0 is stored in this form with m = -8 d)
  q4k   q4 with float32 d, m (q4_k: d*sc and -dmin*m per 32 values, exact in float32, not in float16)
  q8    qs uint32 [N, K/4] (4 int8 a word, little-endian), d float16 [N, K/32], m unused: w = d*q
        (q8_0; q5_0 as q - 16)
  q8m   q8 with float32 d, m [N, K/32]: w = d*q + m (q5_1, q5_k: q the 5-bit code)
  q8h   q8 with float32 d [N, K/16], m unused: a scale per 16 values (q6_k, q - 32)
  f16 / bf16 (uint16 bits) / f32   w [N, K]
"""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import cuda, float32, int32

SIMULATOR = bool(numba.config.ENABLE_CUDASIM)

F0 = np.float32(0.0)
F1 = np.float32(1.0)
NEG = np.float32(-3.0e38)        # "minus infinity" that stays finite (exp(NEG - x) == 0, NEG - NEG == 0)
NEG_HALF = np.float32(-1.0e38)   # scores at or below this are masked
MAX_BLOCK = 1024                 # largest block any kernel is launched with (reduction buffers)


if SIMULATOR:
    def bf16_to_f32(u):
        """bfloat16 bits (uint16) -> float32 (the simulator's stand-in for int_as_float)."""
        return np.array([int(u) << 16], np.uint32).view(np.float32)[0]
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def bf16_to_f32(u):
        """bfloat16 bits (uint16) -> float32: the bits are the high half of a float32."""
        return libdevice.int_as_float(int32(u) << 16)


@cuda.jit(device=True)
def block_sum(v, buf):
    """Sum of v over the block, returned to every thread; blockDim.x a power of two <= len(buf)."""
    tid = cuda.threadIdx.x
    buf[tid] = v
    cuda.syncthreads()  # all partials written
    s = cuda.blockDim.x >> 1
    while s > 0:
        if tid < s:
            buf[tid] += buf[tid + s]
        cuda.syncthreads()  # this level done before the next reads it
        s >>= 1
    r = buf[0]
    cuda.syncthreads()  # everyone has read buf[0] before buf is reused
    return r


@cuda.jit(device=True)
def block_max(v, buf):
    """Maximum of v over the block, returned to every thread; blockDim.x a power of two <= len(buf)."""
    tid = cuda.threadIdx.x
    buf[tid] = v
    cuda.syncthreads()  # all partials written
    s = cuda.blockDim.x >> 1
    while s > 0:
        if tid < s:
            if buf[tid + s] > buf[tid]:
                buf[tid] = buf[tid + s]
        cuda.syncthreads()  # this level done before the next reads it
        s >>= 1
    r = buf[0]
    cuda.syncthreads()  # everyone has read buf[0] before buf is reused
    return r


@cuda.jit(device=True)
def block_argmax(v, i, vbuf, ibuf):
    """(max v, its smallest index i) over the block, returned to every thread."""
    tid = cuda.threadIdx.x
    vbuf[tid] = v
    ibuf[tid] = i
    cuda.syncthreads()  # all candidates written
    s = cuda.blockDim.x >> 1
    while s > 0:
        if tid < s:
            a = vbuf[tid]
            b = vbuf[tid + s]
            if b > a or (b == a and ibuf[tid + s] < ibuf[tid]):
                vbuf[tid] = b
                ibuf[tid] = ibuf[tid + s]
        cuda.syncthreads()  # this level done before the next reads it
        s >>= 1
    rv = vbuf[0]
    ri = ibuf[0]
    cuda.syncthreads()  # everyone has read the result before the buffers are reused
    return rv, ri


# --- weight element loaders: w[n, k] as float32 from (wa, wb, wc) in each device layout -------------------

@cuda.jit(device=True)
def load_q4(qs, d, m, n, k):
    """Q4 element: nibble j of block b is the low half of byte j (j < 16) or the high half of byte j - 16."""
    b = k >> 5
    j = k & 31
    word = qs[n, (b << 2) + ((j & 15) >> 2)]
    q = (word >> (((j & 3) << 3) + ((j >> 4) << 2))) & 15
    return float32(d[n, b]) * float32(q) + float32(m[n, b])


def _q8_loader(group_shift: int, with_min: bool):
    """The q8-style element loader: a signed byte of word k/4, its scale per 2^group_shift values."""
    @cuda.jit(device=True)
    def load(qs, d, m, n, k):
        byte = (qs[n, k >> 2] >> ((k & 3) << 3)) & 255
        q = int32(byte) - ((int32(byte) & 128) << 1)
        w = float32(d[n, k >> group_shift]) * float32(q)
        if with_min:
            w += float32(m[n, k >> group_shift])
        return w
    return load


load_q8 = _q8_loader(5, False)
load_q8m = _q8_loader(5, True)
load_q8h = _q8_loader(4, False)


@cuda.jit(device=True)
def load_f16(w, b, c, n, k):
    return float32(w[n, k])


@cuda.jit(device=True)
def load_bf16(w, b, c, n, k):
    return bf16_to_f32(w[n, k])


@cuda.jit(device=True)
def load_f32(w, b, c, n, k):
    return w[n, k]


LOADERS = {"q4": load_q4, "q4k": load_q4, "q8": load_q8, "q8m": load_q8m, "q8h": load_q8h,
           "f16": load_f16, "bf16": load_bf16, "f32": load_f32}
FAMILIES = tuple(LOADERS)
# the q8-style families: (log2 of the values per scale, whether a min is added)
Q8_GROUPS = {"q8": (5, False), "q8m": (5, True), "q8h": (4, False)}


@cuda.jit(device=True)
def inv_rms(sum_sq, n, eps):
    """1 / sqrt(mean square + eps): RMSNorm's scale of a row of n values whose squares sum to sum_sq."""
    return F1 / math.sqrt(sum_sq / float32(n) + eps)


@cuda.jit(device=True)
def silu(g):
    return g / (F1 + math.exp(-g))
