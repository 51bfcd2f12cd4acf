"""The `cpu` backend: every op of the forward pass as a numba @njit kernel on host arrays."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.backends import cpu_linear as L
from engine.backends import cpu_ops as ops
from engine.sampling import SampleResult, SamplingBatch, sample
from models.quant import QuantTensor

# From this many input rows on, dequantizing a matrix once and multiplying with BLAS beats the
# fused kernels (measured by benchmarks/bench_engine.py; see README).
BLAS_MIN_ROWS = 48


@dataclass
class _Part:
    """One stored matrix of a (possibly fused) linear layer, in its tiled layout."""
    family: str
    arrays: tuple
    rows: int
    col0: int  # first output column it produces


class CpuLinear:
    """y = x @ W.T for one or more stored matrices stacked along the output (e.g. q|k|v, gate|up)."""

    def __init__(self, tensors: list[QuantTensor]):
        self.in_features = tensors[0].shape[1]
        if any(t.shape[1] != self.in_features for t in tensors):
            raise ValueError("fused matrices must share their input size")
        if len({t.format for t in tensors}) == 1 and len(tensors) > 1:
            # one packed matrix: one parallel region per call and better balance across threads
            tensors = [QuantTensor(tensors[0].format, (sum(t.shape[0] for t in tensors), self.in_features),
                                   np.concatenate([t.data for t in tensors]))]
        self.parts, col = [], 0
        for t in tensors:
            packed = L.repack(t.format, t.data, t.shape)
            self.parts.append(_Part(packed[0], packed[1:], t.shape[0], col))
            col += t.shape[0]
        self.out_features = col
        self.formats = tuple(t.format for t in tensors)
        self.nbytes = sum(a.nbytes for p in self.parts for a in p.arrays)
        self._dense: np.ndarray | None = None

    def __call__(self, x: np.ndarray, out: np.ndarray, accumulate: bool = False) -> None:
        if x.shape[0] >= BLAS_MIN_ROWS:
            self._blas(x, out, accumulate)
            return
        for p in self.parts:
            a = p.arrays
            if p.family == "q4":
                kern = L.gemv_q4 if x.shape[0] <= L.GEMV_MAX_ROWS else L.gemm_q4
                kern(x, a[0], a[1], a[2], out, p.col0, p.rows, accumulate)
            elif p.family == "q8":
                kern = L.gemv_q8 if x.shape[0] <= L.GEMV_MAX_ROWS else L.gemm_q8
                kern(x, a[0], a[1], out, p.col0, p.rows, accumulate)
            elif p.family == "f32":
                L.gemm_f32(x, a[0], out, p.col0, p.rows, accumulate)
            else:
                L.gemm_half(x, a[0], p.family == "bf16", out, p.col0, p.rows, accumulate)

    def dequantize_into(self, w: np.ndarray) -> None:
        """W as float32 [out, in]."""
        for p in self.parts:
            dst = w[p.col0:p.col0 + p.rows]
            a = p.arrays
            if p.family == "q4":
                L.dequantize_q4(a[0], a[1], a[2], p.rows, dst)
            elif p.family == "q8":
                L.dequantize_q8(a[0], a[1], p.rows, dst)
            else:
                dst[:] = _dense_float(p)

    def _blas(self, x, out, accumulate):
        # Scratch reused across calls of the same layer: a prefill dequantizes each matrix once per step.
        if self._dense is None:
            self._dense = np.empty((self.out_features, self.in_features), np.float32)
        self.dequantize_into(self._dense)
        if accumulate:
            out += x @ self._dense.T
        else:
            np.matmul(x, self._dense.T, out=out)

    def release_scratch(self) -> None:
        self._dense = None

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """Rows of W as float32 (the embedding lookup of a tied or input embedding)."""
        p = self.parts[0]
        out = np.empty((len(rows), self.in_features), np.float32)
        a = p.arrays
        if p.family == "q4":
            L.gather_rows_q4(a[0], a[1], a[2], rows, out)
        elif p.family == "q8":
            L.gather_rows_q8(a[0], a[1], rows, out)
        else:
            out[:] = _widen(p.family, a[0][rows // L.TILE, :, rows % L.TILE])
        return out


def _widen(family: str, v: np.ndarray) -> np.ndarray:
    if family == "f32":
        return v
    if family == "f16":
        return v.view(np.float16).astype(np.float32)
    return (v.astype(np.uint32) << 16).view(np.float32)


def _dense_float(p: _Part) -> np.ndarray:
    w = p.arrays[0]  # [nt, K, TILE]
    return _widen(p.family, w.transpose(0, 2, 1).reshape(-1, w.shape[1])[:p.rows])


class CpuBackend:
    name = "cpu"

    # --- weights and buffers
    def linear(self, tensors: list[QuantTensor]) -> CpuLinear:
        return CpuLinear(tensors)

    def vector(self, v: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(v, dtype=np.float32)

    def zeros(self, shape, dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype)

    def upload(self, a: np.ndarray) -> np.ndarray:
        return a

    def download(self, a) -> np.ndarray:
        return a

    # --- ops
    def embedding(self, table: CpuLinear, tokens: np.ndarray, out: np.ndarray) -> None:
        out[:] = table.gather(tokens)

    def rmsnorm(self, x, w, eps, out) -> None:
        ops.rmsnorm(x, w, eps, out)

    def matmul(self, x, w: CpuLinear, out, accumulate: bool = False) -> None:
        w(x, out, accumulate)

    def rope_store_kv(self, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads):
        ops.rope_store_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)

    def attention(self, qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads,
                  scale, out):
        ops.paged_attention(qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads,
                            np.float32(scale), out)

    def silu_mul(self, gate_up, out) -> None:
        ops.silu_mul(gate_up, out)

    def sample(self, logits: np.ndarray, batch: SamplingBatch) -> SampleResult:
        return sample(logits, batch)

    def rope_tables(self, max_position, head_dim, theta):
        return ops.rope_tables(max_position, head_dim, theta)
