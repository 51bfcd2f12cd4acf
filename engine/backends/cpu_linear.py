"""Matrix products on weights kept in their stored format, as numba kernels for the CPU.

At load time every matrix is repacked into a row-interleaved ("tiled") layout: rows are grouped into
tiles of TILE = 16 rows, one 16-lane SIMD register of float32 or int32, and inside a tile the data of
one block position are contiguous across the tile's rows. Each kernel step loads one register of
weights that feeds 16 output rows at once, and each thread streams one contiguous slice of memory.
In GGML's own row-major block order the same products ran 6x slower (shared/notes/numba-cuda-offline.md).

Tiled layouts (N = rows, K = columns, nb = K // 32 blocks, nt = N / 16 row tiles, zero-padded):
  q4 (q4_0, q4_1)  qs uint8  [nt, nb, 4, 16, 4]: [t, b, g, r, c] = byte 4g+c of row 16t+r, block b
                             (its low nibble is value 4g+c of the block, its high nibble value 16+4g+c)
                   sc uint16 [nt, nb, S, 16]: IEEE half scales d (and for q4_1, S = 2, the min m)
                   w = d * nibble + m   (q4_0: m = -8 d)
  q8 (q8_0)        qs uint8  [nt, nb, 8, 16, 4] holding q + 128 (unsigned, as the int8 dot wants it)
                   sc uint16 [nt, nb, 1, 16]: half scales d;  w = d * (stored - 128)
  f32              w float32 [nt, K, 16]
  f16 / bf16       w uint16  [nt, K, 16], widened to float32 in the kernel
So a quantized matrix takes exactly its GGUF size (scales stay f16), and the four bytes of one int32
lane are four consecutive values of one row: the layout of the AVX-512 VNNI instruction vpdpbusd.

Two ways to multiply quantized weights:
  int8 (default where the CPU has AVX-512 VNNI): each 32-block of a row of x is rounded to int8
     (scale xd = max|x| / 127), as llama.cpp does; one vpdpbusd then does 64 multiply-adds, exactly in
     int32, and a block is scaled once: d * xd * sum(q * xq) + m * (block sum of x). By default
     (passes = 2) the rounding error is rounded again into a second int8 plane at scale xd / 256, and
     the dot runs over both planes (256 * sum0 + sum1 in int32): x to ~16 bits for twice the dot
     work. On SmolLM2 one plane gave logit cosines of only 0.991-0.998 against the float reference
     (errors add up over 30 layers); two planes give 1.00000 (relative error ~1e-5; 0.99998 at a
     position with a huge outlier activation, where one plane gave 0.46).
  float (exact; the fallback without VNNI, or CpuLinear(int8=False)): each tile dequantized to
     float32 in a small scratch, then the float kernel.
Float formats always use float kernels (4 rows x 16 outputs of accumulators: 190-220 GFLOP/s on 2 cores,
at or above OpenBLAS for every row count measured, so the dequantize + BLAS path in cpu.py is off).

The SIMD section below gives numba 16-lane vector values (F32x16, I32x16) and a few operations on
them as LLVM IR, so a kernel keeps its accumulators in registers and says which instructions it wants;
numba's own loop vectorizer cannot do either for these loops (it keeps accumulators in memory, and
fully unrolls 16- or 32-long loops into scalar code before vectorizing, as SLP is off in numba).
"""
from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core import config as _numba_config
from numba.extending import intrinsic, models, register_model

from engine.backends.cpu_cache import flush_stale_caches  # noqa: F401  (re-exported for the kernel modules)

from models.quant import QK, QuantTensor

TILE = 16  # rows per tile: one 16-lane register


# ===================================================================================== SIMD values
def _target_features() -> set[str]:
    """CPU features numba compiles for (the host's unless NUMBA_CPU_NAME / NUMBA_CPU_FEATURES say else)."""
    if _numba_config.CPU_FEATURES:
        return {f[1:] for f in _numba_config.CPU_FEATURES.split(",") if f.startswith("+")}
    if _numba_config.CPU_NAME and _numba_config.CPU_NAME != "host":
        return set()
    try:
        import llvmlite.binding as llvm
        return {k for k, v in llvm.get_host_cpu_features().items() if v}
    except Exception:  # pragma: no cover - platform without feature detection
        return set()


FEATURES = _target_features()
HAS_VNNI = {"avx512f", "avx512bw", "avx512vnni"} <= FEATURES
# int8 activations by default where vpdpbusd exists; ZEN_CPU_INT8=0 forces the exact float kernels.
INT8_DEFAULT = HAS_VNNI and os.environ.get("ZEN_CPU_INT8", "1") != "0"


class Vec(types.Type):
    """A 16-lane SIMD value living in a register: kind 'f32' (float32 lanes) or 'i32' (int32 lanes)."""

    def __init__(self, kind: str):
        self.kind = kind
        super().__init__(name=f"{kind}x16")


F32x16 = Vec("f32")
I32x16 = Vec("i32")
_I32 = ir.IntType(32)
_VF = ir.VectorType(ir.FloatType(), 16)
_VI = ir.VectorType(_I32, 16)


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF if fe_type.kind == "f32" else _VI)


def _ptr(context, builder, aryty, ary, idxty, idx, llty, elt):
    """Pointer (as llty*) to item idx of a C-contiguous array, or of a raw address (an integer from
    addr()) whose items are of LLVM type elt."""
    i = context.cast(builder, idx, idxty, types.intp)
    if isinstance(aryty, types.Integer):
        base = builder.inttoptr(context.cast(builder, ary, aryty, types.uintp), elt.as_pointer())
    else:
        base = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(base, [i]), llty.as_pointer())


def _splat(builder, vty, x):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(_VI, None))


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


_FAST = ("fast",)


@intrinsic
def vzero_f(typingctx):
    return F32x16(), lambda c, b, s, a: ir.Constant(_VF, None)


@intrinsic
def vzero_i(typingctx):
    return I32x16(), lambda c, b, s, a: ir.Constant(_VI, None)


def _c(*arrays):
    """The intrinsics index raw memory: a C-contiguous array or an address from addr() (typing fails
    otherwise)."""
    return all(isinstance(a, types.Integer) or (isinstance(a, types.Array) and a.layout == "C") for a in arrays)


_F32, _I8, _I16 = ir.FloatType(), ir.IntType(8), ir.IntType(16)


@intrinsic
def addr(typingctx, a):
    """The address of a C-contiguous array's data, as an integer (for the intrinsics below).

    The address does not keep the array alive: numba frees an array right after its variable's last
    use, so `p = addr(np.empty(n))` (or a local whose only later use is through p) leaves p pointing at
    freed memory, and every store through it corrupts the heap. Take addresses of arrays the caller
    owns: a function's parameters, or a local that is still used as an array after the last use of p."""
    if not (isinstance(a, types.Array) and a.layout == "C"):
        return None

    def cg(context, builder, sig, args):
        return builder.ptrtoint(context.make_array(sig.args[0])(context, builder, args[0]).data, ir.IntType(64))
    return types.uint64(a), cg


@intrinsic
def ld_f(typingctx, a, i):
    """a[i] of a float32 array or address."""
    if not _c(a):
        return None

    def cg(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _F32, _F32))
    return types.float32(a, i), cg


@intrinsic
def st_f(typingctx, a, i, v):
    """a[i] = v for a float32 array or address."""
    if not _c(a):
        return None

    def cg(context, builder, sig, args):
        v = context.cast(builder, args[2], sig.args[2], types.float32)
        builder.store(v, _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _F32, _F32))
        return context.get_dummy_value()
    return types.none(a, i, v), cg


@intrinsic
def vload_f(typingctx, a, i):
    """a[i : i+16] of a float32 array."""
    if not _c(a):
        return None

    def cg(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _VF, _F32), align=4)
    return F32x16(a, i), cg


@intrinsic
def vstore_f(typingctx, a, i, v):
    """a[i : i+16] = v for a float32 array."""
    if not _c(a):
        return None

    def cg(context, builder, sig, args):
        builder.store(args[2], _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _VF, _F32), align=4)
        return context.get_dummy_value()
    return types.none(a, i, v), cg


@intrinsic
def vload_w(typingctx, a, i):
    """64 bytes from a[i] of a uint8/int8 array as 16 int32 lanes (4 bytes each)."""
    if not _c(a):
        return None

    def cg(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _VI, _I8), align=1)
    return I32x16(a, i), cg


@intrinsic
def vstore_i8(typingctx, a, i, v):
    """a[i : i+16] = the low bytes of v's lanes (a: int8 array)."""
    if not _c(a):
        return None

    def cg(context, builder, sig, args):
        v8 = ir.VectorType(ir.IntType(8), 16)
        builder.store(builder.trunc(args[2], v8),
                      _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], v8, _I8), align=1)
        return context.get_dummy_value()
    return types.none(a, i, v), cg


@intrinsic
def vload_h(typingctx, a, i):
    """16 IEEE halves from a[i] of a uint16 array, widened to float32 (vcvtph2ps)."""
    if not _c(a):
        return None

    def cg(context, builder, sig, args):
        vh = ir.VectorType(ir.HalfType(), 16)
        return builder.fpext(builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], vh, _I16),
                                          align=2), _VF)
    return F32x16(a, i), cg


@intrinsic
def vload_bf(typingctx, a, i):
    """16 bfloat16 from a[i] of a uint16 array, widened to float32."""
    if not _c(a):
        return None

    def cg(context, builder, sig, args):
        v16 = ir.VectorType(ir.IntType(16), 16)
        h = builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], v16, _I16), align=2)
        w = builder.shl(builder.zext(h, _VI), ir.Constant(_VI, [16] * 16))
        return builder.bitcast(w, _VF)
    return F32x16(a, i), cg


@intrinsic
def vbcast_f(typingctx, x):
    """x (a number) in every float32 lane."""
    def cg(context, builder, sig, args):
        return _splat(builder, _VF, context.cast(builder, args[0], sig.args[0], types.float32))
    return F32x16(x), cg


@intrinsic
def vbcast_i(typingctx, x):
    """x (an integer) in every int32 lane."""
    def cg(context, builder, sig, args):
        return _splat(builder, _VI, context.cast(builder, args[0], sig.args[0], types.int32))
    return I32x16(x), cg


@intrinsic
def vbcast4(typingctx, a, i):
    """The 4 bytes a[i : i+4] (uint8/int8 array) as one int32, in every lane."""
    if not _c(a):
        return None

    def cg(context, builder, sig, args):
        x = builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _I32, _I8), align=1)
        return _splat(builder, _VI, x)
    return I32x16(a, i), cg


def _binary(op):
    @intrinsic
    def fn(typingctx, a, b):
        if not (isinstance(a, Vec) and a == b):
            return None

        def cg(context, builder, sig, args):
            x, y = args
            if op == "add":
                return builder.fadd(x, y, flags=_FAST) if a.kind == "f32" else builder.add(x, y)
            if op == "sub":
                return builder.fsub(x, y, flags=_FAST) if a.kind == "f32" else builder.sub(x, y)
            if op == "mul":
                return builder.fmul(x, y, flags=_FAST) if a.kind == "f32" else builder.mul(x, y)
            if op == "div":
                return builder.fdiv(x, y, flags=_FAST)
            if op == "max":
                return builder.call(_fn(builder, "llvm.maxnum.v16f32", _VF, [_VF, _VF]), [x, y])
            if op == "min":
                return builder.call(_fn(builder, "llvm.minnum.v16f32", _VF, [_VF, _VF]), [x, y])
            if op == "and":
                return builder.and_(x, y)
            raise AssertionError(op)
        return a(a, b), cg
    return fn


vadd = _binary("add")
vsub = _binary("sub")
vmul = _binary("mul")
vdiv = _binary("div")
vmax = _binary("max")
vmin = _binary("min")
vand = _binary("and")


@intrinsic
def vfma(typingctx, a, b, c):
    """a * b + c (float32 lanes)."""
    def cg(context, builder, sig, args):
        return builder.call(_fn(builder, "llvm.fma.v16f32", _VF, [_VF, _VF, _VF]), args)
    return F32x16(a, b, c), cg


@intrinsic
def vsrl(typingctx, a, n):
    """Logical right shift of every int32 lane by n bits."""
    def cg(context, builder, sig, args):
        return builder.lshr(args[0], _splat(builder, _VI, context.cast(builder, args[1], sig.args[1], types.int32)))
    return I32x16(a, n), cg


@intrinsic
def vsll(typingctx, a, n):
    """Left shift of every int32 lane by n bits."""
    def cg(context, builder, sig, args):
        return builder.shl(args[0], _splat(builder, _VI, context.cast(builder, args[1], sig.args[1], types.int32)))
    return I32x16(a, n), cg


@intrinsic
def vcvt(typingctx, a):
    """int32 lanes -> float32 lanes."""
    return F32x16(a), lambda c, b, s, args: b.sitofp(args[0], _VF)


@intrinsic
def vround_i(typingctx, a):
    """float32 lanes -> nearest int32 (ties to even)."""
    def cg(context, builder, sig, args):
        r = builder.call(_fn(builder, "llvm.rint.v16f32", _VF, [_VF]), args)
        return builder.fptosi(r, _VI)
    return I32x16(a), cg


@intrinsic
def vabs(typingctx, a):
    return F32x16(a), lambda c, b, s, args: b.call(_fn(b, "llvm.fabs.v16f32", _VF, [_VF]), args)


@intrinsic
def vget(typingctx, v, i):
    """Lane i of v, as a scalar."""
    def cg(context, builder, sig, args):
        return builder.extract_element(args[0], context.cast(builder, args[1], sig.args[1], types.int32))
    return (types.float32 if v.kind == "f32" else types.int32)(v, i), cg


def _reduce(op):
    @intrinsic
    def fn(typingctx, v):
        def cg(context, builder, sig, args):
            x = args[0]
            for width in (8, 4, 2, 1):
                hi = builder.shuffle_vector(x, x, ir.Constant(_VI, [width + j if j < width else j for j in range(16)]))
                if v.kind == "f32":
                    x = builder.fadd(x, hi, flags=_FAST) if op == "add" else builder.call(
                        _fn(builder, "llvm.maxnum.v16f32", _VF, [_VF, _VF]), [x, hi])
                else:
                    x = builder.add(x, hi)
            return builder.extract_element(x, ir.Constant(_I32, 0))
        return (types.float32 if v.kind == "f32" else types.int32)(v), cg
    return fn


vsum = _reduce("add")   # sum of the 16 lanes
vhmax = _reduce("max")  # max of the 16 float lanes


def _pairsum(h):
    """In every segment of 2h lanes: [x's low h + x's high h, y's low h + y's high h]. Four levels
    (h = 8, 4, 2, 1) sum 16 vectors into one vector of their 16 lane-sums (in bit-reversed order)."""
    lo = [(l // (2 * h)) * 2 * h + (l % (2 * h)) + (0 if l % (2 * h) < h else 16 - h) for l in range(16)]
    hi = [i + h for i in lo]

    @intrinsic
    def fn(typingctx, x, y):
        def cg(context, builder, sig, args):
            a = builder.shuffle_vector(args[0], args[1], ir.Constant(_VI, lo))
            b = builder.shuffle_vector(args[0], args[1], ir.Constant(_VI, hi))
            return builder.fadd(a, b, flags=_FAST)
        return F32x16(x, y), cg
    return fn


vpairsum8, vpairsum4, vpairsum2, vpairsum1 = (_pairsum(h) for h in (8, 4, 2, 1))


@intrinsic
def ld_i64(typingctx, a, i):
    """a[i] of an int64 array or address."""
    if not _c(a):
        return None

    def cg(context, builder, sig, args):
        i64 = ir.IntType(64)
        return builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], i64, i64))
    return types.int64(a, i), cg


@intrinsic
def vexp(typingctx, a):
    """exp of every float32 lane (Cephes expf polynomial; relative error ~2e-7; inputs clamped to
    [-87, 88] (no inf: exp(88) = 1.65e38), so exp(-inf) gives ~1.6e-38 rather than 0)."""
    def cg(context, builder, sig, args):
        def c(v):
            return ir.Constant(_VF, [float(v)] * 16)

        def fma(x, y, z):
            return builder.call(_fn(builder, "llvm.fma.v16f32", _VF, [_VF, _VF, _VF]), [x, y, z])
        x = builder.call(_fn(builder, "llvm.maxnum.v16f32", _VF, [_VF, _VF]), [args[0], c(-87.0)])
        x = builder.call(_fn(builder, "llvm.minnum.v16f32", _VF, [_VF, _VF]), [x, c(88.0)])
        n = builder.call(_fn(builder, "llvm.rint.v16f32", _VF, [_VF]), [builder.fmul(x, c(1.44269504088896341))])
        r = fma(n, c(-0.693359375), x)
        r = fma(n, c(2.12194440e-4), r)
        p = c(1.9875691500e-4)
        for coef in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = fma(p, r, c(coef))
        p = fma(p, builder.fmul(r, r), builder.fadd(r, c(1.0)))
        e = builder.shl(builder.add(builder.fptosi(n, _VI), ir.Constant(_VI, [127] * 16)), ir.Constant(_VI, [23] * 16))
        return builder.fmul(p, builder.bitcast(e, _VF))
    return F32x16(a), cg


@intrinsic
def f32_from_bits(typingctx, x):
    """The float32 whose bits are the uint32 x."""
    def cg(context, builder, sig, args):
        return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.uint32), ir.FloatType())
    return types.float32(x), cg


@intrinsic
def vdpbusd(typingctx, acc, a, b):
    """acc + per int32 lane the sum of 4 products (unsigned byte of a) * (signed byte of b)."""
    def cg(context, builder, sig, args):
        if HAS_VNNI:
            return builder.call(_fn(builder, "llvm.x86.avx512.vpdpbusd.512", _VI, [_VI, _VI, _VI]), args)
        # portable form (slow; only reached when int8 is forced without VNNI, e.g. in tests)
        v8, v32 = ir.VectorType(ir.IntType(8), 64), ir.VectorType(_I32, 64)
        p = builder.mul(builder.zext(builder.bitcast(args[1], v8), v32), builder.sext(builder.bitcast(args[2], v8), v32))
        s = args[0]
        for j in range(4):
            s = builder.add(s, builder.shuffle_vector(p, p, ir.Constant(_VI, [4 * lane + j for lane in range(16)])))
        return s
    return I32x16(acc, a, b), cg


# ===================================================================================== repacking
U = np.uint64  # index math is unsigned: numba guards signed indices against wraparound (slow loads)
F = np.float32


def _tiles(a: np.ndarray) -> np.ndarray:
    """[N, ...] -> [nt, TILE, ...], zero rows padding N to a multiple of TILE."""
    n = a.shape[0]
    nt = -(-n // TILE)
    out = np.zeros((nt * TILE,) + a.shape[1:], a.dtype)
    out[:n] = a
    return out.reshape((nt, TILE) + a.shape[1:])


def _tile_bytes(qs: np.ndarray) -> np.ndarray:
    """Row-major block bytes [N, nb, B] -> [nt, nb, B/4, TILE, 4] (4 consecutive bytes of a row per lane)."""
    n, nb, nbytes = qs.shape
    t = _tiles(qs).reshape(-1, TILE, nb, nbytes // 4, 4)
    return np.ascontiguousarray(t.transpose(0, 2, 3, 1, 4))


def _tile_scales(*scales: np.ndarray) -> np.ndarray:
    """Half scales [N, nb] each -> uint16 [nt, nb, S, TILE]."""
    s = np.stack([np.asarray(x, np.float16).view(np.uint16) for x in scales], axis=-1)  # [N, nb, S]
    return np.ascontiguousarray(_tiles(s).transpose(0, 2, 3, 1))


def repack(t: QuantTensor) -> tuple:
    """A stored matrix (GGML-ordered data) -> (family, *tiled arrays)."""
    fmt, data = t.format, t.data
    if fmt in ("q4_0", "q4_1"):
        d, m, qs = t.block_fields()
        return ("q4", _tile_bytes(qs), _tile_scales(d) if m is None else _tile_scales(d, m))
    if fmt == "q8_0":
        d, _, qs = t.block_fields()
        return ("q8", _tile_bytes((qs.view(np.int8).astype(np.int16) + 128).astype(np.uint8)), _tile_scales(d))
    if fmt == "f32":
        return ("f32", np.ascontiguousarray(_tiles(np.asarray(data, np.float32)).transpose(0, 2, 1)))
    if fmt in ("f16", "bf16"):
        return (fmt, np.ascontiguousarray(_tiles(np.asarray(data).view(np.uint16)).transpose(0, 2, 1)))
    raise ValueError(f"no CPU kernel for weight format {fmt!r}")


# ============================================================================ activations as int8
# Hot code below takes raw addresses (addr(array), an integer) rather than arrays: numba reference-counts
# arrays handed to inlined helpers, and in these loops that left NRT_incref calls (and every vector
# register spilled around them) in the innermost loop: 4-5x slower. The callers keep the arrays alive:
# every address below is of a parameter, or of a local used as an array after it (see addr).
@njit(cache=True, fastmath=True)
def _quantize_row(xp, xrow, k, qp, dp, sp, i, nb, passes):
    """Row i of x (float32 at xp, the row starting at item xrow) -> int8 planes of row i at qp
    ([M, passes, K]), block scales dp[i, b] and block sums sp[i, b] ([M, nb] float32).

    Plane 0 rounds x to int8 with scale d = max|x| / 127. With passes == 2, plane 1 rounds what plane 0
    left over (at most d / 2) with scale d / 256, so x ~ (256 * plane0 + plane1) * d / 256: about
    16 bits, and the kernels fold both planes into one int32 sum (shifting by 8 in between).
    sp holds the block's sum as dequantized: the kernels' min / offset term."""
    for b in range(U(nb)):
        o = xrow + b * U(QK)
        v0 = vload_f(xp, o)
        v1 = vload_f(xp, o + U(16))
        amax = vhmax(vmax(vabs(v0), vabs(v1)))
        d = amax / F(127.0)
        inv = F(127.0) / amax if amax > F(0.0) else F(0.0)
        q0 = vround_i(vmul(v0, vbcast_f(inv)))
        q1 = vround_i(vmul(v1, vbcast_f(inv)))
        qo = i * U(passes * k) + b * U(QK)
        vstore_i8(qp, qo, q0)
        vstore_i8(qp, qo + U(16), q1)
        so = i * U(nb) + b
        if passes == 1:
            st_f(dp, so, d)
            st_f(sp, so, d * F(vsum(vadd(q0, q1))))
        else:
            # the rest, in units of d / 256 (|rest| <= d / 2 -> 128 at most: clamped to 127)
            inv2 = inv * F(256.0)
            lo = vbcast_f(-127.0)
            hi = vbcast_f(127.0)
            r0 = vround_i(vmin(vmax(vmul(vsub(v0, vmul(vcvt(q0), vbcast_f(d))), vbcast_f(inv2)), lo), hi))
            r1 = vround_i(vmin(vmax(vmul(vsub(v1, vmul(vcvt(q1), vbcast_f(d))), vbcast_f(inv2)), lo), hi))
            vstore_i8(qp, qo + U(k), r0)
            vstore_i8(qp, qo + U(k + 16), r1)
            d256 = d * F(1.0 / 256.0)
            st_f(dp, so, d256)
            st_f(sp, so, d256 * F(vsum(vadd(vadd(r0, r1), vmul(vadd(q0, q1), vbcast_i(256))))))


# ====================================================================================== stores
@njit(cache=True, fastmath=True)
def _store(op, ld, i, col, acc, rn, accumulate):
    """out[i, col : col + rn] (+)= acc[:rn] for out (float32 at op) with row length ld."""
    o = i * U(ld) + U(col)
    if rn == 16:
        if accumulate:
            vstore_f(op, o, vadd(vload_f(op, o), acc))
        else:
            vstore_f(op, o, acc)
    else:
        for r in range(rn):
            v = vget(acc, r)
            if accumulate:
                v += ld_f(op, o + U(r))
            st_f(op, o + U(r), v)


# ================================================================================= q4 int8 kernels
@njit(cache=True, fastmath=True)
def _q4_scales(sp, t, b, nb, ns):
    so = (t * U(nb) + b) * U(ns * 16)
    d = vload_h(sp, so)
    if ns == 2:
        m = vload_h(sp, so + U(16))
    else:
        m = vmul(d, vbcast_f(-8.0))
    return d, m


@njit(cache=True, fastmath=True)
def _dot_q4_i8(l0, l1, l2, l3, h0, h1, h2, h3, xqp, xo, k, passes):
    """int32 per lane: sum of the block's 32 nibble * int8 products for the x block at byte xo; with
    two planes, 256 * (that sum) + the same sum for the second plane (at xo + k).
    Two (four) independent vpdpbusd chains: one chain of 8 (16) would wait on its latency when a tile
    runs a single row of x (decode)."""
    z = vzero_i()
    a = vdpbusd(vdpbusd(z, l0, vbcast4(xqp, xo)), l1, vbcast4(xqp, xo + U(4)))
    c = vdpbusd(vdpbusd(z, l2, vbcast4(xqp, xo + U(8))), l3, vbcast4(xqp, xo + U(12)))
    a = vdpbusd(vdpbusd(a, h0, vbcast4(xqp, xo + U(16))), h1, vbcast4(xqp, xo + U(20)))
    c = vdpbusd(vdpbusd(c, h2, vbcast4(xqp, xo + U(24))), h3, vbcast4(xqp, xo + U(28)))
    if passes == 1:
        return vadd(a, c)
    x1 = xo + U(k)
    e = vdpbusd(vdpbusd(z, l0, vbcast4(xqp, x1)), l1, vbcast4(xqp, x1 + U(4)))
    g = vdpbusd(vdpbusd(z, l2, vbcast4(xqp, x1 + U(8))), l3, vbcast4(xqp, x1 + U(12)))
    e = vdpbusd(vdpbusd(e, h0, vbcast4(xqp, x1 + U(16))), h1, vbcast4(xqp, x1 + U(20)))
    g = vdpbusd(vdpbusd(g, h2, vbcast4(xqp, x1 + U(24))), h3, vbcast4(xqp, x1 + U(28)))
    return vadd(vsll(vadd(a, c), 8), vadd(e, g))


@njit(cache=True, fastmath=True)
def _q4_tile_i8(qp, sp, ns, xqp, xdp, xsp, k, passes, t, nb, i0, nrows):
    """Tile t against rows i0 .. i0+nrows-1 (nrows 1, 2 or 4) of the int8 x: 4 accumulators.
    Per block: d * xd * sum(nibble * xq) + m * (sum of the x block)."""
    a0 = vzero_f()
    a1 = vzero_f()
    a2 = vzero_f()
    a3 = vzero_f()
    mask = vbcast_i(0x0F0F0F0F)
    rs = U(passes * k)  # bytes between rows of xq
    for b in range(U(nb)):
        base = (t * U(nb) + b) * U(256)
        w0 = vload_w(qp, base)
        w1 = vload_w(qp, base + U(64))
        w2 = vload_w(qp, base + U(128))
        w3 = vload_w(qp, base + U(192))
        l0, l1, l2, l3 = vand(w0, mask), vand(w1, mask), vand(w2, mask), vand(w3, mask)
        h0, h1 = vand(vsrl(w0, 4), mask), vand(vsrl(w1, 4), mask)
        h2, h3 = vand(vsrl(w2, 4), mask), vand(vsrl(w3, 4), mask)
        d, m = _q4_scales(sp, t, b, nb, ns)
        xo = i0 * rs + b * U(QK)
        so = i0 * U(nb) + b
        s = _dot_q4_i8(l0, l1, l2, l3, h0, h1, h2, h3, xqp, xo, k, passes)
        a0 = vfma(m, vbcast_f(ld_f(xsp, so)), vfma(vcvt(s), vmul(d, vbcast_f(ld_f(xdp, so))), a0))
        if nrows >= 2:
            s = _dot_q4_i8(l0, l1, l2, l3, h0, h1, h2, h3, xqp, xo + rs, k, passes)
            so1 = so + U(nb)
            a1 = vfma(m, vbcast_f(ld_f(xsp, so1)), vfma(vcvt(s), vmul(d, vbcast_f(ld_f(xdp, so1))), a1))
        if nrows == 4:
            s = _dot_q4_i8(l0, l1, l2, l3, h0, h1, h2, h3, xqp, xo + U(2) * rs, k, passes)
            so2 = so + U(2 * nb)
            a2 = vfma(m, vbcast_f(ld_f(xsp, so2)), vfma(vcvt(s), vmul(d, vbcast_f(ld_f(xdp, so2))), a2))
            s = _dot_q4_i8(l0, l1, l2, l3, h0, h1, h2, h3, xqp, xo + U(3) * rs, k, passes)
            so3 = so + U(3 * nb)
            a3 = vfma(m, vbcast_f(ld_f(xsp, so3)), vfma(vcvt(s), vmul(d, vbcast_f(ld_f(xdp, so3))), a3))
    return a0, a1, a2, a3


# ================================================================================= q8 int8 kernels
@njit(cache=True, fastmath=True)
def _dot_q8_i8(w0, w1, w2, w3, w4, w5, w6, w7, xqp, xo, k, passes):
    """As _dot_q4_i8, for the 8 byte groups of a q8 block."""
    z = vzero_i()
    a = vdpbusd(vdpbusd(z, w0, vbcast4(xqp, xo)), w1, vbcast4(xqp, xo + U(4)))
    c = vdpbusd(vdpbusd(z, w2, vbcast4(xqp, xo + U(8))), w3, vbcast4(xqp, xo + U(12)))
    a = vdpbusd(vdpbusd(a, w4, vbcast4(xqp, xo + U(16))), w5, vbcast4(xqp, xo + U(20)))
    c = vdpbusd(vdpbusd(c, w6, vbcast4(xqp, xo + U(24))), w7, vbcast4(xqp, xo + U(28)))
    if passes == 1:
        return vadd(a, c)
    x1 = xo + U(k)
    e = vdpbusd(vdpbusd(z, w0, vbcast4(xqp, x1)), w1, vbcast4(xqp, x1 + U(4)))
    g = vdpbusd(vdpbusd(z, w2, vbcast4(xqp, x1 + U(8))), w3, vbcast4(xqp, x1 + U(12)))
    e = vdpbusd(vdpbusd(e, w4, vbcast4(xqp, x1 + U(16))), w5, vbcast4(xqp, x1 + U(20)))
    g = vdpbusd(vdpbusd(g, w6, vbcast4(xqp, x1 + U(24))), w7, vbcast4(xqp, x1 + U(28)))
    return vadd(vsll(vadd(a, c), 8), vadd(e, g))


@njit(cache=True, fastmath=True)
def _q8_tile_i8(qp, sp, xqp, xdp, xsp, k, passes, t, nb, i0, nrows):
    """Per block: d * xd * (sum((q + 128) * xq) - 128 * sum(xq)), from the stored unsigned bytes."""
    a0 = vzero_f()
    a1 = vzero_f()
    a2 = vzero_f()
    a3 = vzero_f()
    c = F(-128.0)
    rs = U(passes * k)
    for b in range(U(nb)):
        base = (t * U(nb) + b) * U(512)
        w0 = vload_w(qp, base)
        w1 = vload_w(qp, base + U(64))
        w2 = vload_w(qp, base + U(128))
        w3 = vload_w(qp, base + U(192))
        w4 = vload_w(qp, base + U(256))
        w5 = vload_w(qp, base + U(320))
        w6 = vload_w(qp, base + U(384))
        w7 = vload_w(qp, base + U(448))
        d = vload_h(sp, (t * U(nb) + b) * U(16))
        xo = i0 * rs + b * U(QK)
        so = i0 * U(nb) + b
        s = _dot_q8_i8(w0, w1, w2, w3, w4, w5, w6, w7, xqp, xo, k, passes)
        a0 = vfma(d, vbcast_f(ld_f(xsp, so) * c), vfma(vcvt(s), vmul(d, vbcast_f(ld_f(xdp, so))), a0))
        if nrows >= 2:
            s = _dot_q8_i8(w0, w1, w2, w3, w4, w5, w6, w7, xqp, xo + rs, k, passes)
            so1 = so + U(nb)
            a1 = vfma(d, vbcast_f(ld_f(xsp, so1) * c), vfma(vcvt(s), vmul(d, vbcast_f(ld_f(xdp, so1))), a1))
        if nrows == 4:
            s = _dot_q8_i8(w0, w1, w2, w3, w4, w5, w6, w7, xqp, xo + U(2) * rs, k, passes)
            so2 = so + U(2 * nb)
            a2 = vfma(d, vbcast_f(ld_f(xsp, so2) * c), vfma(vcvt(s), vmul(d, vbcast_f(ld_f(xdp, so2))), a2))
            s = _dot_q8_i8(w0, w1, w2, w3, w4, w5, w6, w7, xqp, xo + U(3) * rs, k, passes)
            so3 = so + U(3 * nb)
            a3 = vfma(d, vbcast_f(ld_f(xsp, so3) * c), vfma(vcvt(s), vmul(d, vbcast_f(ld_f(xdp, so3))), a3))
    return a0, a1, a2, a3


# ========================================================================= float-weight kernels
@njit(cache=True, fastmath=True)
def _float_tile(wp, kind, xp, k, t, i0, nrows):
    """kind 0: float32 weights, 1: f16, 2: bf16 ([nt, K, 16] at wp); x float32 at xp."""
    a0 = vzero_f()
    a1 = vzero_f()
    a2 = vzero_f()
    a3 = vzero_f()
    base = t * U(k) * U(16)
    x0 = i0 * U(k)
    for j in range(U(k)):
        if kind == 0:
            w = vload_f(wp, base + j * U(16))
        elif kind == 1:
            w = vload_h(wp, base + j * U(16))
        else:
            w = vload_bf(wp, base + j * U(16))
        a0 = vfma(w, vbcast_f(ld_f(xp, x0 + j)), a0)
        if nrows == 4:
            a1 = vfma(w, vbcast_f(ld_f(xp, x0 + U(k) + j)), a1)
            a2 = vfma(w, vbcast_f(ld_f(xp, x0 + U(2 * k) + j)), a2)
            a3 = vfma(w, vbcast_f(ld_f(xp, x0 + U(3 * k) + j)), a3)
    return a0, a1, a2, a3


# ======================================================== row transforms fused into the matmuls
# A matmul can apply the op before it to each row of x on the way in (one call instead of two):
X_PLAIN, X_RMSNORM, X_SILU_MUL = 0, 1, 2


@njit(cache=True, fastmath=True)
def rmsnorm_row(xp, xo, wp, d, eps, op, oo):
    """out[oo : oo + d] = x[xo : xo + d] / rms * w (float32 items at the addresses xp, wp, op)."""
    d16 = d - d % 16
    acc = vzero_f()
    for i in range(0, d16, 16):
        v = vload_f(xp, xo + U(i))
        acc = vfma(v, v, acc)
    ss = vsum(acc)
    for i in range(d16, d):
        v = ld_f(xp, xo + U(i))
        ss += v * v
    inv = F(1.0) / np.sqrt(ss / F(d) + F(eps))
    vi = vbcast_f(inv)
    for i in range(0, d16, 16):
        vstore_f(op, oo + U(i), vmul(vmul(vload_f(xp, xo + U(i)), vi), vload_f(wp, U(i))))
    for i in range(d16, d):
        st_f(op, oo + U(i), ld_f(xp, xo + U(i)) * inv * ld_f(wp, U(i)))


@njit(cache=True, fastmath=True)
def silu_mul_row(gp, go, f, op, oo):
    """out[oo : oo + f] = silu(gate) * up for gate | up = the 2f items at gp[go:]."""
    f16 = f - f % 16
    one = vbcast_f(1.0)
    neg = vbcast_f(-1.0)
    for i in range(0, f16, 16):
        g = vload_f(gp, go + U(i))
        vstore_f(op, oo + U(i), vmul(vdiv(g, vadd(one, vexp(vmul(g, neg)))), vload_f(gp, go + U(f + i))))
    for i in range(f16, f):
        g = ld_f(gp, go + U(i))
        st_f(op, oo + U(i), g / (F(1.0) + np.exp(-g)) * ld_f(gp, go + U(f + i)))


@njit(cache=True, fastmath=True)
def _transform_row(x, i, kind, aux, eps, xt):
    k = xt.shape[1]
    if kind == X_RMSNORM:
        rmsnorm_row(addr(x), U(i) * U(x.shape[1]), addr(aux), k, eps, addr(xt), U(i) * U(k))
    else:
        silu_mul_row(addr(x), U(i) * U(x.shape[1]), k, addr(xt), U(i) * U(k))


@njit(cache=True, fastmath=True, inline="always")
def _transformed(x, kind, aux, eps):
    """x itself (X_PLAIN), or rmsnorm(x) * aux (X_RMSNORM), or silu(gate) * up (X_SILU_MUL) as a new
    array; rows in parallel when there are many."""
    if kind == X_PLAIN:
        return x
    m = x.shape[0]
    xt = np.empty((m, aux.shape[0] if kind == X_RMSNORM else x.shape[1] // 2), np.float32)
    if m >= 16:
        for i in prange(m):
            _transform_row(x, i, kind, aux, eps, xt)
    else:
        for i in range(m):
            _transform_row(x, i, kind, aux, eps, xt)
    return xt


@njit(cache=True, parallel=True, fastmath=True)
def transform(x, kind, aux, eps):
    """_transformed as a kernel of its own (the BLAS path, matrices stacked from several formats)."""
    return _transformed(x, kind, aux, eps)


# ============================================================================= the matmul drivers
# Each public kernel is a parallel loop over row tiles whose body is one call of a plain compiled
# function (`_rows_*`): a small parallel body keeps numba's compile time down (with the whole tile
# loop inlined into it, numba's parfor passes took tens of seconds per kernel).
@njit(cache=True, fastmath=True)
def _quantize_x_row(x, i, passes, xq, xd, xs):
    k = x.shape[1]
    _quantize_row(addr(x), U(i) * U(k), k, addr(xq), addr(xd), addr(xs), U(i), k // QK, passes)


@njit(cache=True, fastmath=True, inline="always")
def _prepare(x, passes):
    """x [M, K] -> int8 planes xq ([M, passes, K]), block scales xd and sums xs [M, nb];
    rows in parallel when there are many."""
    m, k = x.shape
    nb = k // QK
    xq = np.empty((m, passes, k), np.int8)
    xd = np.empty((m, nb), np.float32)
    xs = np.empty((m, nb), np.float32)
    if m >= 16:
        for i in prange(m):
            _quantize_x_row(x, i, passes, xq, xd, xs)
    else:
        for i in range(m):
            _quantize_x_row(x, i, passes, xq, xd, xs)
    return xq, xd, xs


@njit(cache=True, fastmath=True)
def quantize_activations(x, passes=1):
    """The int8 form of x [M, K] that the int8 kernels use: xq [M, passes, K] int8, xd and xs [M, nb];
    per 32-block x ~ xq[:, 0] * xd (passes 1) or (256 * xq[:, 0] + xq[:, 1]) * xd (passes 2).
    For tests and tools; the kernels quantize on the fly."""
    m, k = x.shape
    nb = k // QK
    xq = np.empty((m, passes, k), np.int8)
    xd = np.empty((m, nb), np.float32)
    xs = np.empty((m, nb), np.float32)
    for i in range(m):
        _quantize_x_row(x, i, passes, xq, xd, xs)
    return xq, xd, xs


@njit(cache=True, fastmath=True, inline="always")
def _rows_i8(is_q4, qs, sc, xq, xd, xs, t, out, col, rn, accumulate):
    """Tile t against every row of x: 4 rows at a time (4 x 16 accumulators in registers), then the rest."""
    m, passes, k = xq.shape
    nb, ns, ld = qs.shape[1], sc.shape[2], out.shape[1]
    qp, sp, xqp, xdp, xsp, op = addr(qs), addr(sc), addr(xq), addr(xd), addr(xs), addr(out)
    m4 = m - m % 4
    for i0 in range(0, m4, 4):
        i = U(i0)
        if is_q4:
            a0, a1, a2, a3 = _q4_tile_i8(qp, sp, ns, xqp, xdp, xsp, k, passes, t, nb, i, 4)
        else:
            a0, a1, a2, a3 = _q8_tile_i8(qp, sp, xqp, xdp, xsp, k, passes, t, nb, i, 4)
        _store(op, ld, i, col, a0, rn, accumulate)
        _store(op, ld, i + U(1), col, a1, rn, accumulate)
        _store(op, ld, i + U(2), col, a2, rn, accumulate)
        _store(op, ld, i + U(3), col, a3, rn, accumulate)
    for i0 in range(m4, m):
        if is_q4:
            a0, a1, a2, a3 = _q4_tile_i8(qp, sp, ns, xqp, xdp, xsp, k, passes, t, nb, U(i0), 1)
        else:
            a0, a1, a2, a3 = _q8_tile_i8(qp, sp, xqp, xdp, xsp, k, passes, t, nb, U(i0), 1)
        _store(op, ld, U(i0), col, a0, rn, accumulate)


@njit(cache=True, fastmath=True)
def _rows_q4_i8(qs, sc, xq, xd, xs, t, out, col, rn, accumulate):
    _rows_i8(True, qs, sc, xq, xd, xs, t, out, col, rn, accumulate)


@njit(cache=True, fastmath=True)
def _rows_q8_i8(qs, sc, xq, xd, xs, t, out, col, rn, accumulate):
    _rows_i8(False, qs, sc, xq, xd, xs, t, out, col, rn, accumulate)


@njit(cache=True, fastmath=True)
def _rows_float(kind, w, wp, x, t, out, col, rn, accumulate):
    """Tile t of a float matrix (at wp: [nt, K, 16]; w keeps it alive) against every row of x."""
    m, k = x.shape
    xp, op, ld = addr(x), addr(out), out.shape[1]
    m4 = m - m % 4
    for i0 in range(0, m4, 4):
        i = U(i0)
        a0, a1, a2, a3 = _float_tile(wp, kind, xp, k, t, i, 4)
        _store(op, ld, i, col, a0, rn, accumulate)
        _store(op, ld, i + U(1), col, a1, rn, accumulate)
        _store(op, ld, i + U(2), col, a2, rn, accumulate)
        _store(op, ld, i + U(3), col, a3, rn, accumulate)
    for i0 in range(m4, m):
        a0, a1, a2, a3 = _float_tile(wp, kind, xp, k, t, U(i0), 1)
        _store(op, ld, U(i0), col, a0, rn, accumulate)


# Public kernels: out[:, col0 : col0 + n_out] (+)= x @ W.T for one tiled matrix (x [M, K] and out
# C-contiguous float32; qs, sc / w: the arrays of `repack`). One parallel loop over row tiles.
@njit(cache=True, parallel=True, fastmath=True)
def matmul_q4_i8(x, qs, sc, out, col0, n_out, accumulate, passes, kind, aux, eps):
    xq, xd, xs = _prepare(_transformed(x, kind, aux, eps), passes)
    for ti in prange(qs.shape[0]):
        _rows_q4_i8(qs, sc, xq, xd, xs, U(ti), out, col0 + ti * 16, min(16, n_out - ti * 16), accumulate)


@njit(cache=True, parallel=True, fastmath=True)
def matmul_q8_i8(x, qs, sc, out, col0, n_out, accumulate, passes, kind, aux, eps):
    xq, xd, xs = _prepare(_transformed(x, kind, aux, eps), passes)
    for ti in prange(qs.shape[0]):
        _rows_q8_i8(qs, sc, xq, xd, xs, U(ti), out, col0 + ti * 16, min(16, n_out - ti * 16), accumulate)


@njit(cache=True, parallel=True, fastmath=True)
def matmul_float(wkind, x, w, out, col0, n_out, accumulate, kind, aux, eps):
    """Float weights w [nt, K, 16]: wkind 0 float32, 1 f16, 2 bf16 (w uint16 for both)."""
    wp = addr(w)
    xt = _transformed(x, kind, aux, eps)
    for ti in prange(w.shape[0]):
        _rows_float(wkind, w, wp, xt, U(ti), out, col0 + ti * 16, min(16, n_out - ti * 16), accumulate)


FLOAT_KIND = {"f32": 0, "f16": 1, "bf16": 2}


# ======================================================= dequantizing (BLAS path, exact q4/q8 path)
@njit(cache=True, fastmath=True)
def _dequant_quant_tile(ap, sp, ns, is_q4, t, nb, wtp, ldw, col):
    """Tile t of a q4/q8 matrix (at ap, scales at sp) as float32: item j * ldw + col + r of wtp is
    W[16 t + r, j], i.e. W transposed."""
    for b in range(U(nb)):
        if is_q4:
            d, m = _q4_scales(sp, t, b, nb, ns)
            mask = vbcast_i(0x0F)
            for g in range(U(4)):
                w = vload_w(ap, (t * U(nb) + b) * U(256) + g * U(64))
                for c in range(U(4)):
                    j = b * U(QK) + U(4) * g + c
                    vstore_f(wtp, j * U(ldw) + U(col), vfma(vcvt(vand(vsrl(w, U(8) * c), mask)), d, m))
                    vstore_f(wtp, (j + U(16)) * U(ldw) + U(col),
                             vfma(vcvt(vand(vsrl(w, U(8) * c + U(4)), mask)), d, m))
        else:
            d = vload_h(sp, (t * U(nb) + b) * U(16))
            mask = vbcast_i(0xFF)
            off = vbcast_f(-128.0)
            for g in range(U(8)):
                w = vload_w(ap, (t * U(nb) + b) * U(512) + g * U(64))
                for c in range(U(4)):
                    j = b * U(QK) + U(4) * g + c
                    vstore_f(wtp, j * U(ldw) + U(col), vmul(vadd(vcvt(vand(vsrl(w, U(8) * c), mask)), off), d))


@njit(cache=True, fastmath=True)
def _dequant_float_tile(kind, ap, t, k, wtp, ldw, col):
    for j in range(U(k)):
        o = (t * U(k) + j) * U(16)
        if kind == 0:
            v = vload_f(ap, o)
        elif kind == 1:
            v = vload_h(ap, o)
        else:
            v = vload_bf(ap, o)
        vstore_f(wtp, j * U(ldw) + U(col), v)


@njit(cache=True, parallel=True)
def dequantize_quant_t(qs, sc, wt, col0):
    """W^T of a tiled q4/q8 matrix into columns col0 : col0 + 16 nt of wt [K, ldw] float32."""
    ap, sp, wtp = addr(qs), addr(sc), addr(wt)
    for ti in prange(qs.shape[0]):
        _dequant_quant_tile(ap, sp, sc.shape[2], qs.shape[2] == 4, U(ti), qs.shape[1], wtp, wt.shape[1],
                            col0 + ti * 16)


@njit(cache=True, parallel=True)
def dequantize_float_t(kind, w, wt, col0):
    ap, wtp = addr(w), addr(wt)
    for ti in prange(w.shape[0]):
        _dequant_float_tile(kind, ap, U(ti), w.shape[1], wtp, wt.shape[1], col0 + ti * 16)


@njit(cache=True, fastmath=True)
def _rows_quant_exact(qs, sc, t0, t1, x, out, col0, n_out, accumulate):
    """Tiles t0..t1-1: each dequantized to float32 [K, 16] in a scratch (L1/L2) and multiplied there."""
    k = x.shape[1]
    w = np.empty(k * 16, np.float32)
    ap, sp, wp = addr(qs), addr(sc), addr(w)
    for ti in range(t0, t1):
        _dequant_quant_tile(ap, sp, sc.shape[2], qs.shape[2] == 4, U(ti), qs.shape[1], wp, 16, 0)
        _rows_float(0, w, wp, x, U(0), out, col0 + ti * 16, min(16, n_out - ti * 16), accumulate)


@njit(cache=True, parallel=True, fastmath=True)
def matmul_quant_exact(x, qs, sc, out, col0, n_out, accumulate, kind, aux, eps):
    """The q4/q8 product with x as it is (no int8 rounding): exact, slower; the path without VNNI."""
    nt = qs.shape[0]
    nch = min(nt, 8)
    xt = _transformed(x, kind, aux, eps)
    for c in prange(nch):
        _rows_quant_exact(qs, sc, c * nt // nch, (c + 1) * nt // nch, xt, out, col0, n_out, accumulate)


# ============================================================================== embedding lookup
@njit(cache=True)
def _half(bits):
    """IEEE half bits -> float32 (scalar)."""
    h = np.uint32(bits)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = (h >> np.uint32(10)) & np.uint32(0x1F)
    man = h & np.uint32(0x3FF)
    if exp == 0:
        v = np.float32(man) * np.float32(5.960464477539063e-08)  # subnormal: man * 2^-24
        return -v if sign else v
    if exp == 31:
        f = sign | np.uint32(0x7F800000) | (man << np.uint32(13))
    else:
        f = sign | ((exp + np.uint32(112)) << np.uint32(23)) | (man << np.uint32(13))
    return f32_from_bits(f)


@njit(cache=True)
def gather_quant(a, sc, rows, out):
    """out[i] = W[rows[i]] as float32 for a tiled q4 or q8 matrix (the embedding lookup)."""
    nb = a.shape[1]
    q4 = a.shape[2] == 4
    for i in range(rows.shape[0]):
        t, r = rows[i] // TILE, rows[i] % TILE
        for b in range(nb):
            d = _half(sc[t, b, 0, r])
            if q4:
                mn = _half(sc[t, b, 1, r]) if sc.shape[2] == 2 else np.float32(-8.0) * d
                for j in range(16):
                    q = np.int32(a[t, b, j // 4, r, j % 4])
                    out[i, b * QK + j] = np.float32(q & 15) * d + mn
                    out[i, b * QK + j + 16] = np.float32(q >> 4) * d + mn
            else:
                for j in range(QK):
                    out[i, b * QK + j] = (np.float32(a[t, b, j // 4, r, j % 4]) - np.float32(128.0)) * d


def gather_float(kind: int, w: np.ndarray, rows: np.ndarray) -> np.ndarray:
    v = w[rows // TILE, :, rows % TILE]
    if kind == 0:
        return v.astype(np.float32, copy=False)
    if kind == 1:
        return v.view(np.float16).astype(np.float32)
    return (v.astype(np.uint32) << 16).view(np.float32)
