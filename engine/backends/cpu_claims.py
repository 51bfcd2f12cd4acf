"""Work shared out inside one parallel region: items claimed from a phase's counter, and a wait for the
phase's items to be done.

numba forks and joins its threads at every parallel loop (about 1.7 µs with two threads, and the split is
fixed in advance); a batch-1 step of the layer loop has about 150 of them. Instead the threads of one
region go through the step's phases together: each claims a phase's items by an atomic add on the
phase's counter, adds what it finished to the phase's done count, and waits for that count to reach the
phase's items before the next phase. A thread waits only on items another thread has claimed and is
running, so the region finishes however numba hands out its iterations (two threads, or one thread
running them in turn, which then claims every item itself), as long as no thread leaves the region
between a claim and its finish (an exception there, say a failed allocation, would leave the others
waiting).

`counters` is an int64 array of PHASE_STRIDE entries a phase, zeroed, one per region call.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.backends import cpu_isa, cpu_simd
from engine.backends.cpu_cache import flush_stale_caches
from engine.backends.cpu_simd import U, addr

# Steps of at most this many rows (decode batches, short prefill chunks) run their layer loop in one region:
# for more, every thread's own rounding of a product's input costs what the saved forks and joins give back.
CLAIMED_MAX_ROWS = 8
PHASE_STRIDE = 16          # int64s a phase: its claim counter and its done count on cache lines of their own
_DONE = U(64)              # bytes from a phase's claim counter to its done count
_SPINS_BEFORE_YIELD = 4096  # a peer descheduled for longer than this gets the core back (sched_yield)

_I64 = ir.IntType(64)


@intrinsic
def _atomic_add(typingctx, p, v):
    """The int64 at address p plus v, atomically (sequentially consistent); returns the old value."""
    if not (isinstance(p, types.Integer) and isinstance(v, types.Integer)):
        return None

    def cg(context, builder, sig, args):
        return builder.atomic_rmw("add", builder.inttoptr(args[0], _I64.as_pointer()), args[1], "seq_cst")
    return types.int64(types.uint64, types.int64), cg


@intrinsic
def _atomic_load(typingctx, p):
    """The int64 at address p, read with acquire order: what was written before the matching add is seen."""
    if not isinstance(p, types.Integer):
        return None

    def cg(context, builder, sig, args):
        return builder.load_atomic(builder.inttoptr(args[0], _I64.as_pointer()), "acquire", 8)
    return types.int64(types.uint64), cg


@intrinsic
def _spin_hint(typingctx):
    """x86 `pause` / ARM `yield` in a spin loop (no instruction on the portable level)."""
    def cg(context, builder, sig, args):
        if cpu_isa.ISA == "neondot":
            builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(32)]),
                                                        "llvm.aarch64.hint"), [ir.Constant(ir.IntType(32), 1)])
        elif cpu_isa.ISA != "portable":
            builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                        "llvm.x86.sse2.pause"), [])
        return context.get_dummy_value()
    return types.none(), cg


@intrinsic
def _os_yield(typingctx):
    """sched_yield(): the C library's, resolved when the code is linked into the process."""
    def cg(context, builder, sig, args):
        builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []),
                                                    "sched_yield"), [])
        return context.get_dummy_value()
    return types.none(), cg


def phase_counters(n_phases: int) -> np.ndarray:
    return np.zeros(n_phases * PHASE_STRIDE, np.int64)


@njit(cache=True, inline="always")
def claim(counters, phase, n):
    """The first of the next n items of the phase (at or past its item count once all are claimed)."""
    return _atomic_add(addr(counters) + U(8 * PHASE_STRIDE) * U(phase), np.int64(n))


@njit(cache=True, inline="always")
def finish(counters, phase, n):
    """n claimed items of the phase are done (their results written)."""
    _atomic_add(addr(counters) + U(8 * PHASE_STRIDE) * U(phase) + _DONE, np.int64(n))


@njit(cache=True)
def wait(counters, phase, items):
    """Until every one of the phase's items is done."""
    p = addr(counters) + U(8 * PHASE_STRIDE) * U(phase) + _DONE
    spins = 0
    while _atomic_load(p) < items:
        spins += 1
        if spins < _SPINS_BEFORE_YIELD:
            _spin_hint()
        else:
            _os_yield()


@njit(cache=True)
def chunk_of(items, threads):
    """Items a claim takes: about two claims a thread, so that one that started late still gets some."""
    return max(1, (items + 2 * threads - 1) // (2 * threads))


flush_stale_caches(globals(), "cpu_claims", cpu_simd.__file__)
