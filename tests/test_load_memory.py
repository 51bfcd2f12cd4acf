"""Memory after a load: the loaded model keeps no mapping of its file, and the pages malloc keeps after
frees go back to the system (glibc's malloc_trim)."""
from __future__ import annotations

import gc
import platform
import shutil
import subprocess
import sys
import textwrap

import pytest

from engine.heap import release_free_heap
from models.loader import load_model

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
