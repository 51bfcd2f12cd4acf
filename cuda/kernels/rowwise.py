"""Row-wise and elementwise ops: embedding gather, RMSNorm, RoPE + KV-cache write, SwiGLU, row gather, and
Gemma 3's: a scale, RMSNorm per q/k head, an RMSNorm'd branch added to the residual, GELU-tanh gating.

Launch: one block per token row (grid = T) unless noted, any power-of-two block size <= 1024; threads stride
over the row's features. Layouts: tests/reference.py.
"""
from __future__ import annotations

import functools
import math

from numba import cuda, float32

from cuda.kernels.common import F0, F1, LOADERS, MAX_BLOCK, block_sum, inv_rms, silu

GELU_C = math.sqrt(2.0 / math.pi)


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


@cuda.jit(device=True, fastmath=True)
def row_inv_rms(x, t, c0, d, eps, buf):
    """inv_rms of x[t, c0:c0+d], to every thread of the block (buf: shared scratch)."""
    ss = F0
    for i in range(cuda.threadIdx.x, d, cuda.blockDim.x):
        v = x[t, c0 + i]
        ss += v * v
    ss = block_sum(ss, buf)   # every thread has read its values before any writes after this
    return inv_rms(ss, d, eps)


@cuda.jit(fastmath=True)
def rmsnorm(x, w, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w; grid = T. out may alias x."""
    buf = cuda.shared.array(MAX_BLOCK, float32)
    t = cuda.blockIdx.x
    d = x.shape[1]
    inv = row_inv_rms(x, t, 0, d, eps, buf)
    for i in range(cuda.threadIdx.x, d, cuda.blockDim.x):
        out[t, i] = x[t, i] * inv * w[i]


@cuda.jit(device=True, fastmath=True)
def rotate(a, b, c, s):
    """RoPE of one (i, i + Dh/2) pair: (a c - b s, b c + a s)."""
    return a * c - b * s, b * c + a * s


@cuda.jit(device=True, fastmath=True)
def rope_store_unit(t, u, qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, num_heads, num_kv_heads):
    """Unit u of token t: u < (H + Hkv) * Dh/2 a (i, i + Dh/2) pair of q or k rotated in place (rotate-half
    RoPE at positions[t]), k also written into the paged cache at slot_mapping[t]; past them element
    u - pairs of v written into the cache. Units touch disjoint elements: no synchronisation."""
    bs = k_cache.shape[1]
    dh = k_cache.shape[3]
    half = dh >> 1
    npairs = (num_heads + num_kv_heads) * half
    slot = slot_mapping[t]
    blk = slot // bs
    off = slot - blk * bs
    if u < npairs:
        hh = u // half  # q heads 0..H-1, then k heads H..H+Hkv-1 (contiguous in qkv)
        i = u - hh * half
        col = hh * dh + i
        p = positions[t]
        ra, rb = rotate(qkv[t, col], qkv[t, col + half], cos[p, i], sin[p, i])
        qkv[t, col] = ra
        qkv[t, col + half] = rb
        if hh >= num_heads and slot >= 0:
            k_cache[blk, off, hh - num_heads, i] = ra
            k_cache[blk, off, hh - num_heads, i + half] = rb
    elif slot >= 0:
        e = u - npairs
        h = e // dh
        v_cache[blk, off, h, e - h * dh] = qkv[t, (num_heads + num_kv_heads) * dh + e]


@cuda.jit(fastmath=True)
def rope_store_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads):
    """rope_store_unit over every unit of token t = blockIdx.x; grid = T."""
    t = cuda.blockIdx.x
    units = (num_heads + 3 * num_kv_heads) * (k_cache.shape[3] >> 1)  # pairs of q and k, then v elements
    for u in range(cuda.threadIdx.x, units, cuda.blockDim.x):
        rope_store_unit(t, u, qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, num_heads, num_kv_heads)


@cuda.jit(device=True, fastmath=True)
def gelu_tanh(g):
    inner = float32(GELU_C) * (g + float32(0.044715) * g * g * g)
    return float32(0.5) * g * (F1 + math.tanh(inner))


@functools.lru_cache(maxsize=None)
def gated(activation: str):
    """out = activation(gate) * up with gate_up = [gate | up] (SwiGLU: silu, GeGLU: gelu_tanh); a
    grid-stride loop over T * F."""
    rows = gated_rows(activation)

    @cuda.jit(fastmath=True)
    def gated_kernel(gate_up, out):
        rows(gate_up, out, out.shape[0])
    return gated_kernel


@functools.lru_cache(maxsize=None)
def gated_rows(activation: str):
    """out[t] = activation(gate) * up for t < ntok, a grid-stride loop over ntok * F (any grid): the per-op
    kernel's body and the tiled decode step's SILU phase."""
    act = {"silu": silu, "gelu_tanh": gelu_tanh}[activation]

    @cuda.jit(device=True, fastmath=True)
    def rows(gate_up, out, ntok):
        f = out.shape[1]
        for e in range(cuda.grid(1), ntok * f, cuda.gridsize(1)):
            t = e // f
            i = e - t * f
            out[t, i] = act(gate_up[t, i]) * gate_up[t, f + i]
    return rows


silu_mul = gated("silu")
gelu_mul = gated("gelu_tanh")


@cuda.jit(fastmath=True)
def gather_rows(src, index, out):
    """out[r] = src[index[r]]; grid = len(index)."""
    r = cuda.blockIdx.x
    row = index[r]
    for k in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        out[r, k] = src[row, k]


@cuda.jit(fastmath=True)
def scale_rows(x, factor):
    """x *= factor; grid = T."""
    t = cuda.blockIdx.x
    for i in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
        x[t, i] *= factor


@cuda.jit(fastmath=True)
def head_rmsnorm(qkv, q_w, k_w, num_heads, num_kv_heads, eps):
    """Each q head of qkv[t] = rmsnorm(head) * q_w, each k head * k_w, in place; grid = (T, H + Hkv)."""
    buf = cuda.shared.array(MAX_BLOCK, float32)
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    dh = q_w.shape[0]
    inv = row_inv_rms(qkv, t, h * dh, dh, eps, buf)
    for i in range(cuda.threadIdx.x, dh, cuda.blockDim.x):
        w = q_w[i] if h < num_heads else k_w[i]
        qkv[t, h * dh + i] = qkv[t, h * dh + i] * inv * w


@cuda.jit(fastmath=True)
def rmsnorm_add(x, w, eps, out):
    """out[t] += x[t] / sqrt(mean(x[t]^2) + eps) * w; grid = T."""
    buf = cuda.shared.array(MAX_BLOCK, float32)
    t = cuda.blockIdx.x
    d = x.shape[1]
    inv = row_inv_rms(x, t, 0, d, eps, buf)
    for i in range(cuda.threadIdx.x, d, cuda.blockDim.x):
        out[t, i] += x[t, i] * inv * w[i]
