"""`decode_step`: a whole decode step in one persistent, cooperative launch; and `decode_phase`, one phase of it
per launch (the same device code, cuda/kernels/decode_phases.py).

decode_step walks the step's phase plan (int32 [n, 2] of (phase, layer)) with every block of the grid and
puts `cuda.cg.this_grid().sync()` between phases: all its blocks must be resident at once, so its grid is at
most the driver's cooperative limit (`max_cooperative_grid_blocks`); numba-cuda launches a kernel that
syncs its grid cooperatively. decode_phase runs plan row `step` only: launched once per row, the kernel
boundary is the barrier (the fallback where a cooperative launch is unavailable, and how the simulator, whose
grid sync is only a block barrier, checks the phases on grids of many blocks).

Launch: grid = any number of blocks (decode_step: at most the cooperative limit), block = spec.threads.
Shared: spec.shared_floats + 1 floats, threads + 1 ints (cuda/launch.py checks the 48 KiB static limit).
"""
from __future__ import annotations

import functools

from numba import cuda, float32, int32

from cuda.kernels.decode_phases import DecodeSpec, phases


@functools.lru_cache(maxsize=None)
def decode_step(spec: DecodeSpec):
    run_phase = phases(spec)
    nsmem, threads, tok = spec.shared_floats, spec.threads, spec.tok

    @cuda.jit(fastmath=True)
    def decode_step_kernel(plan, ntok, nsplit, split_size, num_heads, num_kv_heads, scale, eps, inputs, weights,
                           state, outputs):
        """Every (phase, layer) of plan in order, a grid barrier between two."""
        smem = cuda.shared.array(nsmem, float32)
        ibuf = cuda.shared.array(threads, int32)
        found = cuda.shared.array(1, int32)
        acc1 = cuda.local.array(tok, float32)
        acc2 = cuda.local.array(tok, float32)
        grid = cuda.cg.this_grid()
        n = plan.shape[0]
        for s in range(n):
            run_phase(plan[s, 0], plan[s, 1], ntok, nsplit, split_size, num_heads, num_kv_heads, scale, eps,
                      inputs, weights, state, outputs, smem, ibuf, found, acc1, acc2)
            if s + 1 < n:
                grid.sync()  # the next phase reads what every block of this one wrote

    return decode_step_kernel


@functools.lru_cache(maxsize=None)
def decode_phase(spec: DecodeSpec):
    run_phase = phases(spec)
    nsmem, threads, tok = spec.shared_floats, spec.threads, spec.tok

    @cuda.jit(fastmath=True)
    def decode_phase_kernel(plan, step, ntok, nsplit, split_size, num_heads, num_kv_heads, scale, eps, inputs,
                            weights, state, outputs):
        """Row `step` of plan: one phase of the decode step."""
        smem = cuda.shared.array(nsmem, float32)
        ibuf = cuda.shared.array(threads, int32)
        found = cuda.shared.array(1, int32)
        acc1 = cuda.local.array(tok, float32)
        acc2 = cuda.local.array(tok, float32)
        run_phase(plan[step, 0], plan[step, 1], ntok, nsplit, split_size, num_heads, num_kv_heads, scale, eps,
                  inputs, weights, state, outputs, smem, ibuf, found, acc1, acc2)

    return decode_phase_kernel
