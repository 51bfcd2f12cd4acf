"""Memory after a load: the loaded model keeps no mapping of its file, and the pages malloc keeps after
frees go back to the system (glibc's malloc_trim)."""
from __future__ import annotations

import dataclasses
import gc
import platform
import shutil
import subprocess
import sys
import textwrap

import pytest

from engine.heap import release_free_heap
from models.loader import load_model
from tests.tiny_model import make_tiny_tokenizer, make_tiny_weights, write_tiny_gguf

# In a fresh interpreter: 1000 blocks of 64 KiB (below glibc's mmap threshold: they come from the heap),
# each followed by a small live block so that their holes cannot merge into the heap's top and be trimmed
# by free() itself; all written, then the large ones freed. Prints resident MiB before and after the call.
_FRAGMENTED_HEAP = textwrap.dedent("""
    import ctypes, re
    from engine.heap import release_free_heap

    def rss_mib():
        status = open("/proc/self/status").read()
        return int(re.search(r"^VmRSS:\\s+(\\d+)", status, re.M).group(1)) / 1024

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    big, small = [], []
    for _ in range(1000):
        big.append(libc.malloc(64 * 1024))
        small.append(libc.malloc(32))
    for p in big:
        ctypes.memset(p, 1, 64 * 1024)
    for p in big:
        libc.free(p)
    before = rss_mib()
    called = release_free_heap()
    print(called, before, rss_mib())
""")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_heap_pages_go_back_to_the_system():
    assert release_free_heap() is True
    out = subprocess.run([sys.executable, "-c", _FRAGMENTED_HEAP], capture_output=True, text=True, check=True)
    called, before, after = out.stdout.split()
    assert called == "True"
    assert float(before) - float(after) > 40            # of the ~62 MiB freed; without the call: none


def test_a_loaded_model_keeps_no_mapping_of_its_file(tiny_gguf, tmp_path):
    """Once the loader's weights (views of the file) are dropped, nothing keeps the file mapped: the GGUF
    reader in a reference cycle would wait for a collection (which the node's gc.freeze() after a load
    defers to an eviction), keeping every page the load read resident."""
    path = str(shutil.copy(tiny_gguf, tmp_path / "own-copy.gguf"))
    gc.disable()                                          # freed by reference counts alone
    try:
        weights, tokenizer = load_model(path)
        assert weights.config.num_layers > 0 and tokenizer.vocab_size > 0
        del weights
        with open("/proc/self/maps") as maps:
            mapped = path in maps.read()
    finally:
        gc.enable()
    assert not mapped


def test_a_failed_load_keeps_no_mapping_of_its_file(tmp_path, monkeypatch):
    """The registry keeps a failed load's message, not its exception: the traceback holds the load's frame,
    which holds the job, a cycle keeping the file's mapping and the weights read until a collection."""
    from engine.config import EngineConfig
    from engine.node import registry
    from engine.node.config import ModelSpec

    w = make_tiny_weights(seed=1, layers=2)
    w.config = dataclasses.replace(w.config, num_layers=3)   # blk.2's tensors are missing
    path = write_tiny_gguf(tmp_path / "missing-layer.gguf", w, make_tiny_tokenizer())
    # pytest keeps every log record, with its exception: a production log handler formats it and lets go
    monkeypatch.setattr(registry.log, "disabled", True)
    reg = registry.ModelRegistry([ModelSpec(path, "bad")], 1 << 30, lambda spec, fmt: EngineConfig(
        model=spec.path, model_id=spec.id, backend="cpu", kv_cache_bytes=1 << 22))
    gc.disable()                                          # freed by reference counts alone
    try:
        with pytest.raises(registry.ModelUnavailable, match="blk.2.attn_norm.weight is missing"):
            reg.load("bad", None, wait_s=60)
        with open("/proc/self/maps") as maps:
            mapped = path in maps.read()
    finally:
        gc.enable()
        reg.close()
    assert not mapped
