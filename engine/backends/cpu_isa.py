"""Which instruction-set level the CPU kernels are built for, and the int8 dot product of each level as LLVM IR.

Levels, fastest first (LEVELS):
  avx512vnni  vpdpbusd on 512-bit registers (AVX-512 VNNI: Intel Ice Lake / Sapphire Rapids, AMD Zen 4)
  avxvnni     vpdpbusd on 256-bit registers, VEX encoded (AVX-VNNI: Intel Alder Lake and later client CPUs)
  avx2        vpmaddubsw + vpmaddwd on 256-bit registers (Haswell and later, AMD Zen 1-3)
  neondot     ARM64 NEON sdot on 128-bit registers (the dot-product extension: Graviton 2 and later,
              Ampere Altra, Apple M1 and later)
  portable    plain LLVM vector IR that any target compiles (older ARM64 and x86); float kernels by default

The level is chosen once, when the process starts, from the features numba compiles for (the host's, or
NUMBA_CPU_NAME / NUMBA_CPU_FEATURES); ZEN_CPU_ISA=<level> picks a lower one (tests, operators). Every
kernel is written on 16-lane values: LLVM splits one into two 256-bit halves (or four NEON registers)
where the target has no 512-bit registers, so the same tiled weight layout serves every level.
"""
from __future__ import annotations

import logging
import os

from llvmlite import ir
from numba.core import cgutils
from numba.core import config as _numba_config

log = logging.getLogger("engine.backends.cpu")

LEVELS = ("avx512vnni", "avxvnni", "avx2", "neondot", "portable")
# LLVM features each level's code needs, any one set of them (fma: the float kernels' llvm.fma is one
# instruction); 256-bit vpdpbusd is also AVX-512 VNNI's with VL (EVEX encoded), which CPUs like Zen 4 have
_NEEDS = {
    "avx512vnni": ({"avx512f", "avx512bw", "avx512vnni", "fma"},),
    "avxvnni": ({"avx2", "avxvnni", "fma"}, {"avx2", "avx512vl", "avx512vnni", "fma"}),
    "avx2": ({"avx2", "fma"},),
    "neondot": ({"neon", "dotprod"},),
    "portable": (set(),),
}


def _target_features() -> set[str]:
    """CPU features numba compiles for: NUMBA_CPU_FEATURES when set, else the host's (numba passes the
    host's features to LLVM even when NUMBA_CPU_NAME names another CPU)."""
    if _numba_config.CPU_FEATURES:
        return {f[1:] for f in _numba_config.CPU_FEATURES.split(",") if f.startswith("+")}
    try:
        import llvmlite.binding as llvm
        return {k for k, v in llvm.get_host_cpu_features().items() if v}
    except Exception:  # pragma: no cover - platform without feature detection
        return set()


def runs(level: str, features: set[str]) -> bool:
    """Whether the features include what the level's instructions need."""
    return any(needs <= features for needs in _NEEDS[level])


def best_level(features: set[str]) -> str:
    """The fastest level whose instructions the features include."""
    return next(level for level in LEVELS if runs(level, features))


def select_level(features: set[str], override: str | None) -> str:
    """best_level, or the override (ZEN_CPU_ISA) when given; an override the target lacks the features of
    is an error, as LLVM could not compile (or the CPU not run) its instructions."""
    if not override:
        return best_level(features)
    if override not in LEVELS:
        raise ValueError(f"ZEN_CPU_ISA={override!r}: expected one of {', '.join(LEVELS)}")
    if not runs(override, features):
        raise ValueError(f"ZEN_CPU_ISA={override}: the CPU numba compiles for lacks "
                         f"{sorted(min(_NEEDS[override], key=lambda n: len(n - features)) - features)}")
    return override


FEATURES = _target_features()
ISA = select_level(FEATURES, os.environ.get("ZEN_CPU_ISA", "").strip().lower() or None)
# int8 activations by default on every level with a fast int8 dot; ZEN_CPU_INT8=0 forces the float kernels.
INT8_DEFAULT = ISA != "portable" and os.environ.get("ZEN_CPU_INT8", "1") != "0"

_logged = False


def log_level() -> None:
    """Say once per process which level the CPU kernels run at."""
    global _logged
    if not _logged:
        _logged = True
        log.info("cpu kernels: isa=%s int8_default=%s", ISA, INT8_DEFAULT)


# ----------------------------------------------------------------------------- the int8 dot, per level
_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_VI = ir.VectorType(_I32, 16)
_B64 = ir.VectorType(_I8, 64)
_V8I, _B32, _W16 = ir.VectorType(_I32, 8), ir.VectorType(_I8, 32), ir.VectorType(_I16, 16)


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _half(builder, v, h):
    """Lanes 8h .. 8h+7 of a 16-lane vector (one 256-bit register where the target splits the vector)."""
    return builder.shuffle_vector(v, v, ir.Constant(_V8I, list(range(8 * h, 8 * h + 8))))


def _join(builder, lo, hi):
    return builder.shuffle_vector(lo, hi, ir.Constant(_VI, list(range(16))))


def _madd_avx2(builder, a, b):
    """vpmaddubsw: 16 int16 lanes, each the 2 products (unsigned byte of a) * (signed byte of b) summed
    with saturation (exact while the pair stays within int16)."""
    return builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _W16, [_B32, _B32]),
                        [builder.bitcast(a, _B32), builder.bitcast(b, _B32)])


def _sum_pairs_avx2(builder, s):
    """vpmaddwd by ones: 8 int32 lanes, each the sum of 2 int16 lanes (4 byte products)."""
    return _madd_wd(builder, s, ir.Constant(_W16, [1] * 16))


def _dot_avx2(builder, acc, a, b):
    """Per 256-bit half: vpmaddubsw + vpmaddwd. A pair of products with a's bytes up to 255 can pass
    2^15, so a is split into its low 7 bits and its top bit (each pair then at most 2 * 128 * 127)."""
    halves = []
    for h in (0, 1):
        ah, bh = _half(builder, a, h), _half(builder, b, h)
        lo = builder.and_(ah, ir.Constant(_V8I, [0x7F7F7F7F] * 8))
        hi = builder.and_(ah, ir.Constant(_V8I, [0x80808080 - (1 << 32)] * 8))
        halves.append(builder.add(_sum_pairs_avx2(builder, _madd_avx2(builder, lo, bh)),
                                  _sum_pairs_avx2(builder, _madd_avx2(builder, hi, bh))))
    return builder.add(acc, _join(builder, *halves))


def _dot4_nibbles_avx2(builder, acc, pairs):
    """acc + 4 dots of bytes a < 32 (q4 nibbles, q5 codes) with b: the 4 vpmaddubsw summed in int16 (at
    most 4 * 2 * 31 * 127 < 2^15; b is never -128), then one vpmaddwd per 256-bit half."""
    halves = []
    for h in (0, 1):
        s = None
        for a, b in pairs:
            p = _madd_avx2(builder, _half(builder, a, h), _half(builder, b, h))
            s = p if s is None else builder.add(s, p)
        halves.append(_sum_pairs_avx2(builder, s))
    return builder.add(acc, _join(builder, *halves))


def emit_dot_u8_x16(builder, codes, x0, x1):
    """IR (avx2): per int32 lane the sum of codes * x over n code vectors (lane = row, 4 consecutive values
    each; vector v holds values 4v .. 4v+3), x the 4n activations as 256 * x0 + x1 (two int8 planes, <4n x
    i8> each): that is 256 * dot(x0) + dot(x1), the two planes' vpmaddubsw sums, exactly. Here x fits int16
    (|256 * 127 + 127| < 2^15), so vpmaddwd multiplies zero-extended codes by it: no split of the codes
    against saturation, and one dot for both planes."""
    w16, xs = ir.VectorType(_I16, 64), ir.VectorType(_I16, 4 * len(codes))
    x = builder.add(builder.shl(builder.sext(x0, xs), ir.Constant(xs, [8] * xs.count)), builder.sext(x1, xs))
    acc = [ir.Constant(_V8I, [0] * 8)] * 4           # lanes 4q .. 4q+3, two partial sums each
    for v, w in enumerate(codes):
        wide = builder.zext(builder.bitcast(w, _B64), w16)
        xv = builder.shuffle_vector(x, x, ir.Constant(_VI, [4 * v + j % 4 for j in range(16)]))
        for q in range(4):
            wq = builder.shuffle_vector(wide, wide, ir.Constant(_VI, list(range(16 * q, 16 * q + 16))))
            acc[q] = builder.add(acc[q], _madd_wd(builder, wq, xv))
    pairs = builder.shuffle_vector(builder.shuffle_vector(acc[0], acc[1], ir.Constant(_VI, list(range(16)))),
                                   builder.shuffle_vector(acc[2], acc[3], ir.Constant(_VI, list(range(16)))),
                                   ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    even = builder.shuffle_vector(pairs, pairs, ir.Constant(_VI, list(range(0, 32, 2))))
    odd = builder.shuffle_vector(pairs, pairs, ir.Constant(_VI, list(range(1, 32, 2))))
    return builder.add(even, odd)


def _madd_wd(builder, a, b):
    """vpmaddwd: 8 int32 lanes, each a[2j] * b[2j] + a[2j+1] * b[2j+1] (int16 lanes)."""
    return builder.call(_fn(builder, "llvm.x86.avx2.pmadd.wd", _V8I, [_W16, _W16]), [a, b])


def _dot_avxvnni(builder, acc, a, b):
    """vpdpbusd on each 256-bit half (VEX encoded where the target has AVX-VNNI and no AVX-512 VL)."""
    f = _fn(builder, "llvm.x86.avx512.vpdpbusd.256", _V8I, [_V8I, _V8I, _V8I])
    return _join(builder, *(builder.call(f, [_half(builder, v, h) for v in (acc, a, b)]) for h in (0, 1)))


_V4I, _B16 = ir.VectorType(_I32, 4), ir.VectorType(_I8, 16)


def _quarter(builder, v, q):
    """Lanes 4q .. 4q+3 of a 16-lane vector: one 128-bit NEON register."""
    return builder.shuffle_vector(v, v, ir.Constant(_V4I, list(range(4 * q, 4 * q + 4))))


def _sdot(builder, acc, a, b):
    """NEON sdot: 4 int32 lanes, each acc + the sum of 4 products (signed byte of a) * (signed byte of b)."""
    f = _fn(builder, "llvm.aarch64.neon.sdot.v4i32.v16i8", _V4I, [_V4I, _B16, _B16])
    return builder.call(f, [acc, builder.bitcast(a, _B16), builder.bitcast(b, _B16)])


def _join4(builder, quarters):
    lo = builder.shuffle_vector(quarters[0], quarters[1], ir.Constant(_V8I, list(range(8))))
    hi = builder.shuffle_vector(quarters[2], quarters[3], ir.Constant(_V8I, list(range(8))))
    return _join(builder, lo, hi)


def _dot_neon(builder, acc, a, b, a_signed: bool):
    """Per 128-bit quarter: sdot. Unless a's bytes are known below 128 (a_signed), sdot multiplies
    (a - 128) (a with its top bit flipped) and sdot by the bytes -128 adds the 128 * b back."""
    if not a_signed:
        a = builder.xor(a, ir.Constant(_VI, [0x80808080 - (1 << 32)] * 16))
    minus128 = ir.Constant(_V4I, [0x80808080 - (1 << 32)] * 4)
    out = []
    for q in range(4):
        s = _sdot(builder, _quarter(builder, acc, q), _quarter(builder, a, q), _quarter(builder, b, q))
        if not a_signed:
            s = builder.sub(s, _sdot(builder, ir.Constant(_V4I, [0] * 4), minus128, _quarter(builder, b, q)))
        out.append(s)
    return _join4(builder, out)


def _dot_portable(builder, acc, a, b):
    """Widen every byte to int32, multiply, and add each lane's 4 products: any target compiles it."""
    v32 = ir.VectorType(_I32, 64)
    p = builder.mul(builder.zext(builder.bitcast(a, _B64), v32), builder.sext(builder.bitcast(b, _B64), v32))
    s = acc
    for j in range(4):
        s = builder.add(s, builder.shuffle_vector(p, p, ir.Constant(_VI, [4 * lane + j for lane in range(16)])))
    return s


def emit_dot_u8s8(builder, acc, a, b, level: str = ISA):
    """IR for acc + per int32 lane the sum of 4 products (unsigned byte of a) * (signed byte of b), b's
    bytes in -127..127."""
    if level == "avx512vnni":
        return builder.call(_fn(builder, "llvm.x86.avx512.vpdpbusd.512", _VI, [_VI, _VI, _VI]), [acc, a, b])
    if level == "avxvnni":
        return _dot_avxvnni(builder, acc, a, b)
    if level == "avx2":
        return _dot_avx2(builder, acc, a, b)
    if level == "neondot":
        return _dot_neon(builder, acc, a, b, a_signed=False)
    return _dot_portable(builder, acc, a, b)


def emit_dot4_nibbles(builder, acc, pairs, level: str = ISA):
    """IR for acc + the dots of 4 (a, b) pairs as emit_dot_u8s8, a's bytes 0..31 (q4 nibbles, q5 codes)."""
    if level == "avx2":
        return _dot4_nibbles_avx2(builder, acc, pairs)
    if level == "neondot":      # codes below 128 are non-negative signed bytes: one sdot each
        for a, b in pairs:
            acc = _dot_neon(builder, acc, a, b, a_signed=True)
        return acc
    for a, b in pairs:
        acc = emit_dot_u8s8(builder, acc, a, b, level)
    return acc


def fma_name(level: str = ISA) -> str:
    """The float multiply-add intrinsic: llvm.fma (one instruction on every x86 level and NEON), or llvm.fmuladd on
    the portable level, which fuses only where the target has an FMA unit (no libm call per lane)."""
    return "llvm.fmuladd.v16f32" if level == "portable" else "llvm.fma.v16f32"
