"""The cuda package without a GPU: imports need no driver, the launch table, the host-side planning of the
backend, the GPU-free parts of gpu_check, and one kernel through the offline compile of compile_check."""
from __future__ import annotations

import dataclasses
import importlib
import os

import numpy as np
import pytest

from cuda import launch

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1",
                                reason="tests the real numba.cuda target (run without NUMBA_ENABLE_CUDASIM)")


def test_import_without_a_driver():
    from numba import cuda

    for mod in ("cuda.backend", "cuda.kernels.common", "cuda.kernels.rowwise", "cuda.kernels.linear",
                "cuda.kernels.attention", "cuda.kernels.sampling", "cuda.compile_check", "cuda.gpu_check"):
        importlib.import_module(mod)
    from cuda.kernels import linear

    # factories build dispatchers lazily, with no signature and no compile
    k = linear.gemm("q4", 64, 64, 32, 4, 4)
    assert k is linear.gemm("q4", 64, 64, 32, 4, 4)
    assert not k.overloads
    if not cuda.is_available():
        from engine.backends import get_backend

        with pytest.raises(RuntimeError, match="no CUDA GPU"):
            get_backend("cuda")


def test_cuda_package_does_not_shadow_cuda_bindings():
    """cuda/ is a namespace package (no __init__.py) shared with NVIDIA's cuda.bindings / cuda.core."""
    import cuda as ns

    assert not hasattr(ns, "__file__") or ns.__file__ is None
    importlib.import_module("cuda.bindings")


@pytest.mark.parametrize("cc, arch", [((9, 0), "sm_90"), ((8, 0), "sm_80"), ((8, 6), "fallback"),
                                      ((8, 9), "fallback"), ((7, 5), "fallback"), ((10, 0), "fallback"),
                                      ((12, 0), "fallback")])
def test_launch_table_picks_the_architecture(cc, arch):
    assert launch.arch_for(cc) == arch
    cfg = launch.select(cc)
    assert cfg.arch == arch and cfg is launch.TABLE[arch]
    assert launch.select(cc, sm_count=77).sm_count == 77


def test_launch_table_rows_are_valid():
    assert set(launch.TABLE) == {"sm_90", "sm_80", "fallback"}
    for cfg in launch.TABLE.values():
        cfg.validate()
    sm90 = launch.TABLE["sm_90"]
    assert sm90.gemm_tile(256, 3072) == (64, 64, 4, 4)   # 48 x 4 blocks: the big tile fills the GPU
    assert sm90.gemm_tile(64, 576) == (32, 32, 2, 2)     # 9 blocks with the big tile: the small one
    bad = dataclasses.replace(launch.TABLE["sm_90"], gemv_threads=96)
    with pytest.raises(ValueError, match="power of two"):
        bad.validate()
    with pytest.raises(ValueError, match="shared memory"):
        dataclasses.replace(launch.TABLE["sm_90"], attn_rows=64).validate()


def test_attention_tiles_and_split_plan():
    from cuda.backend import attention_tiles, split_plan

    # a prefill of 7 (positions 0..6), a decode at 40, a chunk 10..12 of a third sequence
    pos = np.array([0, 1, 2, 3, 4, 5, 6, 40, 10, 11, 12], np.int32)
    seq = np.array([0, 0, 0, 0, 0, 0, 0, 1, 2, 2, 2], np.int32)
    starts, lens, max_ctx = attention_tiles(pos, seq, max_q=3)
    assert starts.tolist() == [0, 3, 6, 7, 8]
    assert lens.tolist() == [3, 3, 1, 1, 3]
    assert max_ctx == 41
    cfg = launch.TABLE["sm_90"]
    assert split_plan(cfg, 1000, 5000) == (1, 5024)          # enough blocks: no split
    assert split_plan(cfg, 3, 200) == (1, 224)               # short context: no split
    n, size = split_plan(cfg, 3, 4000)                        # decode of one sequence, long context
    assert n > 1 and size % cfg.attn_chunk == 0 and size >= cfg.attn_min_split and n * size >= 4000
    assert (n - 1) * size < 4000


def test_gpu_check_helpers():
    from cuda.gpu_check import model_setup as m
    from cuda.gpu_check import roofline as g

    assert g.bandwidth_for("NVIDIA H200")[0] == 4.8e12
    assert g.bandwidth_for("NVIDIA H100 80GB HBM3")[0] == 3.35e12
    assert g.bandwidth_for("NVIDIA A100-SXM4-80GB")[0] == 2.039e12
    bw, src = g.bandwidth_for("Some Future GPU", mem_clock_khz=3_201_000, bus_width_bits=6144)
    assert abs(bw - 4.917e12) < 1e10 and "clock" in src
    assert g.bandwidth_for("Unknown")[0] is None
    assert abs(g.fp32_peak((9, 0), 132, 1_980_000) - 66.9e12) < 0.1e12
    cfg = m.smollm2_135m_config()
    assert g.matmul_params(cfg) == 134_479_872
    assert g.decode_roofline(2, 100, 1000.0) == 20.0
    assert g.decode_roofline(2, 100, None) is None
    # the lower bound wins: memory 2 x 1000 / 100 = 20 tok/s, compute 1000 / (2 x 10) = 50 tok/s, and back
    assert g.decode_roofline(2, 100, 1000.0, peak=1000.0, macs_per_token=10) == 20.0
    assert g.decode_roofline(200, 100, 1000.0, peak=1000.0, macs_per_token=10) == 50.0
    assert g.decode_roofline(2, 100, None, peak=1000.0, macs_per_token=10) == 50.0
    assert m.prefill_groups(5, 128, 256) == [(0, 2), (2, 2), (4, 1)]


def test_gpu_check_batch_layout():
    from cuda.gpu_check.model_setup import BatchLayout

    lay = BatchLayout(batch=3, max_len=40, block_size=16)
    assert lay.tables.shape == (3, 3) and lay.num_blocks == 9
    prompts = np.arange(3 * 5, dtype=np.int32).reshape(3, 5)
    step = lay.prefill(prompts, first=1, count=2)
    assert step.tokens.tolist() == list(range(5, 15))
    assert step.token_seq.tolist() == [0] * 5 + [1] * 5
    assert step.block_tables.tolist() == lay.tables[1:3].tolist()
    assert step.logits_indices.tolist() == [4, 9]
    assert step.slot_mapping.tolist() == [3 * 16 + i for i in range(5)] + [6 * 16 + i for i in range(5)]
    dec = lay.decode(np.array([7, 8, 9]), position=17)
    assert dec.positions.tolist() == [17] * 3
    assert dec.slot_mapping.tolist() == [1 * 16 + 1, 4 * 16 + 1, 7 * 16 + 1]
    slots = np.concatenate([lay.decode(np.zeros(3), p).slot_mapping for p in range(40)])
    assert len(set(slots.tolist())) == 120  # every (sequence, position) its own cache slot


def test_gpu_check_synthetic_model_runs_on_the_cpu_backend():
    from cuda.gpu_check.model_setup import BatchLayout, synthetic_weights
    from engine.backends.cpu import CpuBackend
    from models.config import ModelConfig
    from models.llama import LlamaModel
    from tests import reference as R

    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position=64)
    w = synthetic_weights(cfg)
    assert w.embed.format == "q8_0" and w.layers[0].q.format == "q4_1"
    model = LlamaModel(w, CpuBackend())
    lay = BatchLayout(1, 16)
    kc, vc = model.allocate_kv_cache(lay.num_blocks, lay.block_size)
    ids = np.array([[3, 9, 27, 50]], np.int32)
    step = dataclasses.replace(lay.prefill(ids, 0, 1), logits_indices=np.arange(4, dtype=np.int32))
    np.testing.assert_allclose(model.forward(step, kc, vc), R.forward(w, ids[0]), rtol=1e-3, atol=1e-3)


def test_gpu_check_report():
    from cuda.gpu_check.report import Report

    r = Report()
    r.header.append(("GPU", "test"))
    r.check("a", True, "fine")
    r.bench.append({"name": "decode, batch 1", "ours": 500.0, "roofline": 1000.0, "torch": 250.0})
    r.bench.append({"name": "decode, batch 16", "fused": 800.0, "ours": 500.0, "roofline": 1000.0, "torch": 200.0,
                    "fused_counts": (1, 1, 1), "ours_counts": (280, 9, 2)})
    md = r.markdown()
    assert "**Result: passed**" in md and "| decode, batch 1 | — | 500 | 1,000 | 50.0% | 250 | 2.00x | — |" in md
    assert "| decode, batch 16 | 800 | 500 | 1,000 | 80.0% | 200 | 4.00x | 1/1/1; 280/9/2 |" in md
    r.check("b", False, "broken")
    assert r.failed and "**FAIL**" in r.markdown()


def test_gpu_check_without_a_gpu_says_so(tmp_path):
    from numba import cuda

    from cuda import gpu_check

    if cuda.is_available():
        pytest.skip("a GPU is present")
    out = tmp_path / "RESULTS.md"
    assert gpu_check.main(["--out", str(out)]) == 2
    assert not out.exists()


def test_compile_check_compiles_a_kernel_offline():
    """One kernel through the same path as `make kernels` (numba -> PTX -> nvJitLink/ptxas), for sm_90."""
    from cuda import compile_check as cc

    names = [s.name for s in cc.catalog(launch.TABLE["sm_90"])]
    for want in ("embedding_q4", "rmsnorm", "rope_store_kv", "silu_mul", "gather_rows", "gemv_q4[tok=8,threads=256]",
                 "gemm_q8[64x64x32x4x4]", "paged_attention[rows=16,chunk=32,dh=128]", "attention_reduce",
                 "sample_rows", "decode_step[q8,q4,q4,q4,q4,q8;threads=256,tok=8]",
                 "decode_step[f16,bf16,f32,f16,bf16,f32;threads=256,tok=8]", "decode_phase[q8,q4,q4,q4,q4,q8;threads=256]"):
        assert want in names
    spec = next(s for s in cc.catalog(launch.TABLE["sm_90"]) if s.name == "silu_mul")
    res = cc.check(spec, "sm_90")
    assert res.ok, res.errors   # nvrtc/nvjitlink come with `pip install -e '.[cuda-offline]'` (make install)
    assert res.registers > 0 and res.f64 == 0 and res.spills == 0


@pytest.mark.slow
def test_compile_check_compiles_decode_step_offline():
    """`make kernels` on the persistent kernel: linked with the device runtime (its grid sync), 0 spills, no
    float64, and its registers x threads x blocks per SM within the register file; an impossible row fails."""
    from cuda import compile_check as cc

    default = [s for s in cc.catalog(launch.TABLE["sm_90"]) if s.name.startswith("decode_step[q8,q4,q4,q4,q4,q8;")]
    assert [s.name.rsplit(",", 1)[1] for s in default] == ["tok=8]", "tiled]"]  # the GEMV and the tiled variant
    for spec in default:
        assert spec.cooperative and spec.threads == 256
        res = cc.check(spec, "sm_90")
        assert res.ok, res.errors
        assert res.registers * spec.threads <= cc.REGISTER_FILE and res.spills == 0 and res.f64 == 0
        assert cc.register_file_error(spec, res.registers) is None
    greedy = dataclasses.replace(spec, blocks_per_sm=cc.REGISTER_FILE // (res.registers * spec.threads) + 1)
    assert "exceed the SM's" in cc.register_file_error(greedy, res.registers)


def test_decode_step_plan_and_launch_rows():
    """The decode step's phase plan, its shared memory, and the launch table's decode rows."""
    from cuda.kernels import decode_phases as ph

    plan = ph.phase_plan(2, split=False)
    assert plan.tolist() == [[ph.EMBED, 0], [ph.QKV, 0], [ph.ATTN, 0], [ph.O, 0], [ph.GATE_UP, 0], [ph.DOWN, 0],
                             [ph.QKV, 1], [ph.ATTN, 1], [ph.O, 1], [ph.GATE_UP, 1], [ph.DOWN, 1],
                             [ph.LM_HEAD, 0], [ph.SAMPLE, 0]]
    split = ph.phase_plan(30, split=True)
    assert len(split) == 1 + 30 * 6 + 2 and (split[:, 0] == ph.MERGE).sum() == 30
    tiled = ph.phase_plan(2, split=True, tiled=True)
    assert tiled[:, 0].tolist() == [ph.EMBED] + [ph.QKV_T, ph.ROPE_KV, ph.ATTN, ph.MERGE, ph.O_T, ph.GATE_UP_T,
                                                 ph.SILU, ph.DOWN_T] * 2 + [ph.LM_HEAD_T, ph.SAMPLE]
    assert tiled[:, 1].tolist() == [0] + [0] * 8 + [1] * 8 + [0, 0]
    sm90, sm80 = launch.TABLE["sm_90"], launch.TABLE["sm_80"]
    assert (sm90.decode_threads, sm90.decode_blocks_per_sm) != (sm80.decode_threads, sm80.decode_blocks_per_sm)
    for cfg in launch.TABLE.values():
        spec = ph.DecodeSpec.for_config(cfg, ("q8", "q4", "q4", "q4", "q4", "q8"), head_dim=64)
        assert spec.threads == cfg.decode_threads and spec.dh_max == 64
        assert 4 * (spec.shared_floats + spec.threads + 2) <= launch.STATIC_SHARED_LIMIT
        assert spec.shared_floats >= 2 * spec.tok * spec.threads  # the paired GEMV's two reduction buffers
        bm, bn, tm, tn = spec.gemm_tile
        assert (bm // tm) * (bn // tn) == spec.threads and bm % tm == 0 and bn % tn == 0
        assert spec.shared_floats >= launch.GEMM_BK * (bm + 1 + bn + 1)  # the tiled phases' x and W tiles
    assert ph.DecodeSpec.for_config(sm90, ("f32",) * 6, head_dim=128).dh_max == 128
    with pytest.raises(ValueError, match="bucket"):
        dataclasses.replace(sm90, decode_buckets=()).validate()
