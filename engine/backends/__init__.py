"""Backends: the ops of the backend contract (contract.py) on two targets. `cuda` when a GPU is present, `cpu`
otherwise; either can be forced."""
from __future__ import annotations

import os


def cuda_available() -> bool:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        from numba import cuda
        return bool(cuda.is_available())
    except Exception:  # no driver, no toolkit: the CPU it is
        return False


def backend_name(name: str | None = None) -> str:
    """The backend that `name` ('cpu', 'cuda' or 'auto'; env ZEN_BACKEND when not given) runs on."""
    name = (name or os.environ.get("ZEN_BACKEND") or "auto").lower()
    if name == "auto":
        name = "cuda" if cuda_available() else "cpu"
    return name


def get_backend(name: str | None = None):
    """name: 'cpu', 'cuda' or 'auto' (env ZEN_BACKEND when not given)."""
    name = backend_name(name)
    if name == "cpu":
        from engine.backends.cpu import CpuBackend
        return CpuBackend()
    if name == "cuda":
        if not cuda_available():
            raise RuntimeError("backend 'cuda' was asked for, but no CUDA GPU is available")
        from cuda.backend import CudaBackend
        return CudaBackend()
    raise ValueError(f"unknown backend {name!r} (use cpu, cuda or auto)")
