"""The CUDA kernels against the numpy reference, in numba's CUDA simulator (tiny shapes).

Run in their own process: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -m simulator tests/test_cuda_kernels.py
The simulator runs every CUDA thread as a Python thread (~10^5 slower than a GPU), so the launch
configuration used here is a small one (SIM_CONFIG); one test per kernel family also runs a real table row.
"""
from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np
import pytest

pytestmark = pytest.mark.simulator

# tests/conftest.py collects this file only in a process started with NUMBA_ENABLE_CUDASIM=1.
from cuda import launch  # noqa: E402
from cuda.backend import CudaBackend  # noqa: E402
from engine.backends.cpu_sampler import sample as cpu_sample  # noqa: E402
from engine.backends.sampling_batch import RowSpec, SamplingBatch  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from models.llama import LlamaModel, StepInput  # noqa: E402
from models.formats import BLOCK_FORMATS  # noqa: E402
from models.quant import QuantTensor  # noqa: E402
from tests import reference as R  # noqa: E402
from tests.quant_blocks import mixed_format_weights, random_tensor, row_length  # noqa: E402
from tests.tiny_model import make_tiny_weights  # noqa: E402

SIM_CONFIG = dataclasses.replace(
    launch.TABLE["fallback"], arch="simulator", sm_count=1, threads=32, gemv_threads=64, gemv_tokens=2,
    gemv_max_tokens=4, gemm_tiles=((16, 16, 2, 2),), attn_rows=8, attn_chunk=8, attn_threads=32,
    attn_min_split=8, sample_threads=32,
)
FORMATS = list(BLOCK_FORMATS) + ["f16", "bf16", "f32"]


@pytest.fixture(scope="module", autouse=True)
def fast_syncthreads():
    """The simulator's syncthreads polls every thread from a manager loop (~20 ms a barrier at 64 threads);
    here a block's threads meet at a threading.Barrier instead (3-4x faster). Valid because every thread of
    these kernels reaches every syncthreads (none returns early), as on the GPU."""
    from numba.cuda.simulator import kernel as K

    saved = K.BlockManager.run, K.BlockThread.syncthreads, K.BlockThread.run
    thread_run = K.BlockThread.run

    def run_block(self, grid_point, *args):
        barrier = threading.Barrier(int(np.prod(self._block_dim)))
        threads = []
        for block_point in np.ndindex(*self._block_dim):
            t = K.BlockThread(lambda: self._f(*args), self, grid_point, block_point, self._debug)
            t.barrier = barrier
            threads.append(t)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for t in threads:
            if t.exception:
                raise t.exception[0].with_traceback(t.exception[1])

    def syncthreads(self):
        try:
            self.barrier.wait(timeout=300)
        except threading.BrokenBarrierError:
            raise RuntimeError("a thread of the block failed or ended before syncthreads") from None

    def run_thread(self):
        thread_run(self)
        if self.exception is not None:
            self.barrier.abort()

    K.BlockManager.run, K.BlockThread.syncthreads, K.BlockThread.run = run_block, syncthreads, run_thread
    yield
    K.BlockManager.run, K.BlockThread.syncthreads, K.BlockThread.run = saved


@pytest.fixture
def rng():
    return np.random.default_rng()  # fresh data every run


@pytest.fixture(scope="module")
def be():
    return CudaBackend(SIM_CONFIG)


def close(a, b, tol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    err = np.abs(a - b).max() if a.size else 0.0
    assert err <= tol * max(1.0, np.abs(b).max()), f"max error {err:.3g} > {tol:g}"


def test_rmsnorm(be, rng):
    x = rng.standard_normal((3, 40)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(40)).astype(np.float32)
    out = be.zeros((3, 40))
    be.rmsnorm(be.upload(x), be.vector(w), 1e-5, out)
    close(be.download(out), R.rmsnorm(x, w, 1e-5), 1e-5)


def test_silu_mul(be, rng):
    gu = (3 * rng.standard_normal((3, 2 * 24))).astype(np.float32)
    out = be.zeros((3, 24))
    be.silu_mul(be.upload(gu), out)
    close(be.download(out), R.silu_mul(gu), 1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_embedding(be, rng, fmt):
    """Random blocks (K-quants from random fields) against gguf's own dequantization."""
    k = row_length(fmt, 64)
    w = random_tensor(rng, fmt, 10, k)
    tokens = np.array([3, 0, 9, 3], np.int32)
    out = be.zeros((4, k))
    be.embedding(be.linear([w]), tokens, out)
    close(be.download(out), w.dequantize()[tokens], 1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ntok", [3, 6])  # 3: GEMV in two token chunks; 6: the tiled GEMM
def test_matmul(be, rng, fmt, ntok):
    k = row_length(fmt, 64)
    w = random_tensor(rng, fmt, 5, k)
    x = rng.standard_normal((ntok, k)).astype(np.float32)
    base = rng.standard_normal((ntok, 5)).astype(np.float32)
    out = be.upload(base)
    be.matmul(be.upload(x), be.linear([w]), out, accumulate=True)
    close(be.download(out), base + x.astype(np.float64) @ w.dequantize().astype(np.float64).T, 1e-5)


def test_matmul_fused_k_quants_and_legacy_formats(be, rng):
    """A Gemma-style mix in one fused matrix: each part keeps its own format and layout."""
    parts = [random_tensor(rng, f, n, 256) for n, f in ((3, "q5_0"), (2, "q4_k"), (3, "q6_k"), (2, "q8_0"))]
    dense = np.concatenate([p.dequantize() for p in parts]).astype(np.float64)
    lin = be.linear(parts)
    assert [p.family for p in lin.parts] == ["q8", "q4k", "q8h", "q8"]
    for ntok in (1, 6):
        x = rng.standard_normal((ntok, 256)).astype(np.float32)
        out = be.zeros((ntok, 10))
        be.matmul(be.upload(x), lin, out)
        close(be.download(out), x @ dense.T, 1e-5)


def test_matmul_fused_mixed_formats_and_ragged_k(be, rng):
    """q|k|v in different formats write one output; f32 with K not a multiple of the tile (GEMM path)."""
    parts = [QuantTensor.from_float(rng.standard_normal((n, 64)).astype(np.float32), f)
             for n, f in ((4, "q4_1"), (3, "q8_0"), (2, "f16"))]
    x = rng.standard_normal((2, 64)).astype(np.float32)
    out = be.zeros((2, 9))
    be.matmul(be.upload(x), be.linear(parts), out)
    dense = np.concatenate([p.dequantize() for p in parts]).astype(np.float64)
    close(be.download(out), x @ dense.T, 1e-5)
    w = QuantTensor.from_float(rng.standard_normal((7, 40)).astype(np.float32), "f32")
    x = rng.standard_normal((6, 40)).astype(np.float32)
    out = be.zeros((6, 7))
    be.matmul(be.upload(x), be.linear([w]), out)
    close(be.download(out), x.astype(np.float64) @ w.data.astype(np.float64).T, 1e-5)


@pytest.mark.parametrize("dh", [8, 136])
@pytest.mark.parametrize("split", [False, True])
def test_rope_store_kv_and_paged_attention(rng, split, dh):
    """RoPE while K/V are written, then prefill, chunked-prefill and decode attention in one launch; `split`
    forces the context to be split (8 positions a part) and merged by attention_reduce. Heads wider than
    128 (Gemma 3's 256) take the variant with half the rows and chunk."""
    cfg = dataclasses.replace(SIM_CONFIG, sm_count=64) if split else dataclasses.replace(SIM_CONFIG,
                                                                                         attn_min_split=256)
    be = CudaBackend(cfg)
    # A prefill of 5 from position 0, a decode at position 9, a chunk of 3 at positions 4..6.
    s = R.paged_kv_case(rng, [(0, 5), (9, 1), (4, 3)], h=4, hkv=2, dh=dh, bs=4)
    h, hkv, theta = s["h"], s["hkv"], 10000.0
    assert cfg.attention_variant(dh)[2] == (64 if dh <= 64 else launch.MAX_HEAD_DIM)
    nsplit, _ = be.split_plan(5 * hkv, 10)
    assert (nsplit > 1) == split
    qkv, kc, vc = be.upload(s["qkv"]), be.upload(s["kc"]), be.upload(s["vc"])
    cos, sin = be.rope_tables(16, dh, theta)
    be.rope_store_kv(qkv, s["positions"], cos, sin, kc, vc, s["slot"], h, hkv)
    q, k, kref, vref = R.rope_store_kv(s, theta)
    t = len(s["positions"])
    close(be.download(qkv)[:, :(h + hkv) * dh], np.concatenate([q, k], axis=1).reshape(t, -1), 1e-5)
    close(be.download(kc), kref, 1e-5)
    close(be.download(vc), vref, 0)
    out = be.zeros((t, h * dh))
    be.attention(qkv, kc, vc, s["tables"], s["positions"], s["token_seq"], h, hkv, dh ** -0.5, out)
    ref = R.paged_attention(q, kref, vref, s["tables"], s["ctx"], s["qsl"], dh ** -0.5)
    close(be.download(out), ref.reshape(t, -1), 1e-5)


def test_take_rows(be, rng):
    x = rng.standard_normal((5, 7)).astype(np.float32)
    d = be.upload(x)
    idx = np.array([4, 0, 4], np.int32)
    close(be.download(d[idx]), x[idx], 0)
    close(be.download(d[be.upload(idx)]), x[idx], 0)


def _rows(vocab, rng):
    p = SamplingParams
    prompt = list(rng.integers(0, vocab, 6))
    out = list(rng.integers(0, vocab, 4))
    specs = [
        (p(temperature=0.0, logprobs=3), 0),
        (p(temperature=0.0, logit_bias={7: 100.0}), 0),
        (p(temperature=0.8, logprobs=2), 11),
        (p(temperature=1.3, top_k=5), 12),
        (p(temperature=0.7, top_p=0.6), 13),
        (p(temperature=1.0, top_k=40, top_p=0.9, min_p=0.05, logprobs=1), 14),
        (p(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4), 15),
        (p(temperature=0.0, repetition_penalty=1.5, min_tokens=8, stop_token_ids=[int(out[0])]), 16),
    ]
    return [RowSpec(params=sp, seed=seed, step=3, prompt_token_ids=prompt, output_token_ids=out,
                    eos_token_ids=[2]) for sp, seed in specs]


def test_sample_matches_cpu_sampler(be, rng):
    vocab = 200
    rows = _rows(vocab, rng)
    logits = (2.0 * rng.standard_normal((len(rows), vocab))).astype(np.float32)
    batch = SamplingBatch.build(rows)
    want = cpu_sample(logits, batch)
    got = be.sample(be.upload(logits), batch)
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    close(got.logprobs, want.logprobs, 1e-5)
    np.testing.assert_array_equal(got.top_token_ids, want.top_token_ids)
    close(np.where(np.isinf(got.top_logprobs), -1e9, got.top_logprobs),
          np.where(np.isinf(want.top_logprobs), -1e9, want.top_logprobs), 1e-5)


def test_sample_applies_the_allowed_token_mask_like_the_cpu_sampler(be, rng):
    """Constrained rows (their own packed mask row) and free rows in one batch: the device samples what
    the CPU sampler samples, and a constrained row only an allowed token."""
    from tests.test_sampler_allowed_mask import pack, random_allowed
    vocab = 100
    rows = _rows(vocab, rng)
    allowed = random_allowed(rng, len(rows), vocab)
    constrained = [i for i in range(len(rows)) if i % 2 == 0]
    for r, i in enumerate(constrained):
        rows[i].allowed_row = r
    logits = (2.0 * rng.standard_normal((len(rows), vocab))).astype(np.float32)
    for r, i in enumerate(constrained):
        logits[i, ~allowed[r]] += 20.0   # the banned tokens are the likely ones
    batch = SamplingBatch.build(rows, pack(allowed[:len(constrained)]))
    want = cpu_sample(logits, batch)
    got = be.sample(be.upload(logits), batch)
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    close(got.logprobs, want.logprobs, 1e-5)
    assert all(allowed[r, got.token_ids[i]] for r, i in enumerate(constrained))


def test_sample_draws_follow_the_seed():
    """Many seeds: the device draw agrees with the CPU sampler's u(seed, step) inverse CDF."""
    be = CudaBackend(SIM_CONFIG)
    rng = np.random.default_rng(5)
    vocab = 70
    rows = [RowSpec(params=SamplingParams(temperature=1.0), seed=s, step=s % 3) for s in range(12)]
    logits = np.repeat(rng.standard_normal((1, vocab)).astype(np.float32), len(rows), axis=0)
    batch = SamplingBatch.build(rows)
    got = be.sample(be.upload(logits), batch).token_ids
    np.testing.assert_array_equal(got, cpu_sample(logits, batch).token_ids)
    assert len(set(got.tolist())) > 3  # different seeds, different draws


@pytest.mark.parametrize("fmt", ["q4_1", "mixed"])  # the default model's layer format; the others: test_matmul
def test_forward_tiny_llama(fmt):
    """The whole CudaBackend forward (prefill of 6 through the GEMM path, then one decode step through GEMV)
    against tests.reference.forward on a tiny random Llama; `mixed`: a Q4_K_M-style mix of q8_0, q5_0,
    q4_k and q6_k matrices (tests.quant_blocks.MIXED_LAYERS), each linear in its own format."""
    if fmt == "mixed":
        weights = mixed_format_weights(make_tiny_weights(seed=3, fmt="f32", vocab=64, hidden=256, layers=2, heads=2,
                                                         kv_heads=1, ffn=256, tie_embeddings=False))
    else:
        weights = make_tiny_weights(seed=3, fmt=fmt, vocab=64, hidden=32, layers=2, heads=2, kv_heads=1, ffn=64)
    be = CudaBackend(SIM_CONFIG)
    model = LlamaModel(weights, be)
    bs = 4
    kc, vc = model.allocate_kv_cache(num_blocks=4, block_size=bs)
    tokens = np.array([5, 17, 3, 58, 41, 9, 60], np.int32)
    table = np.array([[2, 0, 3]], np.int32)
    ref = R.forward(weights, tokens)

    def step(lo, hi, logits_indices):
        pos = np.arange(lo, hi, dtype=np.int32)
        return StepInput(tokens=tokens[lo:hi], positions=pos, token_seq=np.zeros(hi - lo, np.int32),
                         slot_mapping=table[0, pos // bs].astype(np.int64) * bs + pos % bs, block_tables=table,
                         logits_indices=np.asarray(logits_indices, np.int32))

    logits = be.download(model.forward(step(0, 6, np.arange(6)), kc, vc))
    close(logits, ref[:6], 2e-4)
    up = step(6, 7, [0])
    up = StepInput(*(be.upload(a) for a in (up.tokens, up.positions, up.token_seq, up.slot_mapping,
                                             up.block_tables, up.logits_indices)))  # as the engine's runner does
    logits = be.download(model.forward(up, kc, vc))
    close(logits, ref[6:7], 2e-4)


def test_gpu_check_script_in_the_simulator(tmp_path):
    """cuda/gpu_check/ end to end at tiny sizes (kernel checks, cpu vs cuda, benchmarks, the report), so the
    script that runs once on a GPU has run before."""
    from cuda import gpu_check

    out = tmp_path / "RESULTS.md"
    assert gpu_check.main(["--tiny", "--no-torch", "--out", str(out)]) == 0
    md = out.read_text()
    assert "**Result: passed**" in md and "FAIL" not in md
    for want in ("matmul q4_1 T=1 (gemv)", "paged attention", "split(s) (forced)", "sample: token ids equal",
                 "model: greedy ids equal", "| decode, batch 2", "| prefill, 1 x 5 tokens",
                 "model: greedy ids equal (decode_step vs cpu, float32)", "| 1/1/1; ",
                 "## decode_step: where a step's time goes", "| device: phase qkv tiled |",
                 "model: greedy ids equal (tiled decode_step vs per-op, batch 2)"):
        assert want in md, want
