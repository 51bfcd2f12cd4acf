"""The CPU kernels against the numpy float64 reference (tests/reference.py), on fresh random inputs.

Every run draws new inputs; a failure prints the seed (rerun with CPU_KERNEL_SEED=<seed>).
Quantized weights are compared with their own dequantized values (QuantTensor.dequantize), so only the
kernel's arithmetic is under test. The int8 kernels are checked twice: exactly against the product of
the weights with the int8-rounded activations they use, and loosely against the float product.
"""
from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from engine.backends import cpu_attention as attention
from engine.backends import cpu_matmul as L
from engine.backends import cpu_norm_act as norm_act
from engine.backends.cpu import CpuBackend, CpuLinear
from models.formats import BLOCK_FORMATS
from models.rope import rope_tables
from tests import reference as R
from tests.quant_blocks import random_tensor, row_length

SEED = int(os.environ.get("CPU_KERNEL_SEED", np.random.SeedSequence().entropy % 2**32))
QUANT = BLOCK_FORMATS
FLOAT = ("f32", "f16", "bf16")


@pytest.fixture
def rng(request):
    # one stream per test, derived from the run's seed and the test's name
    return np.random.default_rng([SEED, zlib.crc32(request.node.name.encode())])


def _msg(what):
    return f"{what} (seed {SEED}: rerun with CPU_KERNEL_SEED={SEED})"


def _nonzero(rng, shape, scale=1.0):
    """Normal values, none of them zero."""
    a = rng.standard_normal(shape).astype(np.float32) * np.float32(scale)
    a[a == 0] = 0.5
    return a


def _tensor(rng, fmt, n, k):
    """Random blocks (K-quants from random fields) or random floats in fmt."""
    return random_tensor(rng, fmt, n, k)


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _assert_float32_product(got, x, w, before, what):
    """got is x @ w.T (+ before) as float32 arithmetic can give it: within the rounding bound of a dot product of
    length k in any order, gamma_k * sum |x||w| (plus the rounding of the add), not a share of the largest output,
    which a few small outputs may fall under by chance."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    base = 0.0 if before is None else np.asarray(before, np.float64)
    err = np.abs(np.asarray(got, np.float64) - (x @ w.T + base))
    bound = (x.shape[-1] + 2) * 2.0 ** -24 * (np.abs(x) @ np.abs(w).T + np.abs(base))
    assert (err <= bound).all(), _msg(f"{what}: off by {float((err / bound).max()):.1f}x float32's rounding bound")


def _int8_codes(xq):
    """The int8 planes [M, passes, K] as one code per value, [M, K // 32, 32], in units of the block's d."""
    m, passes, k = xq.shape
    q = xq[:, 0].astype(np.float64) * (256.0 if passes == 2 else 1.0)
    if passes == 2:
        q += xq[:, 1]
    return q.reshape(m, k // 32, 32)


def _int8_x(x, passes):
    """x as the int8 kernels see it: rounded per 32-block to one int8 plane or two (~16 bits)."""
    xq, xd, _ = L.quantize_activations(np.ascontiguousarray(x, np.float32), passes)
    return (_int8_codes(xq) * xd.astype(np.float64)[:, :, None]).reshape(x.shape)


# --------------------------------------------------------------------------------- activations
def _assert_block_sums(xs, xd, q, msg):
    """xs holds d * sum(q) per block, summed as two float32 half-block products: within a few float32
    roundings of d * sum|q| (a relative bound fails where the halves cancel)."""
    d = xd.astype(np.float64)
    bound = 4 * np.finfo(np.float32).eps * d * np.abs(q).sum(-1)
    assert (np.abs(xs - d * q.sum(-1)) <= bound).all(), msg


def test_quantize_activations_rounds_each_block_to_int8(rng):
    x = _nonzero(rng, (5, 96), 3.0)
    x[2, 32:64] = 0.0  # an all-zero block must not divide by zero
    blocks = x.reshape(5, 3, 32).astype(np.float64)
    amax = np.abs(blocks).max(-1)
    xq, xd, xs = L.quantize_activations(x, 1)
    np.testing.assert_allclose(xd, amax / 127, rtol=1e-6, err_msg=_msg("scale"))
    err = np.abs(xq[:, 0].reshape(5, 3, 32) * xd[:, :, None] - blocks)
    assert (err <= xd[:, :, None] * 0.5001 + 1e-7).all(), _msg("rounding")
    assert np.abs(xq.astype(np.int32)).max() <= 127
    _assert_block_sums(xs, xd, _int8_codes(xq), _msg("sums"))
    assert (xq[2, 0, 32:64] == 0).all() and xd[2, 1] == 0
    # two planes: ~16 bits
    xq, xd, xs = L.quantize_activations(x, 2)
    np.testing.assert_allclose(xd, amax / 127 / 256, rtol=1e-6, err_msg=_msg("scale, 2 planes"))
    x2 = _int8_x(x, 2).reshape(5, 3, 32)
    # half a unit of d / 256, a whole one where the rest reached d / 2 and was clamped to 127
    assert (np.abs(x2 - blocks) <= amax[:, :, None] / 127 / 256 * 1.0001 + 1e-7).all(), _msg("2 planes")
    _assert_block_sums(xs, xd, _int8_codes(xq), _msg("sums, 2 planes"))


# ------------------------------------------------------------------------------------- matmuls
@pytest.mark.parametrize("fmt", QUANT + FLOAT)
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 21])
@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul_every_format(rng, fmt, rows, accumulate):
    """Tiled kernels (gemv and gemm shapes, 4-row groups plus a remainder) with an output size that is
    not a multiple of the 16-row tile, writing into the middle of a wider output."""
    n, k = 45, row_length(fmt, 96)
    qt = _tensor(rng, fmt, n, k)
    dense = qt.dequantize().astype(np.float64)
    x = _nonzero(rng, (rows, k))
    for int8, passes in ([(True, 1), (True, 2), (False, 1)] if fmt in QUANT else [(False, 1)]):
        lin = CpuLinear([qt], int8=int8)
        lin.passes = passes
        out = _nonzero(rng, (rows, n + 7))
        before = out.copy()
        lin.blas_min_rows = 1 << 30  # the tiled kernels, whatever the row count
        view = out[:, 3:3 + n]
        tmp = np.ascontiguousarray(view)
        lin(x, tmp, accumulate)
        out[:, 3:3 + n] = tmp
        base = before[:, 3:3 + n].astype(np.float64) if accumulate else 0.0
        if int8 and fmt in QUANT:
            exact = _int8_x(x, passes) @ dense.T
            assert _rel(tmp - base, exact) < 2e-6, _msg(f"{fmt} int8 x{passes} vs its own rounding")
            tol = 3e-2 if passes == 1 else 2e-4
            assert _rel(tmp - base, x.astype(np.float64) @ dense.T) < tol, _msg(f"{fmt} int8 x{passes} vs float")
        else:
            _assert_float32_product(tmp, x, dense, base if accumulate else None, f"{fmt} float kernel")
        np.testing.assert_array_equal(out[:, :3], before[:, :3])
        np.testing.assert_array_equal(out[:, 3 + n:], before[:, 3 + n:])


@pytest.mark.parametrize("int8", [True, False])
def test_fused_parts_of_different_formats(rng, int8):
    """q|k|v-style stacking of matrices in different formats: each part writes its own columns."""
    k = 64
    parts = [_tensor(rng, "q4_1", 37, k), _tensor(rng, "q8_0", 16, k), _tensor(rng, "f16", 21, k),
             _tensor(rng, "q4_0", 5, k), _tensor(rng, "bf16", 3, k)]
    lin = CpuLinear(parts, int8=int8)
    assert lin.out_features == 82 and len(lin.parts) == 5
    dense = np.concatenate([p.dequantize() for p in parts]).astype(np.float64)
    for rows in (1, 6):
        x = _nonzero(rng, (rows, k))
        for accumulate in (False, True):
            out = _nonzero(rng, (rows, 82))
            before = out.astype(np.float64)
            lin(x, out, accumulate)
            base = before if accumulate else None
            if int8:  # two planes by default; the float parts are float32 products whatever the mode
                got, want = out - (before if accumulate else 0.0), x.astype(np.float64) @ dense.T
                assert _rel(got, want) < 2e-4, _msg(f"fused rows={rows} accumulate={accumulate}")
                for part in (slice(53, 74), slice(79, 82)):  # f16, bf16
                    _assert_float32_product(out[:, part], x, dense[part], None if base is None else base[:, part],
                                            f"float part {part} rows={rows}")
            else:
                _assert_float32_product(out, x, dense, base, f"fused rows={rows} accumulate={accumulate}")


def test_same_format_parts_are_packed_into_one_matrix(rng):
    q, kk, v = (_tensor(rng, "q4_1", n, 64) for n in (48, 16, 16))
    lin = CpuLinear([q, kk, v])
    assert len(lin.parts) == 1 and lin.out_features == 80


@pytest.mark.parametrize("fmt", QUANT + FLOAT)
def test_blas_path_and_dequantize(rng, fmt):
    """The dequantize + BLAS path (off by default: the kernels are faster; on for a matrix on request)."""
    n, k = 40, row_length(fmt, 96)
    qt = _tensor(rng, fmt, n, k)
    dense = qt.dequantize()
    lin = CpuLinear([qt], int8=False)
    w = np.empty((n, k), np.float32)
    lin.dequantize_into(w)
    np.testing.assert_array_equal(w, dense)
    lin.blas_min_rows = 8
    rows = 11
    x = _nonzero(rng, (rows, k))
    for accumulate in (False, True):
        out = _nonzero(rng, (rows, n))
        before = out.astype(np.float64)
        lin(x, out, accumulate)
        _assert_float32_product(out, x, dense, before if accumulate else None, f"BLAS {fmt} accumulate={accumulate}")


def test_non_contiguous_output(rng):
    lin = CpuLinear([_tensor(rng, "q8_0", 20, 64)])
    x = _nonzero(rng, (3, 64))
    big = np.zeros((3, 40), np.float32)
    lin(x, big[:, ::2])
    ref = np.zeros((3, 20), np.float32)
    lin(x, ref)
    np.testing.assert_array_equal(big[:, ::2], ref)


@pytest.mark.parametrize("fmt", QUANT + FLOAT)
def test_gather_rows_is_exact(rng, fmt):
    qt = _tensor(rng, fmt, 50, row_length(fmt, 64))
    rows = rng.integers(0, 50, 9)
    np.testing.assert_array_equal(CpuLinear([qt]).gather(rows), qt.dequantize()[rows])


@pytest.mark.parametrize("fmt", QUANT)
def test_dequantized_tiles_are_exact(rng, fmt):
    """The tile kernels' scales (halves, or the K-quants' bytes under half super-scales) give gguf's weights."""
    qt = _tensor(rng, fmt, 37, row_length(fmt, 64))
    w = np.empty(qt.shape, np.float32)
    CpuLinear([qt]).dequantize_into(w)
    np.testing.assert_array_equal(w, qt.dequantize())


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q5_1", "q4_k", "q6_k", "f16", "f32"])
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_matmul_with_fused_rmsnorm_and_silu_mul(rng, fmt, rows):
    """The op before a product applied on the way in: rmsnorm(x) * w, silu(gate) * up or gelu(gate) * up."""
    n, k = 37, row_length(fmt, 96)
    qt = _tensor(rng, fmt, n, k)
    dense = qt.dequantize().astype(np.float64)
    for int8 in ([True, False] if fmt in QUANT else [False]):
        lin = CpuLinear([qt], int8=int8)
        tol = 2e-4 if int8 else 2e-6
        x = _nonzero(rng, (rows, k), 3.0)
        w = _nonzero(rng, k)
        out = _nonzero(rng, (rows, n))
        before = out.astype(np.float64)
        lin(x, out, accumulate=True, norm=w, eps=1e-5)
        want = before + R.rmsnorm(x, w, 1e-5) @ dense.T
        assert _rel(out - before, want - before) < tol, _msg(f"rmsnorm-matmul {fmt} int8={int8}")
        gu = _nonzero(rng, (rows, 2 * k), 2.0)
        out = np.empty((rows, n), np.float32)
        lin(gu, out, silu_mul=True)
        assert _rel(out, R.silu_mul(gu) @ dense.T) < tol, _msg(f"silu_mul-matmul {fmt} int8={int8}")
        lin(gu, out, gelu_mul=True)
        assert _rel(out, R.gelu_tanh_mul(gu) @ dense.T) < tol, _msg(f"gelu_mul-matmul {fmt} int8={int8}")


def test_fused_transform_on_stacked_parts_and_blas(rng):
    """Parts in different formats share one transformed x; so does the BLAS path."""
    k = 64
    w = _nonzero(rng, k)
    parts = [_tensor(rng, "q4_1", 20, k), _tensor(rng, "f16", 12, k)]
    stacked = CpuLinear(parts)
    blas = CpuLinear([_tensor(rng, "f32", 32, k)])
    blas.blas_min_rows = 4
    for lin, rows in ((stacked, 3), (blas, 5)):
        dense = np.empty((lin.out_features, k), np.float32)
        lin.dequantize_into(dense)
        x = _nonzero(rng, (rows, k))
        out = np.empty((rows, lin.out_features), np.float32)
        lin(x, out, norm=w, eps=1e-6)
        assert _rel(out, R.rmsnorm(x, w, 1e-6) @ dense.astype(np.float64).T) < 2e-4, _msg(f"rows={rows}")


def test_fused_ops_match_the_composed_ones(rng):
    """The forward's fused ops against their parts (the composition a backend without them gets)."""
    from engine.backends.contract import ComposedOps
    from models.llama import LlamaModel
    from tests.tiny_model import make_tiny_weights

    class Plain(ComposedOps, CpuBackend):
        """A CPU backend without the fused ops (nor the one-call layer loop)."""
        def layer_stack(self, layers):
            return None

    w = make_tiny_weights(seed=int(rng.integers(1 << 30)), fmt="q8_0")
    fused, plain = LlamaModel(w, CpuBackend()), LlamaModel(w, Plain())
    assert not isinstance(fused.backend, ComposedOps) and isinstance(plain.backend, ComposedOps) \
        and plain.layer_stack is None
    tokens = rng.integers(0, w.config.vocab_size, 11)
    a = _forward_chunks(fused, tokens, [7, 1, 1, 2])
    b = _forward_chunks(plain, tokens, [7, 1, 1, 2])
    assert _rel(a, b) < 1e-5, _msg("fused vs composed forward")


# ----------------------------------------------------------------------------- elementwise ops
def test_rmsnorm_and_silu_and_gelu_mul(rng):
    for d in (64, 50):  # a width that is not a multiple of 16 exercises the scalar tail
        x = _nonzero(rng, (5, d), 2.0)
        w = _nonzero(rng, d)
        out = np.empty_like(x)
        norm_act.rmsnorm(x, w, 1e-5, out)
        assert _rel(out, R.rmsnorm(x, w, 1e-5)) < 2e-6, _msg(f"rmsnorm d={d}")
        gu = _nonzero(rng, (5, 2 * d), 4.0)
        gu[0, :4] = [-100.0, 100.0, -30.0, 30.0]  # saturated exponentials
        out = np.empty((5, d), np.float32)
        norm_act.silu_mul(gu, out)
        assert _rel(out, R.silu_mul(gu)) < 2e-6, _msg(f"silu_mul d={d}")
        gu[0, d - 4:d] = [-100.0, 100.0, -12.0, 12.0]   # in the scalar tail too where d is not a multiple of 16
        norm_act.gelu_mul(gu, out)
        assert np.all(np.isfinite(out)), _msg(f"gelu_mul d={d}: not finite")
        assert _rel(out, R.gelu_tanh_mul(gu)) < 2e-6, _msg(f"gelu_mul d={d}")


def test_rope_store_kv(rng):
    h, hkv, dh, bs = 6, 2, 32, 4
    t = 7
    positions = rng.permutation(40)[:t].astype(np.int32)
    slots = rng.permutation(12 * bs)[:t].astype(np.int64)
    qkv = _nonzero(rng, (t, (h + 2 * hkv) * dh))
    orig = qkv.astype(np.float64)
    kc = np.zeros((12, bs, hkv, dh), np.float32)
    vc = np.zeros_like(kc)
    cos, sin = rope_tables(64, dh, 10000.0)
    attention.rope_store_kv(qkv, positions, cos, sin, kc, vc, slots, h, hkv)
    q = R.rope(orig[:, :h * dh].reshape(t, h, dh), positions, 10000.0)
    k = R.rope(orig[:, h * dh:(h + hkv) * dh].reshape(t, hkv, dh), positions, 10000.0)
    v = orig[:, (h + hkv) * dh:].reshape(t, hkv, dh)
    assert _rel(qkv[:, :h * dh].reshape(t, h, dh), q) < 2e-6, _msg("rope q")
    assert _rel(kc.reshape(-1, hkv, dh)[slots], k) < 2e-6, _msg("rope k")
    np.testing.assert_array_equal(vc.reshape(-1, hkv, dh)[slots], v)


def _attention_case(rng, seqs, h, hkv, dh, bs):
    """seqs: (context length after the step, query tokens in this step) per sequence.

    Returns the kernel's and the reference's outputs. Blocks are scattered (shuffled tables)."""
    max_blocks = max(-(-n // bs) for n, _ in seqs)
    nblocks = sum(-(-n // bs) for n, _ in seqs) + 3
    perm = rng.permutation(nblocks).astype(np.int32)
    tables = np.zeros((len(seqs), max_blocks), np.int32)
    used = 0
    for s, (n, _) in enumerate(seqs):
        nb = -(-n // bs)
        tables[s, :nb] = perm[used:used + nb]
        used += nb
    kc = _nonzero(rng, (nblocks, bs, hkv, dh))
    vc = _nonzero(rng, (nblocks, bs, hkv, dh))
    positions, token_seq, qsl = [], [], [0]
    for s, (n, nq) in enumerate(seqs):
        positions += list(range(n - nq, n))
        token_seq += [s] * nq
        qsl.append(qsl[-1] + nq)
    t = len(positions)
    qkv = _nonzero(rng, (t, (h + 2 * hkv) * dh))
    out = np.full((t, h * dh), np.nan, np.float32)
    scale = dh ** -0.5
    attention.paged_attention(qkv, kc, vc, tables, np.array(positions, np.int32), np.array(token_seq, np.int32),
                        h, hkv, np.float32(scale), out)
    q = qkv[:, :h * dh].reshape(t, h, dh)
    ref = R.paged_attention(q, kc, vc, tables, np.array([n for n, _ in seqs]), np.array(qsl), scale)
    return out.reshape(t, h, dh), ref


def test_rope_attention_with_and_without_warming_the_next_weights(rng):
    """rope_attention = rope_store_kv + attention; warming the next matmul's weights changes nothing."""
    h, hkv, dh, bs = 9, 3, 64, 16
    kc = _nonzero(rng, (6, bs, hkv, dh))
    vc = _nonzero(rng, (6, bs, hkv, dh))
    table = np.array([[4, 1, 3]], np.int32)
    pos = np.array([37], np.int32)
    slots = (table[0, pos // bs].astype(np.int64) * bs + pos % bs)
    qkv = _nonzero(rng, (1, (h + 2 * hkv) * dh))
    cos, sin = rope_tables(64, dh, 1e4)
    nxt = CpuLinear([_tensor(rng, "q4_1", 64, 64)])
    outs = []
    for warm in (None, nxt):
        q, k, v, out = qkv.copy(), kc.copy(), vc.copy(), np.empty((1, h * dh), np.float32)
        CpuBackend().rope_attention(q, pos, cos, sin, k, v, slots, table, np.zeros(1, np.int32), h, hkv, 0.125,
                                    out, next_linear=warm)
        outs.append((q, k, v, out))
    q2, k2, v2, out2 = qkv.copy(), kc.copy(), vc.copy(), np.empty((1, h * dh), np.float32)
    attention.rope_store_kv(q2, pos, cos, sin, k2, v2, slots, h, hkv)
    attention.paged_attention(q2, k2, v2, table, pos, np.zeros(1, np.int32), h, hkv, np.float32(0.125), out2)
    for q, k, v, out in outs:
        for a, b in ((q, q2), (k, k2), (v, v2), (out, out2)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bs", [16, 5])
def test_paged_attention_mixed_batch(rng, bs):
    """Decodes, a fresh prefill and a chunked prefill whose queries sit in the middle of a sequence."""
    seqs = [(37, 1), (1, 1), (23, 23), (60, 9), (17, 1)]
    got, ref = _attention_case(rng, seqs, h=9, hkv=3, dh=64, bs=bs)
    assert _rel(got, ref) < 2e-5, _msg(f"attention bs={bs}")


def test_paged_attention_short_decode_runs_serially_and_long_in_parallel(rng):
    small = [(5, 1)]
    assert 5 * 4 < attention.ATTN_PARALLEL_MIN_WORK
    got, ref = _attention_case(rng, small, h=4, hkv=2, dh=16, bs=4)
    assert _rel(got, ref) < 2e-5, _msg("serial attention")
    big = [(300, 40), (200, 1)]
    got, ref = _attention_case(rng, big, h=4, hkv=1, dh=32, bs=16)
    assert _rel(got, ref) < 2e-5, _msg("parallel attention")


@pytest.mark.parametrize("h,hkv,dh,bs,n,window", [
    (9, 3, 64, 16, 65, 0),      # two parts, the second of one key
    (9, 3, 64, 16, 300, 0),     # SmolLM2's heads, a part boundary inside a block
    (4, 1, 256, 5, 129, 0),     # Gemma 3's heads, blocks of 5 (parts cross blocks)
    (8, 2, 128, 16, 1000, 0),
    (4, 1, 64, 16, 400, 150),   # a sliding window: its first key is the first part's
])
def test_paged_attention_splits_a_long_one_token_context(rng, h, hkv, dh, bs, n, window):
    """A one-token step with more keys than a part (a decode at batch 1) splits its attention over the keys,
    every thread taking parts, and combines them: the same attention as the float64 reference."""
    max_blocks = -(-n // bs)
    tables = rng.permutation(max_blocks + 3)[None, :max_blocks].astype(np.int32)
    kc, vc = _nonzero(rng, (max_blocks + 3, bs, hkv, dh)), _nonzero(rng, (max_blocks + 3, bs, hkv, dh))
    qkv = _nonzero(rng, (1, (h + 2 * hkv) * dh))
    pos = np.array([n - 1], np.int32)
    none = attention.NOTHING_TO_WARM
    how, parts, _ = attention._attention_plan(qkv, pos, kc, h, hkv, window, none, none,
                                              len(attention.split_scratch(pos, h, dh)))
    keys = min(n, window) if window else n
    assert (how, parts) == (attention._SPLIT, -(-keys // attention.SPLIT_PART_KEYS))
    out = np.full((1, h * dh), np.nan, np.float32)
    attention.paged_attention(qkv, kc, vc, tables, pos, np.zeros(1, np.int32), h, hkv, np.float32(dh ** -0.5), out,
                              window)
    ref = R.paged_attention(qkv[:, :h * dh].reshape(1, h, dh), kc, vc, tables, np.array([n]), np.array([0, 1]),
                            dh ** -0.5, window=window)
    assert _rel(out.reshape(ref.shape), ref) < 2e-5, _msg(f"split attention n={n}")


def test_attention_splits_only_one_token_with_more_keys_than_a_part(rng):
    kc = np.zeros((40, 16, 3, 64), np.float32)
    qkv = np.zeros((2, 15 * 64), np.float32)
    part, none = attention.SPLIT_PART_KEYS, attention.NOTHING_TO_WARM
    for rows, position, room, want in ((1, part - 1, 2, attention._ONE_ITEM),   # one part's keys
                                       (1, part, 2, attention._SPLIT),
                                       (1, 300, 2, attention._ONE_ITEM),        # no room for its parts
                                       (2, 300, 8, attention._CHUNKS)):         # two tokens
        pos = np.full(rows, position, np.int32)
        how = attention._attention_plan(qkv[:rows], pos, kc, 9, 3, 0, none, none, room)[0]
        assert how == want, (rows, position, room)


def test_paged_attention_head_size_not_a_multiple_of_16(rng):
    got, ref = _attention_case(rng, [(9, 3), (4, 1)], h=4, hkv=2, dh=24, bs=4)
    assert _rel(got, ref) < 2e-5, _msg("scalar attention")


# ------------------------------------------------------------------------- whole forward passes
def _forward_chunks(model, tokens, chunks, bs=16):
    """Run `tokens` through model.forward in chunks (prefill pieces, then decodes); logits of every token."""
    t = len(tokens)
    nblk = -(-t // bs)
    k, v = model.allocate_kv_cache(nblk + 2, bs)
    table = np.random.default_rng(SEED).permutation(nblk + 2)[:nblk].astype(np.int32)[None]
    from models.llama import StepInput
    out, start = [], 0
    for n in chunks:
        pos = np.arange(start, start + n, dtype=np.int32)
        step = StepInput(np.asarray(tokens[start:start + n], np.int32), pos, np.zeros(n, np.int32),
                         table[0, pos // bs].astype(np.int64) * bs + pos % bs, table, np.arange(n, dtype=np.int32))
        out.append(np.array(model.forward(step, k, v)))
        start += n
    return np.concatenate(out)


@pytest.mark.parametrize("fmt,int8", [("f32", False), ("q4_1", False), ("q8_0", True), ("q4_0", True)])
def test_tiny_model_forward(rng, fmt, int8):
    from models.llama import LlamaModel
    from tests.tiny_model import make_tiny_weights
    w = make_tiny_weights(seed=int(rng.integers(1 << 30)), fmt=fmt)
    tokens = rng.integers(0, w.config.vocab_size, 24)
    got = _forward_chunks(LlamaModel(w, CpuBackend(int8)), tokens, [9, 7, 1, 1, 1, 5])
    ref = R.forward(w, tokens)
    if int8:
        cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
        assert cos.min() > 0.999, _msg(f"tiny {fmt} int8 cosine {cos.min()}")
    else:
        assert _rel(got, ref) < 1e-4, _msg(f"tiny {fmt}")


@pytest.fixture(scope="module")
def smollm2(default_model):
    from models.gguf_file import read_gguf
    return read_gguf(default_model)[0]


def _layer_errors(weights, model, tokens, chunks, bs=16) -> np.ndarray:
    """Each decoder layer of the kernels, then the head, over `tokens` in chunks (prefill pieces, then
    decodes), against the float64 reference run on the kernels' own inputs to that layer: per layer, the
    largest error relative to the largest value in or out (float32 errs in proportion to the residual
    stream's size). Local errors: on a random prompt a later layer may cancel a massive activation, which
    amplifies any float32 rounding before it many times over (seed 2006172166, position 1: numpy's own
    float32 forward 3e-5 off the logits, the kernels 7e-4), so end-to-end errors say little about the
    kernels (tests/test_real_model.py checks natural prompts end to end)."""
    from models.llama import StepInput
    cfg, t = weights.config, len(tokens)
    nblk = -(-t // bs)
    k, v = model.allocate_kv_cache(nblk + 2, bs)
    table = np.random.default_rng(SEED).permutation(nblk + 2)[:nblk].astype(np.int32)[None]
    inputs = np.zeros((cfg.num_layers + 1, t, cfg.hidden_size))   # the kernels' input to each layer, the head
    errs = np.zeros(cfg.num_layers + 1)
    start = 0
    for n in chunks:
        pos = np.arange(start, start + n, dtype=np.int32)
        step = StepInput(np.asarray(tokens[start:start + n], np.int32), pos, np.zeros(n, np.int32),
                         table[0, pos // bs].astype(np.int64) * bs + pos % bs, table, np.arange(n, dtype=np.int32))
        rs = model._run_state(n)
        h, qkv, attn, gate_up = (a[:n] for a in (rs.h, rs.qkv, rs.attn, rs.gate_up))
        model.backend.embedding(model.embed, step.tokens, h)
        for i, lw in enumerate(weights.layers):
            inputs[i, pos] = h
            model.layer(i, step, h, qkv, attn, gate_up, k, v)
            want = R.layer(inputs[i, :start + n], lw, cfg, np.arange(start + n))[pos]
            scale = max(np.abs(inputs[i, pos]).max(), np.abs(want).max())
            errs[i] = max(errs[i], np.abs(h - want).max() / scale)
        inputs[-1, pos] = h
        errs[-1] = max(errs[-1], _rel(model.head(h), R.head(inputs[-1, pos], weights)))
        start += n
    return errs


@pytest.mark.slow
def test_real_model_f32_matches_reference(smollm2):
    """SmolLM2 converted to float32, every layer and the head on a random prompt (prefill chunks, then decodes): within float32 rounding
    of the float64 reference. Measured: at most 1.3-1.9e-6 over 16 seeds (sums of 576-1536 terms)."""
    from models.llama import LlamaModel
    w = smollm2.converted("f32")
    tokens = np.random.default_rng(SEED).integers(0, w.config.vocab_size, 20)
    errs = _layer_errors(w, LlamaModel(w, CpuBackend()), tokens, [12, 5, 1, 1, 1])
    assert errs.max() < 1e-5, _msg(f"SmolLM2 f32: layer {errs.argmax()} errs {errs.max():.2e}")


@pytest.mark.slow
def test_real_model_quantized_stays_close(smollm2):
    """The stored Q4_1/Q8_0 model on the int8 kernels (default: two planes, ~15-bit activations), every
    layer and the head on a random prompt: close to the float64 reference on the same (dequantized)
    weights. Measured: at most 4.8-7e-5 over 16 seeds."""
    from models.llama import LlamaModel
    tokens = np.random.default_rng(SEED).integers(0, smollm2.config.vocab_size, 16)
    errs = _layer_errors(smollm2, LlamaModel(smollm2, CpuBackend()), tokens, [10, 3, 1, 1, 1])
    assert errs.max() < 5e-4, _msg(f"SmolLM2 quantized: layer {errs.argmax()} errs {errs.max():.2e}")


# ------------------------------------------------------------------------- raw addresses (addr)
def _dangling_addresses(source: str) -> list[str]:
    """Each `addr(name)` in a function whose array may be freed while the address is in use: name is
    neither a parameter of the function nor used as an array later in it (numba frees a local array
    right after its variable's last use; see cpu_simd.addr)."""
    import ast

    bad = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        addr_args, loads = [], []
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "addr" and node.args \
                    and isinstance(node.args[0], ast.Name):
                addr_args.append(node.args[0])
        inside = {id(a) for a in addr_args}
        for node in ast.walk(fn):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and id(node) not in inside:
                loads.append(node)
        for a in addr_args:
            later = any(n.id == a.id and (n.lineno, n.col_offset) > (a.lineno, a.col_offset) for n in loads)
            if a.id not in params and not later:
                bad.append(f"{fn.name}: addr({a.id}) line {a.lineno}")
    return bad


def test_raw_addresses_are_of_arrays_that_stay_alive():
    import inspect

    from engine.backends import cpu_claims
    found = [b for mod in (L, attention, norm_act, cpu_claims) for b in _dangling_addresses(inspect.getsource(mod))]
    assert found == [], f"addresses of arrays numba may free while they are in use: {found}"


def test_the_dangling_address_check_finds_a_freed_scratch():
    bad = _dangling_addresses(
        "def f(x, n):\n"
        "    scratch = np.empty(n)\n"
        "    keep = np.empty(n)\n"
        "    p, q, r = addr(scratch), addr(keep), addr(x)\n"
        "    for i in range(n):\n"
        "        keep[i] = st_f(p, i, 1.0)\n")
    assert bad == ["f: addr(scratch) line 4"]


# ------------------------------------------------------------------------ every layer in one call
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_layer_stack_matches_the_layer_loop_bit_for_bit(rng, fmt):
    """run_layers (one call for every layer) runs the same kernels as the forward's layer loop: the
    logits are identical, for prefill chunks and decodes of two sequences in one step."""
    from models.llama import LlamaModel, StepInput
    from tests.tiny_model import make_tiny_weights
    w = make_tiny_weights(seed=int(rng.integers(1 << 30)), fmt=fmt)
    model = LlamaModel(w, CpuBackend(int8_activations=True))
    stack = model.layer_stack
    assert stack is not None
    # the layers read the stacked weights: one copy, not two
    assert all(ly.qkv.parts[0].arrays[0].base is stack.arrays["qkv"][0] for ly in model.layers)
    bs, cfg = 4, w.config
    table = np.arange(16, dtype=np.int32).reshape(2, 8)
    logits = {}
    for use_stack in (True, False):
        model.layer_stack = stack if use_stack else None
        k, v = model.allocate_kv_cache(16, bs)
        got = []
        for n, start in ((9, 0), (1, 9), (1, 10)):       # sequence 0 prefill, then decodes of both
            seqs = np.array([0] * n + [1] * n, np.int32)
            pos = np.concatenate([np.arange(start, start + n)] * 2).astype(np.int32)
            tokens = np.random.default_rng(start).integers(0, cfg.vocab_size, 2 * n).astype(np.int32)
            step = StepInput(tokens, pos, seqs, table[seqs, pos // bs].astype(np.int64) * bs + pos % bs, table,
                             np.array([n - 1, 2 * n - 1], np.int32))
            got.append(np.array(model.forward(step, k, v)))
        logits[use_stack] = np.concatenate(got)
    np.testing.assert_array_equal(logits[True], logits[False])


def _decode_logits(model, seq_counts, context, bs=16):
    """Logits of each sequence's prefill of `context` tokens (one step each), then of one decode step of
    the first n sequences for each n in seq_counts."""
    from models.llama import StepInput
    n_seq = max(seq_counts)
    blocks = (context + len(seq_counts) + bs) // bs
    table = np.arange(n_seq * blocks, dtype=np.int32).reshape(n_seq, blocks)
    k, v = model.allocate_kv_cache(n_seq * blocks, bs)
    tokens = np.random.default_rng(context).integers(0, model.config.vocab_size, (n_seq, context + len(seq_counts)))
    length = np.zeros(n_seq, np.int64)
    out = []

    def step(seqs, n):
        pos = np.concatenate([np.arange(length[s], length[s] + n) for s in seqs]).astype(np.int32)
        seq = np.repeat(seqs, n).astype(np.int32)
        toks = np.concatenate([tokens[s, length[s]:length[s] + n] for s in seqs]).astype(np.int32)
        st = StepInput(toks, pos, seq, table[seq, pos // bs].astype(np.int64) * bs + pos % bs, table,
                       (np.arange(len(seqs)) * n + n - 1).astype(np.int32))
        out.append(np.array(model.forward(st, k, v)))
        length[seqs] += n
    for s in range(n_seq):
        step(np.array([s]), context)
    for n in seq_counts:
        step(np.arange(n), 1)
    return np.concatenate(out)


@pytest.mark.parametrize("heads,head_dim,context", [(4, None, 5), (4, None, 150), (8, None, 40), (4, 64, 150)])
def test_layer_loop_in_one_region_matches_a_region_per_kernel(rng, monkeypatch, heads, head_dim, context):
    """Steps of at most CLAIMED_MAX_ROWS rows run the layer loop in one parallel region, threads claiming
    the items of each product and attention (run_layers_claimed): the logits are those of run_layers bit
    for bit. Decodes of 1, 3 and 8 sequences; short contexts (attention as one item, o's weights warmed
    by the other thread), long ones (attention in claimed chunks; with heads of 64, one sequence's split
    over its keys and combined), and 8 heads of 8 (plain attention items)."""
    from engine.backends import cpu_claims, cpu_layers
    from models.llama import LlamaModel
    from tests.tiny_model import make_tiny_weights
    w = make_tiny_weights(seed=int(rng.integers(1 << 30)), fmt="q4_1", heads=heads, head_dim=head_dim,
                          max_position=256)
    model = LlamaModel(w, CpuBackend(int8_activations=True))
    assert model.layer_stack is not None
    regions = []
    claimed = cpu_layers.run_layers_claimed
    monkeypatch.setattr(cpu_layers, "run_layers_claimed", lambda *a: regions.append(a[0].shape[0]) or claimed(*a))
    logits = {}
    for max_rows in (0, cpu_claims.CLAIMED_MAX_ROWS):
        monkeypatch.setattr(cpu_claims, "CLAIMED_MAX_ROWS", max_rows)
        logits[max_rows] = _decode_logits(model, (1, 3, 8), context)
    # one region for each step of at most 8 rows, and only in the second pass
    assert regions == [n for n in [context] * 8 + [1, 3, 8] if n <= cpu_claims.CLAIMED_MAX_ROWS]
    np.testing.assert_array_equal(logits[0], logits[cpu_claims.CLAIMED_MAX_ROWS])


_IN_TURN = """
import numba
import numpy as np
from engine.backends import cpu_claims, cpu_gemma3_layers, cpu_layers
from engine.backends.cpu import CpuBackend
from models.gemma3 import Gemma3Model
from models.llama import LlamaModel
from tests.test_cpu_kernels import _decode_logits
from tests.test_gemma3 import run_chunks
from tests.tiny_gemma import make_tiny_gemma_weights
from tests.tiny_model import make_tiny_weights

llama = LlamaModel(make_tiny_weights(seed=3, fmt="q4_1", head_dim=64, max_position=256),
                   CpuBackend(int8_activations=True))
gemma = Gemma3Model(make_tiny_gemma_weights(5, fmt="q8_0", hidden=64, window=5), CpuBackend(int8_activations=True))
assert llama.layer_stack is not None and gemma.layer_stack is not None
tokens = list(np.random.default_rng(1).integers(0, gemma.config.vocab_size, 12))
runs = {}
for max_rows in (0, cpu_claims.CLAIMED_MAX_ROWS):
    cpu_claims.CLAIMED_MAX_ROWS = max_rows
    runs[max_rows] = (_decode_logits(llama, (1, 3, 8), 100), run_chunks(gemma, tokens, [6] + [1] * 6))
# two workers in the region, numba at one thread: its iterations run in turn on it
cpu_layers.get_num_threads = cpu_gemma3_layers.get_num_threads = lambda: 2
numba.set_num_threads(1)
for a, b in zip(runs[0], runs[cpu_claims.CLAIMED_MAX_ROWS]):
    np.testing.assert_array_equal(a, b)
in_turn = (_decode_logits(llama, (1, 3, 8), 100), run_chunks(gemma, tokens, [6] + [1] * 6))
for a, b in zip(runs[0], in_turn):
    np.testing.assert_array_equal(a, b)
print("ok")
"""


def test_one_region_finishes_when_one_thread_runs_every_worker_in_turn(tmp_path):
    """numba may run the region's iterations in turn on fewer threads than workers (here: two workers,
    one thread). The first then claims every item and none waits forever; the logits are unchanged.
    In a process of its own with a time limit: a wait that never ends holds the GIL, so it would hang
    the test run rather than fail it."""
    import subprocess
    import sys
    script = tmp_path / "in_turn.py"
    script.write_text(_IN_TURN)
    root = str(Path(__file__).resolve().parents[1])
    r = subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": root, "NUMBA_NUM_THREADS": "2"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", f"exit {r.returncode}: {r.stderr[-3000:]}"


def test_layer_stack_only_where_the_layers_share_a_layout(rng):
    from models.llama import LlamaModel
    from models.weights import ModelWeights
    from tests.tiny_model import make_tiny_weights
    w = make_tiny_weights(seed=int(rng.integers(1 << 30)), fmt="q8_0")
    assert LlamaModel(w, CpuBackend(int8_activations=False)).layer_stack is None   # exact float path
    assert LlamaModel(w.converted("f16"), CpuBackend()).layer_stack is None       # float weights
    mixed = ModelWeights(w.config, w.embed, [w.layers[0], w.converted("q4_1").layers[1]], w.final_norm, w.lm_head)
    assert LlamaModel(mixed, CpuBackend(int8_activations=True)).layer_stack is None  # q8 then q4 in one slot


def test_layer_stack_runs_from_numba_cache_in_a_new_process(tmp_path):
    """run_layers calls parallel kernels; a cached caller of parallel kernels used to segfault when a
    later process loaded it from numba's cache. Two fresh processes: the second surely loads it."""
    import subprocess
    import sys
    script = tmp_path / "stack.py"
    script.write_text(
        "import numpy as np\n"
        "from engine.backends.cpu import CpuBackend\n"
        "from models.llama import LlamaModel, StepInput\n"
        "from tests.tiny_model import make_tiny_weights\n"
        "m = LlamaModel(make_tiny_weights(seed=5, fmt='q8_0'), CpuBackend(int8_activations=True))\n"
        "assert m.layer_stack is not None\n"
        "k, v = m.allocate_kv_cache(4, 4)\n"
        "pos = np.arange(3, dtype=np.int32)\n"
        "step = StepInput(np.array([5, 6, 7], np.int32), pos, np.zeros(3, np.int32), pos.astype(np.int64),\n"
        "                 np.arange(4, dtype=np.int32)[None, :], np.array([2], np.int32))\n"
        "print(float(np.asarray(m.forward(step, k, v)).sum()))\n")
    root = str(Path(__file__).resolve().parents[1])
    outs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": root})
        assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
        outs.append(r.stdout.strip())
    assert outs[0] == outs[1] and outs[0]
