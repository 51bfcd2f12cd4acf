"""The CPU kernels against the numpy float64 reference (tests/reference.py), on fresh random inputs."""
from __future__ import annotations

import numpy as np
import pytest

from engine.backends import cpu_ops as ops
from engine.backends.cpu import CpuBackend, CpuLinear
from models.llama import LlamaModel, StepInput
from models.quant import FORMATS, QuantTensor
from tests import reference as R
from tests.tiny_model import make_tiny_weights


@pytest.fixture
def rng():
    return np.random.default_rng()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 7, 64])   # the gemv path (<= 4 rows), the gemm path, the BLAS path
def test_linear_matches_the_reference(rng, fmt, rows):
    n, k = 70, 96                                  # 70 rows: not a multiple of the tile
    w = QuantTensor.from_float((rng.standard_normal((n, k)) * 0.2).astype(np.float32), fmt)
    w2 = QuantTensor.from_float((rng.standard_normal((33, k)) * 0.2).astype(np.float32), "q8_0")
    lin = CpuLinear([w, w2])                       # a fused pair, here of different formats
    x = rng.standard_normal((rows, k)).astype(np.float32)
    want = x.astype(np.float64) @ np.concatenate([w.dequantize(), w2.dequantize()]).astype(np.float64).T
    out = np.zeros((rows, n + 33), np.float32)
    lin(x, out)
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()
    base = rng.standard_normal(out.shape).astype(np.float32)
    acc = base.copy()
    lin(x, acc, accumulate=True)
    assert np.abs(acc - (base + want)).max() <= 1e-5 * np.abs(want).max() + 1e-6
    idx = np.array([0, 5, n - 1])
    assert np.allclose(lin.gather(idx), w.dequantize()[idx], atol=1e-6)


def test_rmsnorm_silu_and_rope(rng):
    x = rng.standard_normal((5, 64)).astype(np.float32)
    wn = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    out = np.empty_like(x)
    ops.rmsnorm(x, wn, 1e-5, out)
    assert np.allclose(out, R.rmsnorm(x, wn, 1e-5), atol=1e-5)
    gu = rng.standard_normal((5, 128)).astype(np.float32)
    m = np.empty((5, 64), np.float32)
    ops.silu_mul(gu, m)
    assert np.allclose(m, R.silu_mul(gu), atol=1e-5)


def test_paged_attention_with_shuffled_blocks_and_chunked_prefill(rng):
    h, hkv, dh, bs, nblocks = 4, 2, 16, 4, 40
    be = CpuBackend()
    cos, sin = be.rope_tables(256, dh, 10000.0)
    k_cache = np.zeros((nblocks, bs, hkv, dh), np.float32)
    v_cache = np.zeros_like(k_cache)
    lens, chunk_starts = [13, 29, 5], [9, 0, 4]    # seq 0 and 2: a chunk in the middle; seq 1: a whole prompt
    tables = rng.permutation(nblocks)[:3 * 8].astype(np.int32).reshape(3, 8)
    full_qkv = [rng.standard_normal((n, (h + 2 * hkv) * dh)).astype(np.float32) for n in lens]
    # the tokens before each chunk were computed in an earlier step
    for s, (n, c) in enumerate(zip(lens, chunk_starts)):
        if c:
            pos = np.arange(c, dtype=np.int32)
            qkv = full_qkv[s][:c].copy()
            slots = tables[s, pos // bs].astype(np.int64) * bs + pos % bs
            ops.rope_store_kv(qkv, pos, cos, sin, k_cache, v_cache, slots, h, hkv)
    pos = np.concatenate([np.arange(c, n, dtype=np.int32) for n, c in zip(lens, chunk_starts)])
    seq = np.concatenate([np.full(n - c, s, np.int32) for s, (n, c) in enumerate(zip(lens, chunk_starts))])
    qkv = np.concatenate([full_qkv[s][c:] for s, c in enumerate(chunk_starts)])
    slots = tables[seq, pos // bs].astype(np.int64) * bs + pos % bs
    ops.rope_store_kv(qkv, pos, cos, sin, k_cache, v_cache, slots, h, hkv)
    out = np.zeros((len(pos), h * dh), np.float32)
    be.attention(qkv, k_cache, v_cache, tables, pos, seq, h, hkv, dh ** -0.5, out)
    t = 0
    for s, (n, c) in enumerate(zip(lens, chunk_starts)):
        q = R.rope(full_qkv[s][:, :h * dh].reshape(n, h, dh), np.arange(n), 10000.0)
        k = R.rope(full_qkv[s][:, h * dh:(h + hkv) * dh].reshape(n, hkv, dh), np.arange(n), 10000.0)
        v = full_qkv[s][:, (h + hkv) * dh:].reshape(n, hkv, dh)
        want = R.causal_attention(q, k, v, dh ** -0.5)[c:].reshape(n - c, h * dh)
        assert np.abs(out[t:t + n - c] - want).max() < 1e-4
        t += n - c


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_1"])
def test_forward_of_a_tiny_llama_matches_the_reference(fmt):
    weights = make_tiny_weights(seed=int(np.random.default_rng().integers(1 << 30)), fmt=fmt)
    model = LlamaModel(weights, CpuBackend())
    tokens = np.random.default_rng().integers(3, weights.config.vocab_size, 23)
    k, v = model.allocate_kv_cache(8, 4)
    pos = np.arange(len(tokens), dtype=np.int32)
    step = StepInput(tokens.astype(np.int32), pos, np.zeros(len(tokens), np.int32), pos.astype(np.int64),
                     np.arange(8, dtype=np.int32)[None, :], pos.copy())
    got = model.forward(step, k, v)
    want = R.forward(weights, tokens)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
