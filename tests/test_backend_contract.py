"""Both backends implement the written backend contract (engine/backends/contract.py): every op, with the
contract's parameters. The cuda backend's class imports without a driver; an instance needs the simulator."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.backends.contract import Backend

ROOT = Path(__file__).resolve().parents[1]


def _ops(cls) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(cls).items()
            if callable(fn) and not name.startswith("_")}


def _mismatches(impl: type) -> list[str]:
    """Ops of the contract that the class `impl` lacks or takes with other parameters (names, order, defaults)."""
    wrong = []
    for name, want in _ops(Backend).items():
        fn = getattr(impl, name, None)
        if fn is None:
            wrong.append(f"{name}: missing")
            continue
        got = inspect.signature(fn)
        if [(p.name, p.default) for p in got.parameters.values()] != \
                [(p.name, p.default) for p in want.parameters.values()]:
            wrong.append(f"{name}{got} != {name}{want}")
    if not isinstance(getattr(impl, "name", None), str):
        wrong.append("name: missing")
    return wrong


def test_the_contract_lists_the_ops_the_model_and_runner_call():
    assert set(_ops(Backend)) == {
        "linear", "vector", "zeros", "upload", "download", "rope_tables", "share_cpu", "embedding",
        "rmsnorm_matmul", "rope_attention", "matmul", "silu_mul_matmul", "layer_stack", "gemma3_layer_stack", "fused_decode",
        "sample", "scale", "head_rmsnorm", "rmsnorm_add", "gelu_mul_matmul"}
    assert all(inspect.getdoc(getattr(Backend, name)) for name in _ops(Backend))


def test_cpu_backend_satisfies_the_contract():
    from engine.backends.cpu import CpuBackend
    assert _mismatches(CpuBackend) == []
    assert isinstance(CpuBackend(), Backend)


def test_cuda_backend_class_satisfies_the_contract():
    from cuda.backend import CudaBackend
    assert _mismatches(CudaBackend) == []


@pytest.mark.simulator
def test_cuda_backend_instance_satisfies_the_contract():
    """Run in the simulator tier (NUMBA_ENABLE_CUDASIM=1): creating a CudaBackend needs a device."""
    from cuda.backend import CudaBackend
    backend = CudaBackend()
    assert isinstance(backend, Backend) and _mismatches(type(backend)) == []
    assert backend.layer_stack([]) is None and backend.gemma3_layer_stack([], []) is None


def test_importing_sampling_params_does_not_load_numba():
    """The gateway imports SamplingParams: engine.sampling must stay light."""
    code = "import sys, engine.sampling; print('numba' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
