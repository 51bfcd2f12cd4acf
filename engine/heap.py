"""Giving the C heap's freed pages back to the system once a model is loaded.

A load reads the GGUF's tensors, repacks them into the backend's layout and drops the originals; glibc's
malloc keeps most of what was freed in the process (holes below live blocks, in the load thread's own
arena), so a node's resident memory stays well above what its models hold until the memory is reused
(docs/performance.md, "Memory after a load"). malloc_trim(0) returns the free pages of every arena.
"""
from __future__ import annotations

import ctypes


def _malloc_trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):   # not glibc (musl, macOS): their allocators return memory themselves
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _malloc_trim()


def release_free_heap() -> bool:
    """Hand the heap's free pages back to the system; False where the C library has no malloc_trim."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True
