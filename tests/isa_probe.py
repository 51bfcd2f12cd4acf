"""Compile the CPU kernels for the level and target of this process without running them, and print
their code as JSON {kernel: text}: `python -m tests.isa_probe asm` (machine code) or `... llvm` (LLVM IR).

The ISA tests run it in a subprocess with ZEN_CPU_ISA / NUMBA_CPU_NAME / NUMBA_CPU_FEATURES set, for
targets this machine may not be able to run (AVX-VNNI on a CPU without it, ARM64 through the IR).

ISA_PROBE_TRIPLE=<triple> compiles for another architecture altogether (aarch64-unknown-linux-gnu with
NUMBA_CPU_NAME=neoverse-n1 and NUMBA_CPU_FEATURES=+neon,+dotprod): numba's JIT takes its target from
llvmlite's get_process_triple, which is replaced here before numba builds its code generator; LLVM then
compiles and links (never runs) the kernels as an ARM64 host's numba would.
"""
from __future__ import annotations

import json
import os
import sys

import llvmlite.binding as llvm

if os.environ.get("ISA_PROBE_TRIPLE"):
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    llvm.get_process_triple = lambda: os.environ["ISA_PROBE_TRIPLE"]

from numba import types  # noqa: E402

from engine.backends import cpu_claims, cpu_isa, cpu_attention, cpu_matmul, cpu_transforms  # noqa: E402


def _arr(dtype, ndim):
    return types.Array(dtype, ndim, "C")


_F2 = _arr(types.float32, 2)
# the argument types the backend calls them with (cpu_matmul._rows_*, rows_float; cpu_transforms rows)
_ROWS_I8 = (_arr(types.int8, 3), _F2, _F2, types.uint64, _F2, types.int64, types.int64, types.boolean)
KERNELS = {
    "rows_q4_i8": (cpu_matmul._rows_q4_i8, (_arr(types.uint8, 5), _arr(types.uint16, 4)) + _ROWS_I8),
    "rows_q5_i8": (cpu_matmul._rows_q5_i8, (_arr(types.uint8, 5), _arr(types.uint16, 4)) + _ROWS_I8),
    "rows_q8_i8": (cpu_matmul._rows_q8_i8, (_arr(types.uint8, 5), _arr(types.uint16, 4)) + _ROWS_I8),
    # the K-quants: float32 scales (q4_k, q5_k), and q6_k's scale per 16 values
    "rows_q5k_i8": (cpu_matmul._rows_q5_i8, (_arr(types.uint8, 5), _arr(types.float32, 4)) + _ROWS_I8),
    "rows_q4k_i8": (cpu_matmul._rows_q4_i8, (_arr(types.uint8, 5), _arr(types.float32, 4)) + _ROWS_I8),
    "rows_q8h_i8": (cpu_matmul._rows_q8h_i8, (_arr(types.uint8, 5), _arr(types.float32, 4)) + _ROWS_I8),
    "rows_float": (cpu_matmul.rows_float, (types.int64, _arr(types.float32, 3), types.uint64, _F2, types.uint64,
                                           _F2, types.int64, types.int64, types.boolean)),
    "rmsnorm_row": (cpu_transforms.rmsnorm_row, (types.uint64, types.uint64, types.uint64, types.int64,
                                                 types.float64, types.uint64, types.uint64)),
    "silu_mul_row": (cpu_transforms.silu_mul_row, (types.uint64, types.uint64, types.int64, types.uint64,
                                                   types.uint64)),
    "gelu_mul_row": (cpu_transforms.gelu_mul_row, (types.uint64, types.uint64, types.int64, types.uint64,
                                                   types.uint64)),
    "attention_scores16": (cpu_attention._scores16, (types.uint64,) * 6),
    # one part of a one-token attention split over its keys (its K and V rows read ahead into L2)
    "attention_part": (cpu_attention._attend_part, (types.int64, _F2, _arr(types.float32, 4), _arr(types.float32, 4),
                                              _arr(types.int32, 2), _arr(types.int32, 1), _arr(types.int32, 1),
                                              types.int64, types.int64, types.float32, _arr(types.float32, 3),
                                              types.int64, _arr(types.float32, 1))),
    # the threads' wait inside one parallel region (scalar code: a spin hint, then sched_yield)
    "claims_wait": (cpu_claims.wait, (_arr(types.int64, 1), types.int64, types.int64)),
}


def compiled_code(kind: str) -> dict[str, str]:
    out = {"isa": cpu_isa.ISA}
    for name, (disp, sig) in KERNELS.items():
        disp.compile(sig)
        out[name] = disp.inspect_asm(sig) if kind == "asm" else disp.inspect_llvm(sig)
    return out


if __name__ == "__main__":
    json.dump(compiled_code(sys.argv[1]), sys.stdout)
