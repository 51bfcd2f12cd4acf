"""Shared fixtures: a tiny random Llama on disk, and the default model."""
from __future__ import annotations

import os

import pytest

from models.loader import default_model_path
from tests.tiny_model import make_tiny_tokenizer, make_tiny_weights, write_tiny_gguf


# The simulator replaces numba.cuda for the whole process, so its tests run in a process of their own
# (make test-sim); elsewhere their file is not collected at all.
collect_ignore = [] if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else ["test_cuda_kernels.py", "test_gemma3_cuda.py"]


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> str:
    """A 2-layer random Llama (f32) with a byte-level BPE tokenizer, as a GGUF file."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    return write_tiny_gguf(path, make_tiny_weights(seed=1), make_tiny_tokenizer())


@pytest.fixture(scope="session")
def default_model() -> str:
    path = default_model_path()
    if not os.path.exists(path):
        pytest.fail(f"{path} is missing: run `make model` first")
    return path
