"""Norms and activations of the forward pass as numba kernels for the CPU (layouts: tests/reference.py):
RMSNorm of the residual stream, SwiGLU and GELU-tanh gating, and what Gemma 3 adds (RMSNorm of each q and k
head inside qkv, an RMSNorm'd branch added into the residual stream, a scale of the activations). Serial: a
few thousand values a token, less than a parallel region's start-up costs."""
from __future__ import annotations

from numba import njit

from engine.backends import cpu_simd, cpu_transforms
from engine.backends.cpu_cache import flush_stale_caches
from engine.backends.cpu_simd import U, addr


@njit(cache=True, nogil=True, fastmath=True)
def head_rmsnorm(qkv, q_w, k_w, num_heads, num_kv_heads, eps):
    """In place: each q head of qkv = rmsnorm(head) * q_w, each k head = rmsnorm(head) * k_w (v untouched)."""
    dh = q_w.shape[0]
    ld = U(qkv.shape[1])
    heads = num_heads + num_kv_heads
    for item in range(qkv.shape[0] * heads):
        t, h = item // heads, item % heads
        off = U(t) * ld + U(h * dh)
        w = addr(q_w) if h < num_heads else addr(k_w)
        cpu_transforms.rmsnorm_row(addr(qkv), off, w, dh, eps, addr(qkv), off)


@njit(cache=True, nogil=True, fastmath=True)
def rmsnorm_add(x, w, eps, out):
    """out[t] += rmsnorm(x[t]) * w (x is scratch: it is normalized in place first)."""
    d = x.shape[1]
    for t in range(x.shape[0]):
        cpu_transforms.rmsnorm_row(addr(x), U(t) * U(d), addr(w), d, eps, addr(x), U(t) * U(d))
        for i in range(d):
            out[t, i] += x[t, i]


@njit(cache=True, nogil=True, fastmath=True)
def gelu_mul(gate_up, out):
    """out = gelu_tanh(gate) * up, with gate_up = [gate | up]."""
    f = out.shape[1]
    for t in range(gate_up.shape[0]):
        cpu_transforms.gelu_mul_row(addr(gate_up), U(t) * U(2 * f), f, addr(out), U(t) * U(f))


@njit(cache=True, nogil=True, fastmath=True)
def scale(x, factor):
    """x *= factor, in place."""
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] *= factor


@njit(cache=True, nogil=True, fastmath=True)
def rmsnorm(x, w, eps, out):
    """out[t] = x[t] / rms(x[t]) * w."""
    d = x.shape[1]
    for t in range(x.shape[0]):
        cpu_transforms.rmsnorm_row(addr(x), U(t) * U(d), addr(w), d, eps, addr(out), U(t) * U(d))


@njit(cache=True, nogil=True, fastmath=True)
def silu_mul(gate_up, out):
    """out = silu(gate) * up, with gate_up = [gate | up]."""
    f = out.shape[1]
    for t in range(gate_up.shape[0]):
        cpu_transforms.silu_mul_row(addr(gate_up), U(t) * U(2 * f), f, addr(out), U(t) * U(f))


flush_stale_caches(globals(), "cpu_norm_act", cpu_simd.__file__, cpu_transforms.__file__)
