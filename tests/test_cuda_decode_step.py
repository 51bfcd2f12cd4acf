"""The fused decode step (cuda/fused_decode.py, cuda/kernels/decode_*.py) against the cpu backend in numba's CUDA
simulator: its phases launched one by one on a grid of several blocks (a kernel boundary standing in for the grid
barrier), and the cooperative decode_step itself on a one-block grid (the simulator's grid sync is a block
barrier only). Hidden states and logits close, the KV cache written the same, greedy ids and seeded samples
equal, on the tiny model and on layers of SmolLM2's head shape (head_dim 64, 3 query heads per KV head), in
every weight format. Tiny shapes: the simulator runs ~1e5 FMA/s.

    NUMBA_ENABLE_CUDASIM=1 python -m pytest -m simulator tests/test_cuda_decode_step.py
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytestmark = pytest.mark.simulator

# tests/conftest.py collects this file only in a process started with NUMBA_ENABLE_CUDASIM=1.
from cuda import launch  # noqa: E402
from cuda.backend import CudaBackend  # noqa: E402
from cuda.fused_decode import FusedDecode  # noqa: E402
from cuda.kernels.decode_phases import phase_plan  # noqa: E402
from engine.backends.cpu import CpuBackend  # noqa: E402
from engine.backends.sampling_batch import RowSpec, SamplingBatch  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from models.llama import LlamaModel, StepInput  # noqa: E402
from tests.quant_blocks import mixed_format_weights  # noqa: E402
from tests.test_cuda_kernels import close, fast_syncthreads  # noqa: E402,F401 (a fixture)
from tests.tiny_model import make_tiny_weights  # noqa: E402

SIM_DECODE = dataclasses.replace(
    launch.TABLE["fallback"], arch="simulator", sm_count=2, threads=32, gemv_threads=64, gemv_tokens=2,
    gemv_max_tokens=4, gemm_tiles=((16, 16, 2, 2),), attn_rows=4, attn_chunk=8, attn_threads=32,
    attn_min_split=8, sample_threads=32, decode_threads=64, decode_blocks_per_sm=1, decode_buckets=(2, 4),
)
# every step of two or more sequences takes the tiled phases (past gemv_max_tokens)
SIM_TILED = dataclasses.replace(SIM_DECODE, gemv_max_tokens=1)
BLOCK = 4
TINY = dict(vocab=64, hidden=32, layers=2, heads=2, kv_heads=1, ffn=64)
SMOL_HEADS = dict(vocab=48, hidden=192, layers=1, heads=3, kv_heads=1, ffn=64, head_dim=64)
KQUANT = dict(vocab=64, hidden=256, layers=2, heads=4, kv_heads=2, ffn=256, tie_embeddings=False)  # rows of 256
# one K-quant format a role, the same in every layer: the layouts q8m (q5_k), q4k (q4_k), q8h (q6_k)
ROLE_KQUANTS = {"q": "q4_k", "k": "q4_k", "v": "q4_k", "o": "q6_k", "gate": "q4_k", "up": "q4_k", "down": "q5_k"}


def _rows(n: int):
    """Greedy rows and seeded draws with the sampler's parameters, one a sequence."""
    p = SamplingParams
    specs = [p(temperature=0.0, logprobs=2), p(temperature=0.9, top_k=8, seed=0),
             p(temperature=1.0, top_p=0.8, min_p=0.02, repetition_penalty=1.2, frequency_penalty=0.3,
               presence_penalty=0.2, logit_bias={3: 2.0}),
             p(temperature=0.0, min_tokens=4, stop_token_ids=[5])]
    return [RowSpec(params=specs[i % len(specs)], seed=1000 + 7 * i, step=2, prompt_token_ids=[1, 2, 3],
                    output_token_ids=[4, 9], eos_token_ids=[2]) for i in range(n)]


class Pair:
    """The same random model on the cpu backend (float32 activations) and on the cuda backend, with paged KV
    caches holding the same prefilled contexts."""

    def __init__(self, fmt: str, shape: dict, ctx_lens: list[int], seed: int, weights=None, config=SIM_DECODE):
        self.weights = make_tiny_weights(seed=seed, fmt=fmt, **shape) if weights is None else weights
        self.cpu = LlamaModel(self.weights, CpuBackend(int8_activations=False))
        self.be = CudaBackend(config)
        self.gpu = LlamaModel(self.weights, self.be)
        cfg = self.cpu.config
        self.rng = np.random.default_rng(seed)
        self.ctx = ctx_lens
        self.tables = np.arange(len(ctx_lens) * 4, dtype=np.int32).reshape(len(ctx_lens), 4)[:, ::-1].copy()
        nblocks = self.tables.size
        self.kc, self.vc = self.cpu.allocate_kv_cache(nblocks, BLOCK)
        # the prefilled contexts: random K/V (what a prefill would have left), the same on both sides
        shape = self.cpu.kv_cache_shape(nblocks, BLOCK)
        self.kc[:] = self.rng.standard_normal(shape).astype(np.float32)
        self.vc[:] = self.rng.standard_normal(shape).astype(np.float32)
        self.gkc, self.gvc = self.be.upload(self.kc.copy()), self.be.upload(self.vc.copy())
        self.vocab = cfg.vocab_size

    def step(self, n: int) -> StepInput:
        pos = np.asarray(self.ctx[:n], np.int32)
        tables = self.tables[:n]
        slots = tables[np.arange(n), pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK
        return StepInput(tokens=self.rng.integers(0, self.vocab, n).astype(np.int32), positions=pos,
                         token_seq=np.arange(n, dtype=np.int32), slot_mapping=slots, block_tables=tables,
                         logits_indices=np.arange(n, dtype=np.int32))

    def allowed(self, rows: int, each: int) -> tuple[np.ndarray, list[set]]:
        """Packed allowed-token masks [rows, ceil(V/32)] of `each` random tokens a row, and those tokens."""
        words = -(-self.vocab // 32)
        sets, masks = [], np.zeros((rows, words * 32), bool)
        for r in range(rows):
            ids = self.rng.choice(self.vocab, each, replace=False)
            masks[r, ids] = True
            sets.append(set(ids.tolist()))
        return np.packbits(masks, axis=1, bitorder="little").view(np.uint32), sets

    def check(self, n: int, mode: str, grid: int | None, constrained: tuple = ()):
        """constrained: the rows sampled under a grammar's allowed-token mask."""
        from engine.backends.cpu_sampler import sample as cpu_sample

        step = self.step(n)
        rows = _rows(n)
        mask, allowed = self.allowed(len(constrained), 10)
        for k, i in enumerate(constrained):
            rows[i] = dataclasses.replace(rows[i], allowed_row=k)
        batch = SamplingBatch.build(rows, mask if constrained else None)
        want_logits = self.cpu.forward(step, self.kc, self.vc)
        want_h = self.cpu._state.h[:n].copy()
        want = cpu_sample(want_logits, batch)
        fused = FusedDecode(self.be, self.gpu, self.gkc, self.gvc, mode=mode, grid=grid)
        got = fused.run(step, batch)
        h = self.be.download(fused.state_arrays[0])[:n]
        logits = self.be.download(fused.state_arrays[4])[:n]
        close(h, want_h, 2e-4)
        close(logits, want_logits, 2e-4)
        close(self.be.download(self.gkc), self.kc, 2e-4)
        close(self.be.download(self.gvc), self.vc, 2e-4)
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
        close(got.logprobs, want.logprobs, 1e-4)
        np.testing.assert_array_equal(got.top_token_ids, want.top_token_ids)
        for k, i in enumerate(constrained):
            assert int(got.token_ids[i]) in allowed[k]
        return fused


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "f16", "bf16", "f32"])
def test_phases_on_many_blocks_match_the_cpu_backend_tiny(fmt):
    """5a: every phase its own launch on 3 blocks (grid-stride loops over more work than blocks)."""
    pair = Pair(fmt, TINY, ctx_lens=[5, 9, 3], seed=11)
    fused = pair.check(3, "phased", grid=3)
    assert fused.counters.uploads == 1 and fused.counters.downloads == 1
    # the contexts (up to 10) are split in two: embed, 6 phases a layer (merge included), lm head, sample
    assert fused.counters.launches == len(phase_plan(2, True)) == 1 + 6 * 2 + 2


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "bf16"])
def test_phases_on_smollm2_head_shape(fmt):
    """5a on a layer of SmolLM2's shape of heads (Dh = 64, GQA 3:1), a context split over the blocks."""
    pair = Pair(fmt, SMOL_HEADS, ctx_lens=[13, 6], seed=5)
    pair.check(2, "phased", grid=2)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "f16"])
def test_tiled_phases_on_many_blocks_match_the_cpu_backend(fmt):
    """Past the GEMV's batch the matmul phases are tiled GEMMs, RoPE + KV write and SiLU phases of their own:
    phase by phase on 3 blocks, against the cpu backend."""
    pair = Pair(fmt, TINY, ctx_lens=[5, 9, 3], seed=12, config=SIM_TILED)
    fused = pair.check(3, "phased", grid=3)
    # embed, 8 phases a layer (qkv, rope_kv, attention, merge, o, gate_up, silu, down), lm head, sample
    assert fused.counters.launches == len(phase_plan(2, True, tiled=True)) == 1 + 8 * 2 + 2


def test_tiled_phases_on_smollm2_head_shape_and_k_quants():
    """The tiled phases on SmolLM2's heads (Dh = 64, GQA 3:1), and on the K-quant layouts a role."""
    Pair("q4_1", SMOL_HEADS, ctx_lens=[13, 6], seed=5, config=SIM_TILED).check(2, "phased", grid=2)
    weights = mixed_format_weights(make_tiny_weights(seed=4, **KQUANT), (ROLE_KQUANTS,), "q5_k", "q6_k")
    Pair("f32", KQUANT, ctx_lens=[6, 11], seed=4, weights=weights, config=SIM_TILED).check(2, "phased", grid=2)


def test_tiled_phases_over_several_token_tiles():
    """10 sequences on 32-thread blocks: token tiles of 8, the second partial."""
    config = dataclasses.replace(SIM_TILED, decode_threads=32, decode_buckets=(12,))
    pair = Pair("q8_0", TINY, ctx_lens=[5, 9, 3, 7, 2, 11, 6, 4, 8, 10], seed=15, config=config)
    fused = pair.check(10, "phased", grid=3)
    assert fused.spec.gemm_tile[0] == 8


def test_cooperative_decode_step_takes_the_tiled_phases_on_one_block():
    pair = Pair("q8_0", TINY, ctx_lens=[7, 2, 9, 4], seed=13, config=SIM_TILED)
    fused = pair.check(4, "cooperative", grid=None)
    assert (fused.counters.launches, fused.counters.uploads, fused.counters.downloads) == (1, 1, 1)


def test_engine_warm_up_runs_each_decode_step_variant():
    """Engine.warm_up runs one step per variant (GEMV, and tiled where a bucket passes gemv_max_tokens), so
    no kernel is built under the first requests."""
    from engine.engine import warm_up_fused

    for config, most, sizes in ((SIM_DECODE, 64, (1,)), (SIM_TILED, 64, (1, 2)), (SIM_TILED, 1, (1,))):
        pair = Pair("q4_1", TINY, ctx_lens=[3, 3], seed=14, config=config)
        fused = FusedDecode(pair.be, pair.gpu, pair.gkc, pair.gvc)
        assert fused.variant_batches(most) == sizes  # most: the scheduler's max_num_seqs
        results = warm_up_fused(fused, most)
        assert [len(r.token_ids) for r in results] == list(sizes)
        assert all(0 <= t < pair.vocab for r in results for t in r.token_ids)


def test_decode_step_takes_the_k_quant_layouts():
    """q4k, q8m and q8h weights (a format per role, the same in every layer) in the fused step, phase by phase
    on 2 blocks, token for token with the cpu backend."""
    weights = mixed_format_weights(make_tiny_weights(seed=4, **KQUANT), (ROLE_KQUANTS,), "q5_k", "q6_k")
    pair = Pair("f32", KQUANT, ctx_lens=[6, 11], seed=4, weights=weights)
    fused = pair.check(2, "phased", grid=2)
    assert fused.spec.families == ("q8m", "q4k", "q8h", "q4k", "q8m", "q8h")


def test_cooperative_decode_step_on_one_block():
    """5b: the persistent kernel itself, grid syncs between its phases, one launch for the whole step."""
    pair = Pair("q4_1", TINY, ctx_lens=[7, 2], seed=3)
    fused = pair.check(2, "cooperative", grid=None)
    assert (fused.counters.launches, fused.counters.uploads, fused.counters.downloads) == (1, 1, 1)


def test_decode_step_samples_inside_the_grammar_masks():
    """Constrained rows beside free ones: the packed allowed-token masks ride in the step's one upload and the
    sampling phase keeps to them, token for token with the cpu sampler."""
    pair = Pair("q8_0", TINY, ctx_lens=[7, 2, 9, 4], seed=6)
    fused = pair.check(4, "cooperative", grid=None, constrained=(0, 2))
    assert (fused.counters.launches, fused.counters.uploads, fused.counters.downloads) == (1, 1, 1)


def test_runner_takes_the_fused_step_for_pure_decode_steps_only():
    """Item 4: the runner gives pure decode steps to the fused step and steps with prompt work to the per-op
    path; a runner without the fused step samples the same tokens step after step."""
    from engine.runner import ModelRunner

    weights = make_tiny_weights(seed=8, fmt="q4_1", **TINY)
    fused_runner = ModelRunner(LlamaModel(weights, CudaBackend(SIM_DECODE)), BLOCK, 12, eos_token_ids=[2])
    plain_runner = ModelRunner(LlamaModel(weights, CudaBackend(SIM_DECODE)), BLOCK, 12, eos_token_ids=[2])
    assert fused_runner.fused_decode is not None
    plain_runner.fused_decode = None  # the per-op path for every step: the fallback
    runs = {"fused": (fused_runner, _sequences()), "plain": (plain_runner, _sequences())}
    tokens = {name: [] for name in runs}
    for step in range(4):
        for name, (runner, seqs) in runs.items():
            scheduled = [(s, s.num_tokens - s.num_computed_tokens) for s in seqs]
            be = runner.backend
            be.counters.reset()
            fused = runner.takes_fused(scheduled)
            assert fused == (name == "fused" and step > 0)  # step 0 prefills the prompts
            sampled, res = runner.execute(scheduled)
            if fused:
                assert be.counters.launches == 0  # the per-op path stayed idle
                counts = runner.fused_decode.counters
                assert (counts.launches, counts.uploads, counts.downloads) == (1, 1, 1)
            else:
                assert be.counters.launches > 10
            tokens[name].append(_advance(scheduled, sampled, res))
    assert tokens["fused"] == tokens["plain"]


def test_a_role_of_mixed_formats_gets_the_per_op_path_with_the_cpu_backends_tokens():
    """A Q4_K_M-style mix (q|k|v and the layers' down matrices in different formats) is declined by the fused
    step; the runner then samples every step through the per-op kernels, token for token with the cpu backend."""
    from cuda.fused_decode import Unsupported
    from engine.runner import ModelRunner

    weights = mixed_format_weights(make_tiny_weights(seed=9, **KQUANT))
    be = CudaBackend(SIM_DECODE)
    model = LlamaModel(weights, be)
    kc, vc = model.allocate_kv_cache(4, BLOCK)
    with pytest.raises(Unsupported, match="one weight format per role"):
        FusedDecode(be, model, kc, vc)
    runners = {"cuda": ModelRunner(model, BLOCK, 12, eos_token_ids=[2]),
               "cpu": ModelRunner(LlamaModel(weights, CpuBackend(int8_activations=False)), BLOCK, 12,
                                  eos_token_ids=[2])}
    assert runners["cuda"].fused_decode is None
    tokens = {}
    for name, runner in runners.items():
        seqs = _sequences()
        tokens[name] = []
        for _ in range(3):
            scheduled = [(s, s.num_tokens - s.num_computed_tokens) for s in seqs]
            assert not runner.takes_fused(scheduled)
            sampled, res = runner.execute(scheduled)
            tokens[name].append(_advance(scheduled, sampled, res))
    assert tokens["cuda"] == tokens["cpu"]


def _sequences():
    """Two sequences, a greedy one and a seeded draw, each with its own 4 KV blocks."""
    from engine.request import EngineRequest
    from engine.sequence import Sequence

    params = [SamplingParams(temperature=0.0, max_tokens=8),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=8)]
    prompts = [[5, 17, 3, 30, 41], [9, 60, 12]]
    seqs = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        s = Sequence(i, EngineRequest(request_id=f"r{i}", model="tiny", prompt_token_ids=p, sampling=sp), 0,
                     seed=77 + i)
        s.block_table = [4 * i + j for j in range(4)]
        seqs.append(s)
    return seqs


def _advance(scheduled, sampled, res) -> list:
    """The step's work marked computed and its sampled tokens appended; returns those tokens."""
    for s, n in scheduled:
        s.num_computed_tokens += n
    for s, t in zip(sampled, res.token_ids):
        s.append_token(int(t))
    return res.token_ids.tolist()


def test_a_released_runner_holds_nothing_on_the_device():
    """An evicted model's GPU memory goes at once: the fused decode's stacked weights and its KV cache
    references go with the runner's own."""
    import gc
    import weakref

    from engine.runner import ModelRunner

    runner = ModelRunner(LlamaModel(make_tiny_weights(seed=3, fmt="f32", **TINY), CudaBackend(SIM_DECODE)),
                         BLOCK, 12, eos_token_ids=[2])
    assert runner.fused_decode is not None
    held = [weakref.ref(runner.k_cache), weakref.ref(runner.v_cache)]
    held += [weakref.ref(w) for w in runner.fused_decode.weights if hasattr(w, "__weakref__")]
    runner.release()
    gc.collect()
    assert [r for r in held if r() is not None] == []
