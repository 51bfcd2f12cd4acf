"""Non-matmul ops of the forward pass as numba kernels for the CPU (layouts: tests/reference.py)."""
from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True, fastmath=True)
def rmsnorm(x, w, eps, out):
    """out[t] = x[t] / rms(x[t]) * w."""
    d = x.shape[1]
    for t in range(x.shape[0]):
        ss = np.float32(0.0)
        for i in range(d):
            ss += x[t, i] * x[t, i]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + np.float32(eps))
        for i in range(d):
            out[t, i] = x[t, i] * inv * w[i]


@njit(cache=True, fastmath=True, inline="always")
def _rotate(v, off, cos, sin, p, half):
    """Rotate-half RoPE of v[off : off + 2*half] at table row p, in place."""
    for i in range(half):
        a = v[off + i]
        b = v[off + half + i]
        c = cos[p, i]
        s = sin[p, i]
        v[off + i] = a * c - b * s
        v[off + half + i] = b * c + a * s


@njit(cache=True, fastmath=True)
def rope_store_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads):
    """Rotate q in place inside qkv; rotate k and write k, v into the paged cache at each token's slot."""
    bs = k_cache.shape[1]
    dh = k_cache.shape[3]
    half = dh // 2
    q_size = num_heads * dh
    kv_size = num_kv_heads * dh
    for t in range(qkv.shape[0]):
        p = positions[t]
        row = qkv[t]
        for h in range(num_heads):
            _rotate(row, h * dh, cos, sin, p, half)
        for h in range(num_kv_heads):
            _rotate(row, q_size + h * dh, cos, sin, p, half)
        slot = slot_mapping[t]
        blk, off = slot // bs, slot % bs
        for h in range(num_kv_heads):
            for i in range(dh):
                k_cache[blk, off, h, i] = row[q_size + h * dh + i]
                v_cache[blk, off, h, i] = row[q_size + kv_size + h * dh + i]


@njit(cache=True, parallel=True, fastmath=True)
def paged_attention(qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads, scale, out):
    """Causal attention over the paged cache: query token t of sequence token_seq[t] at positions[t]
    attends to that sequence's positions 0..positions[t], found through its block table."""
    bs = k_cache.shape[1]
    dh = k_cache.shape[3]
    group = num_heads // num_kv_heads
    ntok = qkv.shape[0]
    for item in prange(ntok * num_heads):
        t = item // num_heads
        h = item % num_heads
        kvh = h // group
        s = token_seq[t]
        n = positions[t] + 1
        q0 = h * dh
        scores = np.empty(n, np.float32)
        mx = -np.inf
        for j in range(n):
            blk = block_tables[s, j // bs]
            off = j % bs
            acc = np.float32(0.0)
            for i in range(dh):
                acc += qkv[t, q0 + i] * k_cache[blk, off, kvh, i]
            acc *= scale
            scores[j] = acc
            if acc > mx:
                mx = acc
        total = np.float32(0.0)
        for j in range(n):
            e = np.exp(scores[j] - mx)
            scores[j] = e
            total += e
        o = np.zeros(dh, np.float32)
        for j in range(n):
            blk = block_tables[s, j // bs]
            off = j % bs
            pj = scores[j]
            for i in range(dh):
                o[i] += pj * v_cache[blk, off, kvh, i]
        inv = np.float32(1.0) / total
        for i in range(dh):
            out[t, q0 + i] = o[i] * inv


@njit(cache=True, fastmath=True)
def silu_mul(gate_up, out):
    """out = silu(gate) * up, with gate_up = [gate | up]."""
    f = out.shape[1]
    for t in range(gate_up.shape[0]):
        for i in range(f):
            g = gate_up[t, i]
            out[t, i] = g / (np.float32(1.0) + np.exp(-g)) * gate_up[t, f + i]


def rope_tables(max_position: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_position, head_dim/2] float32, computed in float64."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = np.arange(max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
