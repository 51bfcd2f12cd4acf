"""`decode_step`: a whole decode step in one persistent, cooperative launch; and `decode_phase`, one phase of it
per launch (the same device code, cuda/kernels/decode_phases.py).

Both are one kernel body (`_decode_kernel`) that runs rows first..last-1 of the step's phase plan (int32
[n, 2] of (phase, layer)) with every block of the grid. decode_step puts `cuda.cg.this_grid().sync()`
between phases: all its blocks must be resident at once, so its grid is at
most the driver's cooperative limit (`max_cooperative_grid_blocks`); numba-cuda launches a kernel that
syncs its grid cooperatively. decode_phase is compiled without the grid sync and launched once per row: the
kernel boundary is the barrier (the fallback where a cooperative launch is unavailable, and how the simulator, whose
grid sync is only a block barrier, checks the phases on grids of many blocks).

Launch: grid = any number of blocks (decode_step: at most the cooperative limit), block = spec.threads.
Shared: spec.shared_floats + 1 floats, threads + 1 ints (cuda/launch.py checks the 48 KiB static limit).
"""
from __future__ import annotations

import functools

from numba import cuda, float32, int32

from cuda.kernels.decode_phases import DecodeSpec, phases


@functools.lru_cache(maxsize=None)
def _decode_kernel(spec: DecodeSpec, persistent: bool):
    run_phase = phases(spec)
    nsmem, threads, tok = spec.shared_floats, spec.threads, spec.tok
    tm, tn = spec.gemm_tile[2:]
    tile_size = tm * tn  # a local array's size must be a constant of the closure

    @cuda.jit(fastmath=True)
    def decode_kernel(plan, first, last, ntok, nsplit, split_size, num_heads, num_kv_heads, scale, eps, inputs,
                      weights, state, outputs):
        """Rows first..last-1 of plan in order; persistent: a grid barrier between two."""
        smem = cuda.shared.array(nsmem, float32)
        ibuf = cuda.shared.array(threads, int32)
        found = cuda.shared.array(1, int32)
        acc1 = cuda.local.array(tok, float32)
        acc2 = cuda.local.array(tok, float32)
        tacc = cuda.local.array(tile_size, float32)  # the tiled phases' register tile
        av = cuda.local.array(tm, float32)
        bv = cuda.local.array(tn, float32)
        for s in range(first, last):
            run_phase(plan[s, 0], plan[s, 1], ntok, nsplit, split_size, num_heads, num_kv_heads, scale, eps,
                      inputs, weights, state, outputs, smem, ibuf, found, acc1, acc2, tacc, av, bv)
            if persistent and s + 1 < last:
                cuda.cg.this_grid().sync()  # the next phase reads what every block of this one wrote

    return decode_kernel


def decode_step(spec: DecodeSpec):
    """The persistent kernel: launched cooperatively with (plan, 0, len(plan), ...), the whole step."""
    return _decode_kernel(spec, True)


def decode_phase(spec: DecodeSpec):
    """The same phases without grid barriers: launched with (plan, s, s + 1, ...), one phase a launch."""
    return _decode_kernel(spec, False)
