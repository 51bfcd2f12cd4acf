"""Every decoder layer of a step in one kernel call, for models whose layers share one weight layout.

The forward pass calls five kernels per layer (models/llama.py), and from Python each call costs
interpreter and dispatch time on top of the kernel's own launch. Here one @njit function runs the same
kernels, in the same order, on the same arrays: the logits are the same bit for bit, and the per-call
cost is the launch alone.

It needs each slot (q|k|v, o, gate|up, down) to be one q4/q5/q8 matrix of the same shape in every
layer, multiplied on int8 activations (the same number of passes everywhere), so that the slot's
matrices stack into one array (`LayerStack`): a numba function takes a few arrays cheaply, not
tuples of hundreds.
"""
from __future__ import annotations

import warnings

import numpy as np
from numba import get_num_threads, njit, prange
from numba.core.errors import NumbaPerformanceWarning

from engine.backends import cpu_claims, cpu_int8, cpu_matmul, cpu_simd, cpu_transforms
from engine.backends import cpu_attention as attention
from engine.backends.cpu_cache import flush_stale_caches
from engine.backends.cpu_claims import phase_counters
from engine.backends.cpu_matmul import matmul_i8_claimed, matmul_q4_i8, matmul_q5_i8, matmul_q8_i8
from engine.backends.cpu_transforms import X_PLAIN, X_RMSNORM, X_SILU_MUL


# parallel=True below although these functions have no parallel loop of their own: they call parallel
# kernels, and a cached non-parallel caller of parallel kernels segfaults when it is loaded from numba's
# cache (numba issues #4807, #8578); as parallel functions they load fine. numba warns that it found
# nothing to parallelize; that is expected here.
warnings.filterwarnings("ignore", message=r"(?s).*'parallel=True' was specified but no transformation.*cpu_layers\.py",
                        category=NumbaPerformanceWarning)


@njit(cache=True, parallel=True)
def _linear(x, qs, sc, out, n_out, accumulate, passes, kind, aux, eps):
    if qs.shape[2] == 4:   # 4 lanes of bytes per 32-block: q4; 5: q5; 8: q8
        matmul_q4_i8(x, qs, sc, out, 0, n_out, accumulate, passes, kind, aux, eps)
    elif qs.shape[2] == 5:
        matmul_q5_i8(x, qs, sc, out, 0, n_out, accumulate, passes, kind, aux, eps)
    else:
        matmul_q8_i8(x, qs, sc, out, 0, n_out, accumulate, passes, kind, aux, eps)


@njit(cache=True, parallel=True)
def run_layers(h, qkv, attn, gate_up, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables, token_seq,
               num_heads, num_kv_heads, scale, eps, passes, rows, attn_norm, ffn_norm,
               qkv_qs, qkv_sc, o_qs, o_sc, gu_qs, gu_sc, down_qs, down_sc, warm_a, warm_b):
    """The layer loop of LlamaModel.forward: h (the residual stream) in and out, K/V written into the
    caches [layer, ...]. rows: the output sizes of the four slots; *_qs, *_sc: each slot's matrices
    stacked over the layers; warm_a, warm_b: [layer] bytes of o (rope_attention warms them).
    It keeps the GIL for the step: released, the node's other Python threads (token streams, request
    parsing) ran during the step and took the cores from the kernels' threads; they run between steps."""
    no_aux = attn_norm[0, :1]   # the aux argument of a product without a fused transform (unused)
    for i in range(attn_norm.shape[0]):
        _linear(h, qkv_qs[i], qkv_sc[i], qkv, rows[0], False, passes, X_RMSNORM, attn_norm[i], eps)
        attention.rope_attention(qkv, positions, cos, sin, k_cache[i], v_cache[i], slot_mapping, block_tables,
                                 token_seq, num_heads, num_kv_heads, scale, attn, warm_a[i], warm_b[i], np.int64(0))
        _linear(attn, o_qs[i], o_sc[i], h, rows[1], True, passes, X_PLAIN, no_aux, eps)
        _linear(h, gu_qs[i], gu_sc[i], gate_up, rows[2], False, passes, X_RMSNORM, ffn_norm[i], eps)
        _linear(gate_up, down_qs[i], down_sc[i], h, rows[3], True, passes, X_SILU_MUL, no_aux, eps)


_PHASES = 7   # a layer's phases there: q|k|v, rope and cache write, attention, its parts combined, o, gate|up, down


@njit(cache=True, parallel=True)
def run_layers_claimed(h, qkv, attn, gate_up, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables,
                       token_seq, num_heads, num_kv_heads, scale, eps, passes, rows, attn_norm, ffn_norm,
                       qkv_qs, qkv_sc, o_qs, o_sc, gu_qs, gu_sc, down_qs, down_sc, warm_a, warm_b, partial, counters,
                       threads):
    """run_layers in one parallel region: `threads` workers go through every layer's products and attention
    as phases (cpu_claims), each taking the items it claims; the same kernels on the same items, so the
    same results bit for bit, without a fork and join per product."""
    no_aux = attn_norm[0, :1]
    for w in prange(threads):
        for i in range(attn_norm.shape[0]):
            p = i * _PHASES
            matmul_i8_claimed(h, qkv_qs[i], qkv_sc[i], qkv, rows[0], False, passes, X_RMSNORM, attn_norm[i], eps,
                              counters, p, threads)
            attention.rope_attention_claimed(qkv, positions, cos, sin, k_cache[i], v_cache[i], slot_mapping,
                                             block_tables, token_seq, num_heads, num_kv_heads, scale, attn, warm_a[i],
                                             warm_b[i], np.int64(0), partial, counters, p + 1)
            matmul_i8_claimed(attn, o_qs[i], o_sc[i], h, rows[1], True, passes, X_PLAIN, no_aux, eps,
                              counters, p + 4, threads)
            matmul_i8_claimed(h, gu_qs[i], gu_sc[i], gate_up, rows[2], False, passes, X_RMSNORM, ffn_norm[i], eps,
                              counters, p + 5, threads)
            matmul_i8_claimed(gate_up, down_qs[i], down_sc[i], h, rows[3], True, passes, X_SILU_MUL, no_aux, eps,
                              counters, p + 6, threads)


class LayerStack:
    """The layers' matrices stacked per slot (one array each for qs and for scales, [layer, ...]);
    each layer's CpuLinear then reads its own slice of them, so the weights are held once."""

    SLOTS = ("qkv", "o", "gate_up", "down")

    def __init__(self, layers):
        n = len(layers)
        self.passes = layers[0].qkv.passes
        self.rows = np.array([getattr(layers[0], s).parts[0].rows for s in self.SLOTS], np.int64)
        self.attn_norm = np.ascontiguousarray(np.stack([ly.attn_norm for ly in layers]), np.float32)
        self.ffn_norm = np.ascontiguousarray(np.stack([ly.ffn_norm for ly in layers]), np.float32)
        self.arrays = {}
        for s in self.SLOTS:
            lins = [getattr(ly, s) for ly in layers]
            qs = np.stack([lin.parts[0].arrays[0] for lin in lins])
            sc = np.stack([lin.parts[0].arrays[1] for lin in lins])
            for i, lin in enumerate(lins):   # the layers' own linears now read the stacked copy
                lin.use_arrays((qs[i], sc[i]))
            self.arrays[s] = (qs, sc)
        # o's bytes per layer, which rope_attention reads into the caches ahead of the o product
        self.o_warm = tuple(a.reshape(n, -1).view(np.uint8) for a in self.arrays["o"])

    @classmethod
    def of(cls, layers) -> "LayerStack | None":
        """A stack of these layers (CpuLinear slots), or None where their layouts differ."""
        if not layers:
            return None
        first = layers[0]
        for s in cls.SLOTS:
            ref = getattr(first, s)
            for ly in layers:
                lin = getattr(ly, s)
                if len(lin.parts) != 1 or lin.parts[0].family not in ("q4", "q5", "q8") or not lin.int8 \
                        or lin.passes != first.qkv.passes or lin.parts[0].rows != ref.parts[0].rows \
                        or any(a.shape != b.shape or a.dtype != b.dtype
                               for a, b in zip(lin.parts[0].arrays, ref.parts[0].arrays)):
                    return None
        return cls(layers)

    def run(self, h, qkv, attn, gate_up, step, k_cache, v_cache, cos, sin, num_heads, num_kv_heads, scale, eps):
        a = self.arrays
        args = (h, qkv, attn, gate_up, step.positions, cos, sin, k_cache, v_cache, step.slot_mapping,
                step.block_tables, step.token_seq, num_heads, num_kv_heads, np.float32(scale), float(eps),
                self.passes, self.rows, self.attn_norm, self.ffn_norm, a["qkv"][0], a["qkv"][1], a["o"][0],
                a["o"][1], a["gate_up"][0], a["gate_up"][1], a["down"][0], a["down"][1], *self.o_warm)
        if h.shape[0] <= cpu_claims.CLAIMED_MAX_ROWS:
            threads = get_num_threads()
            partial = attention.split_scratch(step.positions, num_heads, k_cache.shape[-1])
            run_layers_claimed(*args, partial, phase_counters(_PHASES * len(self.attn_norm)), threads)
        else:
            run_layers(*args)


flush_stale_caches(globals(), "cpu_layers", cpu_simd.__file__, cpu_int8.__file__, cpu_transforms.__file__,
                   cpu_matmul.__file__, attention.__file__, cpu_claims.__file__)
