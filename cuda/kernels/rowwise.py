"""Row-wise and elementwise ops: embedding gather, RMSNorm, RoPE + KV-cache write, SwiGLU, row gather.

Launch: one block per token row (grid = T) unless noted, any power-of-two block size <= 1024; threads stride
over the row's features. Layouts: tests/reference.py.
"""
from __future__ import annotations

import functools

from numba import cuda, float32

from cuda.kernels.common import F0, LOADERS, MAX_BLOCK, block_sum, inv_rms, silu


@functools.lru_cache(maxsize=None)
def embedding(family: str):
    """The embedding gather for one weight family (q4, q8, f16, bf16, f32)."""
    load = LOADERS[family]

    @cuda.jit(fastmath=True)
    def embedding_kernel(tokens, wa, wb, wc, out):
        """out[t] = W[tokens[t]] dequantized; grid = T."""
        t = cuda.blockIdx.x
        row = tokens[t]
        for k in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
            out[t, k] = load(wa, wb, wc, row, k)

    return embedding_kernel


@cuda.jit(fastmath=True)
def rmsnorm(x, w, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w; grid = T. out may alias x."""
    buf = cuda.shared.array(MAX_BLOCK, float32)
    t = cuda.blockIdx.x
    d = x.shape[1]
    ss = F0
    for i in range(cuda.threadIdx.x, d, cuda.blockDim.x):
        v = x[t, i]
        ss += v * v
    ss = block_sum(ss, buf)
    inv = inv_rms(ss, d, eps)
    for i in range(cuda.threadIdx.x, d, cuda.blockDim.x):
        out[t, i] = x[t, i] * inv * w[i]


@cuda.jit(device=True, fastmath=True)
def rotate(a, b, c, s):
    """RoPE of one (i, i + Dh/2) pair: (a c - b s, b c + a s)."""
    return a * c - b * s, b * c + a * s


@cuda.jit(fastmath=True)
def rope_store_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads):
    """Rotate q and k of token t in place (rotate-half RoPE at positions[t]) and write its k, v into the paged
    cache at slot_mapping[t]; grid = T. Each thread owns whole (i, i + Dh/2) pairs: no synchronisation."""
    t = cuda.blockIdx.x
    p = positions[t]
    bs = k_cache.shape[1]
    dh = k_cache.shape[3]
    half = dh >> 1
    slot = slot_mapping[t]
    blk = slot // bs
    off = slot - blk * bs
    for e in range(cuda.threadIdx.x, (num_heads + num_kv_heads) * half, cuda.blockDim.x):
        hh = e // half  # q heads 0..H-1, then k heads H..H+Hkv-1 (contiguous in qkv)
        i = e - hh * half
        col = hh * dh + i
        a = qkv[t, col]
        b = qkv[t, col + half]
        ra, rb = rotate(a, b, cos[p, i], sin[p, i])
        qkv[t, col] = ra
        qkv[t, col + half] = rb
        if hh >= num_heads and slot >= 0:
            k_cache[blk, off, hh - num_heads, i] = ra
            k_cache[blk, off, hh - num_heads, i + half] = rb
    v0 = (num_heads + num_kv_heads) * dh
    if slot >= 0:
        for e in range(cuda.threadIdx.x, num_kv_heads * dh, cuda.blockDim.x):
            h = e // dh
            v_cache[blk, off, h, e - h * dh] = qkv[t, v0 + e]


@cuda.jit(fastmath=True)
def silu_mul(gate_up, out):
    """out = silu(gate) * up with gate_up = [gate | up]; a grid-stride loop over T * F."""
    f = out.shape[1]
    n = out.shape[0] * f
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for e in range(start, n, stride):
        t = e // f
        i = e - t * f
        out[t, i] = silu(gate_up[t, i]) * gate_up[t, f + i]


@cuda.jit(fastmath=True)
def gather_rows(src, index, out):
    """out[r] = src[index[r]]; grid = len(index)."""
    r = cuda.blockIdx.x
    row = index[r]
    for k in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        out[r, k] = src[row, k]
