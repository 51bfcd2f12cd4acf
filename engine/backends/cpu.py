"""The `cpu` backend: every op of the forward pass as a numba @njit kernel on host arrays."""
from __future__ import annotations

import numba
import numpy as np

from engine.backends import cpu_attention as attention
from engine.backends import cpu_dequant as dq
from engine.backends import cpu_matmul as mm
from engine.backends import cpu_norm_act as norm_act
from engine.backends.cpu_gemma3_layers import Gemma3LayerStack
from engine.backends.cpu_layers import LayerStack
from engine.backends.cpu_repack import QUANT_FAMILIES, TILE, repack
from engine.backends.cpu_sampler import sample
from engine.backends.cpu_isa import INT8_DEFAULT, log_level
from engine.backends.cpu_transforms import X_GELU_MUL, X_PLAIN, X_RMSNORM, X_SILU_MUL, transform
from engine.backends.sampling_batch import SampleResult, SamplingBatch
from engine.backends.stacked_linear import StackedLinear
from models.quant import QuantTensor
from models.rope import rope_tables

# From this many input rows on, a matrix would be dequantized and multiplied by numpy's BLAS instead of
# the tiled kernels: off, as the tiled kernels were faster at every size measured (docs/performance.md,
# "No BLAS path").
# CpuLinear.blas_min_rows turns it on per matrix.
BLAS_MIN_ROWS = 1 << 62


_NO_AUX = np.zeros(1, np.float32)  # the aux argument of a product without a fused transform


class _Scratch:
    """One float32 buffer shared by every linear layer of a backend (layers run one at a time)."""

    def __init__(self):
        self.buf = np.empty(0, np.float32)

    def get(self, k: int, n: int) -> np.ndarray:
        if self.buf.size < k * n:
            self.buf = np.empty(k * n, np.float32)
        return self.buf[:k * n].reshape(k, n)


class CpuLinear(StackedLinear):
    """y = x @ W.T for one or more stored matrices stacked along the output (e.g. q|k|v, gate|up).

    int8: quantize x to int8 for the q4/q8 kernels (default: where the CPU has a fast int8 dot, cpu_isa)."""

    def __init__(self, tensors: list[QuantTensor], int8: bool | None = None, scratch: _Scratch | None = None):
        super().__init__(tensors, _tiled_layout)
        self.nbytes = sum(a.nbytes for p in self.parts for a in p.arrays)
        self._set_warm()
        self.int8 = INT8_DEFAULT if int8 is None else bool(int8)
        self.passes = 2
        self._scratch = scratch or _Scratch()
        self.blas_min_rows = BLAS_MIN_ROWS

    def __call__(self, x: np.ndarray, out: np.ndarray, accumulate: bool = False, norm: np.ndarray | None = None,
                 eps: float = 1e-5, silu_mul: bool = False, gelu_mul: bool = False) -> None:
        """out (+)= f(x) @ W.T with f(x) = x, rmsnorm(x) * norm (norm given), silu(gate) * up (silu_mul)
        or gelu_tanh(gate) * up (gelu_mul; x = [gate | up]): the op before the product, fused into it."""
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        if norm is not None:
            kind, aux = X_RMSNORM, norm
        else:
            kind, aux = (X_SILU_MUL if silu_mul else X_GELU_MUL if gelu_mul else X_PLAIN), _NO_AUX
        eps = float(eps)
        if x.shape[0] >= self.blas_min_rows or len(self.parts) > 1 and kind != X_PLAIN:
            # one transform for every part (or for BLAS), then plain products
            if kind != X_PLAIN:
                x, kind, aux = transform(x, kind, aux, eps), X_PLAIN, _NO_AUX
            if x.shape[0] >= self.blas_min_rows:
                self._blas(x, out, accumulate)
                return
        if not out.flags.c_contiguous:
            tmp = np.ascontiguousarray(out) if accumulate else np.empty(out.shape, np.float32)
            self(x, tmp, accumulate)
            out[...] = tmp
            return
        for p in self.parts:
            a = p.arrays
            if p.family == "q4" and self.int8:
                mm.matmul_q4_i8(x, a[0], a[1], out, p.col0, p.rows, accumulate, self.passes, kind, aux, eps)
            elif p.family == "q5" and self.int8:
                mm.matmul_q5_i8(x, a[0], a[1], out, p.col0, p.rows, accumulate, self.passes, kind, aux, eps)
            elif p.family == "q8" and self.int8:
                mm.matmul_q8_i8(x, a[0], a[1], out, p.col0, p.rows, accumulate, self.passes, kind, aux, eps)
            elif p.family == "q8h" and self.int8:
                mm.matmul_q8h_i8(x, a[0], a[1], out, p.col0, p.rows, accumulate, self.passes, kind, aux, eps)
            elif p.family in QUANT_FAMILIES:
                dq.matmul_quant_exact(x, a[0], a[1], p.family == "q8h", out, p.col0, p.rows, accumulate, kind, aux,
                                      eps)
            else:
                mm.matmul_float(mm.FLOAT_KIND[p.family], x, a[0], out, p.col0, p.rows, accumulate, kind, aux, eps)

    def dequantize_t(self, wt: np.ndarray) -> None:
        """W.T as float32 [in, padded out] into wt (columns beyond out_features are padding)."""
        for p in self.parts:
            if p.family in QUANT_FAMILIES:
                dq.dequantize_quant_t(p.arrays[0], p.arrays[1], wt, p.col0, p.family == "q8h")
            else:
                dq.dequantize_float_t(mm.FLOAT_KIND[p.family], p.arrays[0], wt, p.col0)

    def dequantize_into(self, w: np.ndarray) -> None:
        """W as float32 [out, in]."""
        w[:] = self._dense_t()[:, :self.out_features].T

    def _dense_t(self) -> np.ndarray:
        # padded so that each part's tiles fit (parts start at multiples of 1, tiles write 16 columns)
        wt = self._scratch.get(self.in_features, self.out_features + TILE * len(self.parts))
        self.dequantize_t(wt)
        return wt

    def _blas(self, x, out, accumulate):
        wt = np.ascontiguousarray(self._dense_t()[:, :self.out_features])  # numpy's matmul is slow on views
        if accumulate:
            out += x @ wt
        else:
            np.matmul(x, wt, out=out)

    def use_arrays(self, arrays: tuple, part: int = 0) -> None:
        """Read a part's matrix from these arrays instead: the same data, stored elsewhere (a layer
        stack's slice)."""
        self.parts[part].arrays = arrays
        self._set_warm()

    def _set_warm(self) -> None:
        # the first part's bytes, for rope_attention to pull into the caches ahead of this product
        first = self.parts[0].arrays
        self.warm = (first[0].reshape(-1).view(np.uint8),
                     first[1].reshape(-1).view(np.uint8) if len(first) > 1 else attention.NOTHING_TO_WARM)

    def release_scratch(self) -> None:
        self._scratch.buf = np.empty(0, np.float32)

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """Rows of W as float32 (the embedding lookup of a tied or input embedding)."""
        rows = np.asarray(rows, np.int64)
        out = np.empty((len(rows), self.in_features), np.float32)
        for p in self.parts:
            sel = (rows >= p.col0) & (rows < p.col0 + p.rows)
            if not sel.any():
                continue
            r = rows[sel] - p.col0
            if p.family in QUANT_FAMILIES:
                tmp = np.empty((len(r), self.in_features), np.float32)
                dq.gather_quant(p.arrays[0], p.arrays[1], p.family == "q8h", r, tmp)
                out[sel] = tmp
            else:
                out[sel] = dq.gather_float(mm.FLOAT_KIND[p.family], p.arrays[0], r)
        return out


def _uses_blas(layers) -> bool:
    """Whether a layer's matrix goes to numpy's BLAS for large batches (blas_min_rows set on it)."""
    return any(getattr(ly, s).blas_min_rows != BLAS_MIN_ROWS for ly in layers for s in LayerStack.SLOTS)


def _tiled_layout(t: QuantTensor) -> tuple[str, tuple]:
    family, *arrays = repack(t)
    return family, tuple(arrays)


class CpuBackend:
    """The backend contract (engine/backends/contract.py) on host arrays."""

    name = "cpu"

    def __init__(self, int8_activations: bool | None = None, int8_passes: int = 2):
        """int8_activations: multiply quantized weights with activations rounded to int8 (vpdpbusd or
        its avx2 form; the default on every level but portable, cpu_isa) or exactly in float32 (False).
        int8_passes: 2 (default) rounds each activation block twice (~16 bits: logits match the float
        path to ~1e-5); 1 is llama.cpp's single int8 rounding, faster for batches and prefill but
        measurably less exact (docs/performance.md, "Explicit SIMD")."""
        if int8_passes not in (1, 2):
            raise ValueError(f"int8_passes must be 1 or 2, got {int8_passes!r}")
        log_level()
        self.int8 = INT8_DEFAULT if int8_activations is None else bool(int8_activations)
        self.int8_passes = int8_passes
        self._scratch = _Scratch()

    # --- weights and buffers
    def linear(self, tensors: list[QuantTensor]) -> CpuLinear:
        lin = CpuLinear(tensors, self.int8, self._scratch)
        lin.passes = self.int8_passes
        return lin

    def vector(self, v: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(v, dtype=np.float32)

    def zeros(self, shape, dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype)

    def upload(self, a: np.ndarray) -> np.ndarray:
        return a

    def download(self, a) -> np.ndarray:
        return a

    def share_cpu(self, sharing: bool) -> None:
        """Kernels launched from the calling thread (numba's thread count is per launching thread)
        leave one core free while `sharing`: with every core busy, a parallel kernel whose thread was
        descheduled by other work (a model loading beside this one) waits at each barrier for it."""
        total = numba.config.NUMBA_NUM_THREADS
        numba.set_num_threads(max(1, total - 1) if sharing else total)

    def fused_decode(self, model, k_cache, v_cache) -> None:
        """No one-call decode step on the CPU: the forward (its layer loop is one call) and `sample` serve."""
        return None

    def layer_stack(self, layers) -> LayerStack | None:
        """The layers' weights stacked for run_layers (one call per step for every layer), where their
        layouts allow it; None otherwise (the forward then calls the ops layer by layer)."""
        if _uses_blas(layers):
            return None   # a matrix sent to numpy's BLAS for large batches: the op-by-op path does that
        return LayerStack.of(layers)

    def gemma3_layer_stack(self, layers, layer_kv) -> Gemma3LayerStack | None:
        """Gemma 3's layers for run_gemma3_layers (one call per step for every layer), where their products
        allow it; None otherwise."""
        return None if _uses_blas(layers) else Gemma3LayerStack.of(layers, layer_kv)

    # --- ops
    def embedding(self, table: CpuLinear, tokens: np.ndarray, out: np.ndarray) -> None:
        out[:] = table.gather(tokens)

    def rmsnorm(self, x, w, eps, out) -> None:
        norm_act.rmsnorm(x, w, eps, out)

    def matmul(self, x, lin: CpuLinear, out, accumulate: bool = False) -> None:
        lin(x, out, accumulate)

    def rope_store_kv(self, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads):
        attention.rope_store_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)

    def attention(self, qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads,
                  scale, out, window: int = 0):
        attention.paged_attention(qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads,
                            np.float32(scale), out, np.int64(window))

    def silu_mul(self, gate_up, out) -> None:
        norm_act.silu_mul(gate_up, out)

    def gelu_mul(self, gate_up, out) -> None:
        norm_act.gelu_mul(gate_up, out)

    def scale(self, x, factor) -> None:
        norm_act.scale(x, np.float32(factor))

    def head_rmsnorm(self, qkv, q_w, k_w, num_heads, num_kv_heads, eps) -> None:
        norm_act.head_rmsnorm(qkv, q_w, k_w, num_heads, num_kv_heads, np.float32(eps))

    def rmsnorm_add(self, x, w, eps, out) -> None:
        norm_act.rmsnorm_add(x, w, np.float32(eps), out)

    # --- fused ops (one kernel call where the list of ops has two)
    def rmsnorm_matmul(self, x, w, eps, lin: CpuLinear, out, accumulate: bool = False) -> None:
        """out (+)= rmsnorm(x) * w @ W.T"""
        lin(x, out, accumulate, norm=w, eps=eps)

    def silu_mul_matmul(self, gate_up, lin: CpuLinear, out, accumulate: bool = False) -> None:
        """out (+)= (silu(gate) * up) @ W.T"""
        lin(gate_up, out, accumulate, silu_mul=True)

    def gelu_mul_matmul(self, gate_up, lin: CpuLinear, out, accumulate: bool = False) -> None:
        """out (+)= (gelu_tanh(gate) * up) @ W.T"""
        lin(gate_up, out, accumulate, gelu_mul=True)

    def rope_attention(self, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables, token_seq,
                       num_heads, num_kv_heads, scale, out, next_linear: CpuLinear | None = None,
                       window: int = 0) -> None:
        """rope_store_kv, then attention. next_linear: the matmul that comes next, whose weights an idle
        thread reads into the caches while a short decode attention runs."""
        wa, wb = next_linear.warm if next_linear is not None else (attention.NOTHING_TO_WARM, attention.NOTHING_TO_WARM)
        attention.rope_attention(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables, token_seq,
                           num_heads, num_kv_heads, np.float32(scale), out, wa, wb, np.int64(window))

    def sample(self, logits: np.ndarray, batch: SamplingBatch) -> SampleResult:
        return sample(logits, batch)

    def rope_tables(self, max_position, head_dim, theta):
        return rope_tables(max_position, head_dim, theta)
