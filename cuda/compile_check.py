"""`make kernels`: compile every CUDA kernel offline for sm_80 and sm_90 (no GPU needed) and check it.

For each architecture, every kernel variant its launch-table row (and the fallback row) instantiates is
compiled with the signature the backend launches it with, to PTX by numba/NVVM and on to SASS by nvJitLink
(or ptxas). Prints registers, shared memory, stack and spills per kernel and architecture, and exits 1 on a
compile error, on any spill, on a float64 instruction (every kernel computes in float32), or when a kernel's
registers x threads x the row's blocks per SM exceed the SM's register file. `decode_step`, the persistent
kernel, is listed by that name (with its role formats and tiles); its grid sync lives in the toolkit's
libcudadevrt.a, linked in. It takes ~1-2 minutes a variant on one core: the whole run ~15 minutes on 2 cores.

Needs the wheels nvidia-cuda-nvrtc==13.0.88 and nvidia-nvjitlink==13.0.88 next to a CUDA 13.0 toolkit (NVVM,
libdevice): the `cuda-offline` extra of pyproject.toml.

    python -m cuda.compile_check [--arch sm_90] [--only gemv] [-v]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from numba import cuda, types

from cuda import launch
from cuda.kernels import attention as attn_k
from cuda.kernels import decode_step as step_k
from cuda.kernels import linear as lin_k
from cuda.kernels import rowwise as row_k
from cuda.kernels import sampling as samp_k
from cuda.kernels.common import FAMILIES
from cuda.kernels.decode_phases import DecodeSpec

REGISTER_FILE = 64 * 1024  # 32-bit registers of one SM on sm_80 and sm_90
# decode_step's role formats (embedding, qkv, o, gate_up, down, lm_head): the default model's, every float one,
# and every K-quant layout (q4k, q8m, q8h)
DECODE_FAMILIES = (("q8", "q4", "q4", "q4", "q4", "q8"), ("f16", "bf16", "f32", "f16", "bf16", "f32"),
                   ("q8", "q4k", "q8m", "q4k", "q8h", "q8h"))

ARCHS = {"sm_80": (8, 0), "sm_90": (9, 0)}

# argument types, as the backend passes them (C-contiguous device arrays, int64 ints, float32 scalars)
F32_1 = types.Array(types.float32, 1, "C")
F32_2 = types.Array(types.float32, 2, "C")
F32_4 = types.Array(types.float32, 4, "C")
I32_1 = types.Array(types.int32, 1, "C")
I32_2 = types.Array(types.int32, 2, "C")
I64_1 = types.Array(types.int64, 1, "C")
I64_2 = types.Array(types.int64, 2, "C")
U64_1 = types.Array(types.uint64, 1, "C")
U32_2 = types.Array(types.uint32, 2, "C")
U16_2 = types.Array(types.uint16, 2, "C")
F16_2 = types.Array(types.float16, 2, "C")
INT, F32, BOOL = types.int64, types.float32, types.boolean
F32_5 = types.Array(types.float32, 5, "C")

WEIGHTS = {  # (wa, wb, wc) of each weight family (float families get float16 [1, 1] placeholders)
    "q4": (U32_2, F16_2, F16_2),
    "q4k": (U32_2, F32_2, F32_2),
    "q8": (U32_2, F16_2, F16_2),
    "q8m": (U32_2, F32_2, F32_2),
    "q8h": (U32_2, F32_2, F16_2),
    "f16": (F16_2, F16_2, F16_2),
    "bf16": (U16_2, F16_2, F16_2),
    "f32": (F32_2, F16_2, F16_2),
}


# a role's weights stacked over layers: each of WEIGHTS' arrays with a leading layer axis
STACKED = {fam: tuple(types.Array(a.dtype, 3, "C") for a in arrays) for fam, arrays in WEIGHTS.items()}
# the decode step's argument tuples (cuda/kernels/decode_phases.py lists them)
DECODE_INPUTS = types.Tuple((I32_1, I32_1, I64_1, I32_2, F32_1, F32_1, I32_1, F32_1, F32_1, F32_1, F32_1, U64_1,
                             I64_1, I32_1, I64_1, I32_1, F32_1, I64_1, I32_1, I64_1, I32_1, I32_1, I32_1, U32_2))
DECODE_STATE = types.Tuple((F32_2, F32_2, F32_2, F32_2, F32_2, F32_4, F32_4, F32_2, I32_2, F32_1, F32_1, F32_2))
DECODE_OUTPUTS = types.Tuple((I64_1, F32_1, I64_2, F32_2))


def decode_weights_type(families: tuple) -> types.Tuple:
    f_emb, f_qkv, f_o, f_gu, f_down, f_lm = families
    return types.Tuple((*WEIGHTS[f_emb], F32_2, *STACKED[f_qkv], *STACKED[f_o], F32_2, *STACKED[f_gu],
                        *STACKED[f_down], F32_1, *WEIGHTS[f_lm], F32_2, F32_2, F32_5, F32_5))


def decode_argtypes(spec) -> tuple:
    """Argument types of decode_step and decode_phase for a DecodeSpec."""
    return (I32_2, INT, INT, INT, INT, INT, INT, INT, F32, F32, DECODE_INPUTS, decode_weights_type(spec.families),
                   DECODE_STATE, DECODE_OUTPUTS)


@dataclass
class Spec:
    name: str
    kernel: object
    argtypes: tuple
    cooperative: bool = False   # syncs its grid: linked with the device runtime (libcudadevrt)
    threads: int = 0            # threads per block it is launched with (0: not checked against the register file)
    blocks_per_sm: int = 1      # blocks of it the launch table expects on one SM at once


def catalog(cfg: launch.LaunchConfig, own_row: bool = True) -> list[Spec]:
    """Every kernel variant a backend with this configuration launches, with its argument types (decode_step:
    the default model's formats, and on the architecture's own row a variant with every float format)."""
    specs = []
    for fam in FAMILIES:
        specs.append(Spec(f"embedding_{fam}", row_k.embedding(fam), (I32_1, *WEIGHTS[fam], F32_2)))
    specs += [
        Spec("rmsnorm", row_k.rmsnorm, (F32_2, F32_1, F32, F32_2)),
        Spec("rope_store_kv", row_k.rope_store_kv, (F32_2, I32_1, F32_2, F32_2, F32_4, F32_4, I64_1, INT, INT)),
        Spec("silu_mul", row_k.silu_mul, (F32_2, F32_2)),
        Spec("gather_rows", row_k.gather_rows, (F32_2, I32_1, F32_2)),
        Spec("scale_rows", row_k.scale_rows, (F32_2, F32)),
        Spec("head_rmsnorm", row_k.head_rmsnorm, (F32_2, F32_1, F32_1, INT, INT, F32)),
        Spec("rmsnorm_add", row_k.rmsnorm_add, (F32_2, F32_1, F32, F32_2)),
        Spec("gelu_mul", row_k.gelu_mul, (F32_2, F32_2)),
    ]
    tok, thr = cfg.gemv_tokens, cfg.gemv_threads
    for fam in FAMILIES:
        specs.append(Spec(f"gemv_{fam}[tok={tok},threads={thr}]", lin_k.gemv(fam, tok, thr),
                          (F32_2, *WEIGHTS[fam], F32_2, INT, BOOL)))
    for bm, bn, tm, tn in cfg.gemm_tiles:
        tile = (bm, bn, launch.GEMM_BK, tm, tn)
        for fam in FAMILIES:
            specs.append(Spec(f"gemm_{fam}[{'x'.join(map(str, tile))}]", lin_k.gemm(fam, *tile),
                              (F32_2, *WEIGHTS[fam], F32_2, INT, BOOL)))
    for rows, chunk, dh in (cfg.attention_variant(d) for d in (64, launch.ATTN_HEAD_DIM, launch.MAX_HEAD_DIM)):
        specs.append(Spec(f"paged_attention[rows={rows},chunk={chunk},dh={dh}]",
                          attn_k.paged_attention(rows, chunk, dh),
                          (F32_2, F32_4, F32_4, I32_2, I32_1, I32_1, I32_1, I32_1, INT, INT, F32, INT, INT,
                           F32_2, F32_4, F32_4)))
    for fams in DECODE_FAMILIES if own_row else DECODE_FAMILIES[:1]:
        for tiled in (False, True):  # the GEMV variant and the tiled one (batches past gemv_max_tokens)
            spec = dataclasses.replace(DecodeSpec.for_config(cfg, fams, 64), tiled=tiled)
            tag = f"[{','.join(fams)};threads={spec.threads},{'tiled' if tiled else f'tok={spec.tok}'}]"
            specs.append(Spec(f"decode_step{tag}", step_k.decode_step(spec), decode_argtypes(spec),
                              cooperative=True, threads=spec.threads, blocks_per_sm=cfg.decode_blocks_per_sm))
    if own_row:
        for tiled in (False, True):
            spec = dataclasses.replace(DecodeSpec.for_config(cfg, DECODE_FAMILIES[0], 64), tiled=tiled)
            specs.append(Spec(f"decode_phase[{','.join(spec.families)};threads={spec.threads}"
                              f"{',tiled' if tiled else ''}]", step_k.decode_phase(spec), decode_argtypes(spec),
                              threads=spec.threads))
    specs += [
        Spec("attention_reduce", attn_k.attention_reduce, (F32_4, F32_4, I32_1, INT, F32_2)),
        Spec("sample_rows", samp_k.sample_rows,
             (F32_2, F32_2, I32_2, F32_1, F32_1, I32_1, F32_1, F32_1, F32_1, F32_1, U64_1, I64_1, I32_1,
              I64_1, I32_1, F32_1, I64_1, I32_1, I64_1, I32_1, I32_1, I32_1, U32_2, I64_1, F32_1, I64_2, F32_2)),
    ]
    return specs


@dataclass
class Result:
    registers: int | None = None
    shared: int | None = None
    stack: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    f64: int = 0
    seconds: float = 0.0
    path: str = ""
    errors: list[str] = field(default_factory=list)

    @property
    def spills(self) -> int:
        return (self.spill_stores or 0) + (self.spill_loads or 0)

    @property
    def ok(self) -> bool:
        return not self.errors and self.spills == 0 and self.f64 == 0 and self.registers is not None


class _TargetDevice:
    """Stands in for the current device while compiling offline (device functions ask for its capability)."""

    def __init__(self, cc):
        self.compute_capability = cc


@contextlib.contextmanager
def _offline_target(cc):
    import numba.cuda.compiler as compiler
    import numba.cuda.dispatcher as dispatcher

    saved = dispatcher.get_current_device, compiler.get_current_device
    dispatcher.get_current_device = compiler.get_current_device = lambda: _TargetDevice(cc)
    try:
        yield
    finally:
        dispatcher.get_current_device, compiler.get_current_device = saved


_INFO = {
    "registers": re.compile(r"Used (\d+) registers"),
    "shared": re.compile(r"(\d+) bytes smem"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def _parse_info(log: str, res: Result) -> None:
    for key, rx in _INFO.items():
        vals = [int(v) for v in rx.findall(log)]
        if vals:
            setattr(res, key, max(vals))
    if res.shared is None and res.registers is not None:
        res.shared = 0


def cudadevrt_path() -> str:
    """The toolkit's static device runtime, which a grid-syncing kernel's cudaCGSynchronize calls live in."""
    ptxas = shutil.which("ptxas")
    homes = [os.environ.get("CUDA_HOME"), ptxas and os.path.dirname(os.path.dirname(os.path.realpath(ptxas))),
             "/usr/local/cuda"]
    for home in filter(None, homes):
        for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
            path = os.path.join(home, sub, "libcudadevrt.a")
            if os.path.exists(path):
                return path
    raise RuntimeError("libcudadevrt.a not found in the CUDA toolkit (set CUDA_HOME)")


def _nvjitlink(arch: str, inputs: list[tuple[int, bytes, str]], lto: bool, libraries: tuple = ()) -> str:
    """Link inputs [(InputType, bytes, name)] and static libraries (paths) for arch; returns the info log
    (ptxas resource lines)."""
    from cuda.bindings import nvjitlink

    opts = [f"-arch={arch}", "-verbose"] + (["-lto"] if lto else [])
    handle = nvjitlink.create(len(opts), opts)  # the count must equal len(opts), or the process crashes
    try:
        try:
            for kind, data, name in inputs:
                nvjitlink.add_data(handle, kind, data, len(data), name)
            for path in libraries:
                nvjitlink.add_file(handle, nvjitlink.InputType.LIBRARY, path)
            nvjitlink.complete(handle)
        except Exception as e:
            n = nvjitlink.get_error_log_size(handle)
            log = bytearray(n)
            if n:
                nvjitlink.get_error_log(handle, log)
            raise RuntimeError(f"nvJitLink: {e}: {bytes(log).decode(errors='replace').strip()}") from None
        n = nvjitlink.get_info_log_size(handle)
        log = bytearray(n)
        if n:
            nvjitlink.get_info_log(handle, log)
        return bytes(log).decode(errors="replace")
    finally:
        nvjitlink.destroy(handle)


def _ptxas(arch: str, ptx: str) -> str:
    exe = shutil.which("ptxas") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        p = subprocess.run([exe, f"-arch={arch}", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(p.stderr.strip())
    return p.stderr


F64_RX = re.compile(r"\.f64\b")


def check(spec: Spec, arch: str) -> Result:
    cc = ARCHS[arch]
    res = Result()
    t0 = time.perf_counter()
    opts = getattr(spec.kernel, "targetoptions", {}) or {}
    fastmath = bool(opts.get("fastmath", False))
    try:
        with _offline_target(cc):
            ptx, _ = cuda.compile_ptx(spec.kernel.py_func, spec.argtypes, cc=cc, fastmath=fastmath)
            res.f64 = len(F64_RX.findall(ptx))
            libs = (cudadevrt_path(),) if spec.cooperative else ()
            try:
                log, res.path = _link_ptx(arch, ptx, libs), "ptx"
            except RuntimeError as e:
                if "nresolved extern" not in str(e) and "undefined" not in str(e).lower():
                    raise
                # float16 helpers come from NVRTC: link the LTO-IR of the kernel and its helpers instead
                codes, _ = cuda.compile_all(spec.kernel.py_func, spec.argtypes, device=False, abi="numba", cc=cc,
                                            fastmath=fastmath, output="ltoir")
                from cuda.bindings import nvjitlink

                inputs = []
                for i, code in enumerate(codes):
                    data = bytes(getattr(code, "code", None) or getattr(code, "data", None) or code)
                    inputs.append((nvjitlink.InputType.LTOIR, data, f"part{i}"))
                log, res.path = _nvjitlink(arch, inputs, lto=True, libraries=libs), "ltoir"
        _parse_info(log, res)
        if res.registers is None:
            res.errors.append("no resource usage in the link log")
        elif register_file_error(spec, res.registers):
            res.errors.append(register_file_error(spec, res.registers))
    except Exception as e:  # a compile error of one kernel must not hide the others
        res.errors.append(f"{type(e).__name__}: {e}")
    res.seconds = time.perf_counter() - t0
    return res


def register_file_error(spec: Spec, registers: int) -> str | None:
    """Why the launch table's blocks of this kernel cannot be resident on one SM at once, or None."""
    if spec.threads and registers * spec.threads * spec.blocks_per_sm > REGISTER_FILE:
        return (f"{registers} registers x {spec.threads} threads x {spec.blocks_per_sm} block(s) exceed the SM's "
                f"{REGISTER_FILE} registers")
    return None


def _link_ptx(arch: str, ptx: str, libraries: tuple = ()) -> str:
    try:
        from cuda.bindings import nvjitlink
    except ImportError:
        if libraries:
            raise
        return _ptxas(arch, ptx)
    data = ptx.encode()
    return _nvjitlink(arch, [(nvjitlink.InputType.PTX, data, "kernel.ptx")], lto=False, libraries=libraries)


def _fmt(r: Result | None) -> str:
    if r is None:
        return "-"
    if r.errors:
        return "ERROR"
    s = f"{r.registers:>3} reg {r.shared:>6} B smem"
    if r.stack:
        s += f" {r.stack} B stack"
    s += f" {r.spills} spill"
    if r.f64:
        s += f" {r.f64} f64!"
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", choices=sorted(ARCHS), help="architecture(s) to check (default: all)")
    ap.add_argument("--only", help="check only kernels whose name contains this")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each kernel as it compiles")
    args = ap.parse_args(argv)
    archs = args.arch or sorted(ARCHS)
    if cuda.is_available():
        print("note: a GPU is present; compiling offline anyway")

    results: dict[str, dict[str, Result]] = {}
    t0 = time.perf_counter()
    for arch in archs:
        seen = set()
        for row in (arch, "fallback"):
            for spec in catalog(launch.TABLE[row], own_row=row == arch):
                if spec.name in seen or (args.only and args.only not in spec.name):
                    continue
                seen.add(spec.name)
                r = check(spec, arch)
                results.setdefault(spec.name, {})[arch] = r
                if args.verbose:
                    print(f"  {arch} {spec.name}: {_fmt(r)} ({r.seconds:.1f} s)", flush=True)

    width = max(len(n) for n in results) if results else 10
    print(f"\n{'kernel':<{width}}  " + "  ".join(f"{a:<44}" for a in archs))
    for name, per_arch in results.items():
        print(f"{name:<{width}}  " + "  ".join(f"{_fmt(per_arch.get(a)):<44}" for a in archs))
    bad = [(n, a, r) for n, pa in results.items() for a, r in pa.items() if not r.ok]
    print(f"\n{sum(len(v) for v in results.values())} compiles in {time.perf_counter() - t0:.0f} s")
    for name, arch, r in bad:
        why = r.errors or ([f"{r.spills} bytes of spills"] if r.spills else []) + (
            [f"{r.f64} float64 instructions"] if r.f64 else [])
        print(f"FAIL {arch} {name}: {'; '.join(why)}")
    if bad:
        return 1
    print("all kernels compile for " + ", ".join(archs) + " with 0 spills and no float64")
    return 0


if __name__ == "__main__":
    sys.exit(main())
