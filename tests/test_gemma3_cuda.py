"""Gemma 3's forward pass on the cuda backend, in numba's CUDA simulator (tiny shapes): the ops Gemma adds
and the sliding window, against tests/reference.py's gemma3_forward.

Run in their own process: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -m simulator tests/test_gemma3_cuda.py
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.simulator

# tests/conftest.py collects this file only in a process started with NUMBA_ENABLE_CUDASIM=1.
from cuda.backend import CudaBackend  # noqa: E402
from models.gemma3 import Gemma3Model  # noqa: E402
from models.llama import StepInput  # noqa: E402
from tests import reference as R  # noqa: E402
from tests.test_cuda_kernels import SIM_CONFIG  # noqa: E402
from tests.tiny_gemma import make_tiny_gemma_weights  # noqa: E402


def test_forward_tiny_gemma_across_the_window():
    """A prefill of 6 (GEMM path) then two decode steps (GEMV path), window 3: the local layers' last
    queries see only part of the context, each layer group through its own block table. Three layers, every
    third global (two local groups and the global one): each simulated thread is a Python thread."""
    weights = make_tiny_gemma_weights(seed=4, hidden=32, heads=2, kv_heads=1, head_dim=16, ffn=48, window=3,
                                      layers=3, pattern=3)
    be = CudaBackend(SIM_CONFIG)
    model = Gemma3Model(weights, be)
    assert model.window_groups == 2
    bs, groups = 4, 3
    kc, vc = model.allocate_kv_cache(num_blocks=2 * groups + 1, block_size=bs)
    tables = np.random.default_rng(0).permutation(2 * groups + 1)[:2 * groups].astype(np.int32)
    tables = tables.reshape(groups, 1, 2)
    tokens = np.array([2, 17, 300, 58, 41, 9, 60, 7], np.int32)
    ref = R.gemma3_forward(weights, tokens)

    def step(lo, hi):
        pos = np.arange(lo, hi, dtype=np.int32)
        slots = tables[:, 0, pos // bs].astype(np.int64) * bs + pos % bs
        s = StepInput(tokens[lo:hi], pos, np.zeros(hi - lo, np.int32), slots[0], tables[0],
                      np.arange(hi - lo, dtype=np.int32), slots[1:], tables[1:])
        return StepInput(*(be.upload(np.ascontiguousarray(a)) for a in s.arrays()))

    for lo, hi in ((0, 6), (6, 7), (7, 8)):
        logits = be.download(model.forward(step(lo, hi), kc, vc))
        np.testing.assert_allclose(logits, ref[lo:hi], rtol=2e-4, atol=2e-4 * np.abs(ref).max())


def test_gemma_takes_the_per_op_path_for_decode_steps():
    """The fused decode step runs the Llama layer without a window: a Gemma model gets none, so the runner
    serves its decode steps per op (window mask, Gemma's norms)."""
    from tests.test_cuda_decode_step import SIM_DECODE

    weights = make_tiny_gemma_weights(seed=4, hidden=32, heads=2, kv_heads=1, head_dim=16, ffn=48, window=3)
    be = CudaBackend(SIM_DECODE)
    model = Gemma3Model(weights, be)
    kc, vc = model.allocate_kv_cache(num_blocks=8, block_size=4)
    assert be.cooperative_launch() and be.fused_decode(model, kc, vc) is None
