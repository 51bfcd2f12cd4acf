"""The instruction-set levels of the CPU kernels (engine/backends/cpu_isa.py): how a level is chosen, each
level the host can run against the float64 reference, and the levels it cannot run compiled for their
targets (AVX-VNNI's VEX vpdpbusd through NUMBA_CPU_NAME=alderlake; ARM64's NEON sdot through numba's JIT
retargeted to aarch64, and the portable IR compiled for ARM64).

numba compiles once per process, so every level runs in a subprocess of its own with ZEN_CPU_ISA set.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.backends import cpu_isa

ROOT = Path(__file__).resolve().parents[1]
# the target CPU each level is compiled for where this host can run it (avx2: the code an AVX2-only
# machine gets, no 512-bit registers); the rest use the host's
RUN_TARGET = {"avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx2,+fma,+f16c"}}
ALDERLAKE = {"NUMBA_CPU_NAME": "alderlake",
             "NUMBA_CPU_FEATURES": "+avx2,+fma,+f16c,+avxvnni,-avx512f,-avx512bw,-avx512vl,-avx512vnni"}
# Graviton 2 (Neoverse N1: NEON with the dot-product extension), compiled in this process's numba for aarch64
NEOVERSE_N1 = {"ISA_PROBE_TRIPLE": "aarch64-unknown-linux-gnu", "NUMBA_CPU_NAME": "neoverse-n1",
               "NUMBA_CPU_FEATURES": "+neon,+dotprod,+fp-armv8"}
HOST_LEVELS = [level for level in cpu_isa.LEVELS if cpu_isa.runs(level, cpu_isa.FEATURES)]
# the int8 and float kernel tests of test_cpu_kernels, and the real model's logits (slow)
KERNEL_TESTS = ("matmul_every_format or fused_parts or matmul_with_fused or rmsnorm_and_silu or paged_attention "
                "or tiny_model_forward or real_model")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ZEN_CPU_ISA", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _probe(kind: str, env: dict, tmp_path) -> dict[str, str]:
    """The kernels' code, compiled (never run) in a subprocess with env; a fresh numba cache."""
    r = subprocess.run([sys.executable, "-m", "tests.isa_probe", kind], cwd=ROOT, capture_output=True, text=True,
                       env={**env, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


# ------------------------------------------------------------------------------------ choosing the level
def test_best_level_from_features():
    assert cpu_isa.best_level({"avx512f", "avx512bw", "avx512vnni", "avx2", "fma"}) == "avx512vnni"
    assert cpu_isa.best_level({"avx2", "fma", "avxvnni"}) == "avxvnni"
    assert cpu_isa.best_level({"avx512f", "avx512bw", "avx2", "fma"}) == "avx2"  # AVX-512 without VNNI
    assert cpu_isa.runs("avxvnni", {"avx2", "avx512vl", "avx512vnni", "fma"})  # EVEX form of the same dot
    assert cpu_isa.best_level({"avx2", "fma"}) == "avx2"
    assert cpu_isa.best_level({"avx", "sse4.2"}) == "portable"
    assert cpu_isa.best_level({"neon", "dotprod", "fp-armv8"}) == "neondot"
    assert cpu_isa.best_level({"neon", "fp-armv8"}) == "portable"  # ARMv8.0 (Cortex-A72, Graviton 1)


def test_override_picks_a_lower_level_and_refuses_a_higher_or_unknown_one():
    avx512 = {"avx512f", "avx512bw", "avx512vnni", "avx2", "fma"}
    assert cpu_isa.select_level(avx512, None) == "avx512vnni"
    assert cpu_isa.select_level(avx512, "avx2") == "avx2"
    assert cpu_isa.select_level(avx512, "portable") == "portable"
    with pytest.raises(ValueError, match="lacks"):
        cpu_isa.select_level({"avx2", "fma"}, "avxvnni")
    with pytest.raises(ValueError, match="expected one of"):
        cpu_isa.select_level(avx512, "sse9")


def test_level_is_the_override_and_int8_follows_it():
    """Run in each level's subprocess below: the process runs at the level it was asked for."""
    want = os.environ.get("ZEN_CPU_ISA") or cpu_isa.best_level(cpu_isa.FEATURES)
    assert cpu_isa.ISA == want
    assert cpu_isa.INT8_DEFAULT == (want != "portable" and os.environ.get("ZEN_CPU_INT8", "1") != "0")


def test_an_impossible_override_stops_the_import():
    r = subprocess.run([sys.executable, "-c", "import engine.backends.cpu_isa"], cwd=ROOT, capture_output=True,
                       text=True, env=_env(ZEN_CPU_ISA="avxvnni", NUMBA_CPU_FEATURES="+avx2,+fma"))
    assert r.returncode != 0 and "ZEN_CPU_ISA=avxvnni" in r.stderr


# ----------------------------------------------------------------------- each level the host runs
@pytest.mark.slow
@pytest.mark.parametrize("level", HOST_LEVELS)
def test_level_matches_the_reference(level):
    """test_cpu_kernels' int8, float and attention tests (float64 reference, their tolerances) at one level
    this host runs (avxvnni through EVEX vpdpbusd where the CPU has AVX-512 VNNI and VL but no AVX-VNNI)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not simulator and not fault",
           "tests/test_cpu_isa.py::test_level_is_the_override_and_int8_follows_it", "tests/test_cpu_kernels.py",
           "-k", f"level_is_the_override or {KERNEL_TESTS}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3000,
                       env=_env(ZEN_CPU_ISA=level, **RUN_TARGET.get(level, {})))
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]  # 0: tests ran and every one passed


# --------------------------------------------------------------- the levels compiled for their targets
@pytest.mark.slow
def test_avxvnni_compiles_to_vex_vpdpbusd_on_ymm(tmp_path):
    """Alder Lake: vpdpbusd on 256-bit registers in its VEX form ({vex}; no EVEX-only zmm), never run here."""
    code = _probe("asm", _env(**ALDERLAKE), tmp_path)
    assert code["isa"] == "avxvnni"
    for name in ("rows_q4_i8", "rows_q5_i8", "rows_q8_i8", "rows_q4k_i8", "rows_q5k_i8", "rows_q8h_i8"):
        dots = [line for line in code[name].splitlines() if "vpdpbusd" in line]
        assert dots, f"{name}: no vpdpbusd"
        assert all("{vex}" in line and "%ymm" in line for line in dots), f"{name}: {dots[:3]}"
        assert "%zmm" not in code[name] and "vpmaddubsw" not in code[name]


@pytest.mark.slow
def test_avx2_compiles_to_vpmaddubsw_on_ymm(tmp_path):
    """Haswell (AVX2, no VNNI): vpmaddubsw + vpmaddwd on 256-bit registers; byte codes (q8, q6_k) also
    zero-extended to 16 bits for vpmaddwd against both activation planes at once."""
    code = _probe("asm", _env(ZEN_CPU_ISA="avx2", **RUN_TARGET["avx2"]), tmp_path)
    assert code["isa"] == "avx2"
    for name in ("rows_q4_i8", "rows_q5_i8", "rows_q8_i8", "rows_q4k_i8", "rows_q5k_i8", "rows_q8h_i8"):
        assert re.search(r"vpmaddubsw\s+%ymm", code[name]) and re.search(r"vpmaddwd\s+", code[name]), name
        assert "vpdpbusd" not in code[name] and "%zmm" not in code[name]
    for name in ("rows_q8_i8", "rows_q8h_i8"):   # byte codes: widened for one int16 dot of both planes
        assert re.search(r"vpmovzxbw\s+", code[name]), name
    for name in ("rows_q4_i8", "rows_q5_i8", "attention_part"):   # read ahead into L2 (cpu_int8.PREFETCH_AHEAD; K, V)
        assert re.search(r"\bprefetcht1\s", code[name]), name
    assert re.search(r"\bpause\b", code["claims_wait"]) and "sched_yield" in code["claims_wait"]


@pytest.mark.slow
def test_neondot_compiles_to_sdot_for_arm64(tmp_path):
    """Neoverse N1: the int8 kernels' dots are NEON sdot on 128-bit registers (4 per 16-lane value), the
    float kernels fused fmla; no x86 register anywhere."""
    code = _probe("asm", _env(**NEOVERSE_N1), tmp_path)
    assert code.pop("isa") == "neondot"
    for name in ("rows_q4_i8", "rows_q5_i8", "rows_q8_i8"):
        assert re.search(r"\bsdot\s+v\d+\.4s, v\d+\.16b, v\d+\.16b", code[name]), name
        assert "llvm.aarch64" not in code[name]        # every intrinsic became an instruction
    for name in ("rows_q4_i8", "rows_q5_i8", "attention_part"):   # their codes (and K, V) read ahead into L2
        assert re.search(r"\bprfm\s+pldl2keep", code[name]), name
    # q4's and q5's codes are below 128: one sdot per 4 bytes; q8's unsigned bytes take a second sdot (128 * b)
    assert re.search(r"\beor\s+v\d+\.16b", code["rows_q8_i8"])
    assert not re.search(r"\beor\s+v\d+\.16b", code["rows_q4_i8"])
    assert not re.search(r"\beor\s+v\d+\.16b", code["rows_q5_i8"])
    spin = code.pop("claims_wait")                     # scalar: ARM's spin hint, then sched_yield
    assert re.search(r"\byield\b", spin) and "sched_yield" in spin and not re.search(r"%[xyz]mm\d|pause", spin)
    for name, asm in code.items():
        assert not re.search(r"%[xyz]mm\d", asm), name
        assert re.search(r"\bv\d+\.(4s|16b|8h)", asm), f"{name}: no NEON vector instruction"
    assert re.search(r"\bfmla\s+v\d+\.4s", code["rows_float"])


@pytest.mark.slow
def test_portable_ir_compiles_for_arm64(tmp_path):
    """The portable kernels' LLVM IR (numba's, for this host) retargeted to aarch64: no x86 intrinsic, and
    LLVM's AArch64 back end emits NEON vector code for every kernel."""
    import llvmlite.binding as llvm

    # unoptimized IR: numba's x86 pipeline turns NRT's atomic decrement into llvm.x86.atomic.sub.cc
    code = _probe("llvm", _env(ZEN_CPU_ISA="portable", NUMBA_OPT="0"), tmp_path)
    assert code.pop("isa") == "portable"
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    tm = llvm.Target.from_triple("aarch64-unknown-linux-gnu").create_target_machine(
        cpu="neoverse-n1", features="+neon,+dotprod", opt=2)
    asm = {}
    for name, ir_text in code.items():
        assert "llvm.x86" not in ir_text, name
        mod = llvm.parse_assembly(_retarget(ir_text))
        mod.triple, mod.data_layout = "aarch64-unknown-linux-gnu", str(tm.target_data)
        mod.verify()
        asm[name] = tm.emit_assembly(mod)
        if name == "claims_wait":                      # scalar code, no spin hint on the portable level
            continue
        assert re.search(r"\bv\d+\.(4s|16b|8h)", asm[name]), f"{name}: no NEON vector instruction"
        assert not re.search(r"%[xyz]mm\d", asm[name]), name
    assert re.search(r"\bfmla\s+v\d+\.4s", asm["rows_float"])  # the float kernels' multiply-add, fused


def _retarget(ir_text: str) -> str:
    """numba's module without what ties it to the host: its triple, data layout and x86 function attributes."""
    ir_text = re.sub(r'^target (triple|datalayout) = ".*"$', "", ir_text, flags=re.M)
    return re.sub(r'"target-(cpu|features)"="[^"]*"', "", ir_text)


@pytest.mark.slow
def test_each_level_keeps_its_own_cached_kernels(tmp_path):
    """numba's on-disk cache keys on the CPU only: a level's process must neither load another level's
    kernels nor evict them."""
    script = ("import numpy as np; from engine.backends import cpu_matmul as L\n"
              "L.quantize_activations(np.ones((2, 64), np.float32), 1)\n"
              "s = L.quantize_activations.stats; print(len(s.cache_hits), len(s.cache_misses))")

    def run(**level):
        r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                           env=_env(NUMBA_CACHE_DIR=str(tmp_path), **level), timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return tuple(int(n) for n in r.stdout.split())

    assert run() == (0, 1)                          # the host's level: compiled and cached
    assert run(ZEN_CPU_ISA="portable") == (0, 1)    # not the host level's code
    assert run() == (1, 0)                          # still cached
    assert run(ZEN_CPU_ISA="portable") == (1, 0)


_BYTE_CODE_PRODUCTS = """
import sys
import numpy as np
from engine.backends.cpu import CpuBackend
from models.quant import QuantTensor
rng = np.random.default_rng(7)
out = {}
for fmt, rows, k in (("q8_0", 96, 576), ("q6_k", 48, 512)):
    w = QuantTensor.from_float(rng.standard_normal((rows, k), np.float32), fmt)
    lin = CpuBackend(int8_activations=True).linear([w])
    for m in (1, 5):
        x = (rng.standard_normal((m, k)) * 4).astype(np.float32)
        y = np.zeros((m, rows), np.float32)
        lin(x, y)
        out[f"{fmt}-{m}"] = y
np.savez(sys.argv[1], **out)
"""


@pytest.mark.slow
def test_byte_code_products_are_the_same_at_every_int8_level(tmp_path):
    """q8_0 and q6_k products at every int8 level this host runs, bit for bit: each level's dot is an
    exact integer sum (avx2's int16 dot of both activation planes included), so only the kernels'
    shared float arithmetic follows it."""
    levels = [level for level in HOST_LEVELS if level != "portable"]
    if len(levels) < 2:
        pytest.skip(f"this host runs one int8 level ({levels}): nothing to compare it with")
    results = {}
    for level in levels:
        path = tmp_path / f"{level}.npz"
        r = subprocess.run([sys.executable, "-c", _BYTE_CODE_PRODUCTS, str(path)], cwd=ROOT, capture_output=True,
                           text=True, timeout=1200, env=_env(ZEN_CPU_ISA=level, **RUN_TARGET.get(level, {})))
        assert r.returncode == 0, r.stderr[-3000:]
        results[level] = np.load(path)
    first = results[levels[0]]
    for level in levels[1:]:
        for key in first.files:
            assert np.array_equal(results[level][key], first[key]), (level, key)
