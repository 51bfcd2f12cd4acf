"""numba's on-disk cache across modules: kernels compiled from helpers defined in other files, and for
the instruction-set level the process runs at (cpu_isa)."""
from __future__ import annotations

import hashlib
import os

from numba.core.dispatcher import Dispatcher

from engine.backends import cpu_isa


def flush_stale_caches(namespace: dict, tag: str, *sources: str) -> None:
    """numba's on-disk cache checks only the file that defines a function, so kernels built from helpers
    of another module (the SIMD values, say) would keep stale machine code after that module changes.
    Call at the end of the kernels' module: its cached kernels are flushed once whenever `sources` change."""
    disps = [v for v in namespace.values() if isinstance(v, Dispatcher) and hasattr(v._cache, "cache_path")]
    if not disps:
        return
    for d in disps:
        _key_by_isa(d._cache)
    digest = hashlib.sha256()
    for src in (cpu_isa.__file__, *sources):
        with open(src, "rb") as f:
            digest.update(f.read())
    stamp = digest.hexdigest()
    path = os.path.join(disps[0]._cache.cache_path, f"{tag}.deps-stamp")
    try:
        with open(path) as f:
            if f.read() == stamp:
                return
    except OSError:
        pass
    for d in disps:
        d._cache.flush()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(stamp)
    except OSError:  # read-only cache location: flushed again next time, still correct
        pass


def _key_by_isa(cache) -> None:
    """Key each cached kernel on the ISA level too: ZEN_CPU_ISA changes the code for the same CPU (numba keys
    on the CPU name and features only), and each level's code stays cached beside the others."""
    index_key = type(cache)._index_key.__get__(cache)
    cache._index_key = lambda sig, codegen: index_key(sig, codegen) + (cpu_isa.ISA,)
