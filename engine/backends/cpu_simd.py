"""16-lane SIMD values for numba kernels on the CPU, and the CPU features they are compiled for.

This module gives numba 16-lane vector values (F32x16, I32x16) and a few operations on them as LLVM IR,
so a kernel keeps its accumulators in registers and says which instructions it wants; numba's own loop
vectorizer cannot do either for these loops (it keeps accumulators in memory, and fully unrolls 16- or
32-long loops into scalar code before vectorizing, as SLP is off in numba).

What depends on the instruction set is decided in cpu_isa (the level, INT8_DEFAULT, the IR of the int8
dot of each level); here the intrinsics that use it (vdpbusd, vdpbusd4_nib, vfma).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from engine.backends import cpu_isa

U = np.uint64  # index math is unsigned: numba guards signed indices against wraparound (slow loads)
F = np.float32


_FMA = cpu_isa.fma_name()  # the level (avx512vnni, avxvnni, avx2, neondot, portable) is decided in cpu_isa


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
def vload_i8f(typingctx, a, i):
    """16 int8 from a[i] of a uint8/int8 array, sign-extended and converted to float32."""
    if not _c(a):
        return None

    def cg(context, builder, sig, args):
        v8 = ir.VectorType(ir.IntType(8), 16)
        b = builder.load(_ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], v8, _I8), align=1)
        return builder.sitofp(builder.sext(b, _VI), _VF)
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
            if op == "or":
                return builder.or_(x, y)
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
vor = _binary("or")


@intrinsic
def vfma(typingctx, a, b, c):
    """a * b + c (float32 lanes)."""
    def cg(context, builder, sig, args):
        return builder.call(_fn(builder, _FMA, _VF, [_VF, _VF, _VF]), args)
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
            return builder.call(_fn(builder, _FMA, _VF, [_VF, _VF, _VF]), [x, y, z])
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
    """acc + per int32 lane the sum of 4 products (unsigned byte of a) * (signed byte of b, -127..127)."""
    return I32x16(acc, a, b), lambda c, builder, s, args: cpu_isa.emit_dot_u8s8(builder, *args)


def _dot_x16_cg(n):
    """Code of vdot8_x16 / vdot4_x16 (avx2 only): for n code vectors, 256 * dot(codes, plane 0) +
    dot(codes, plane 1), x's two planes at bytes xo and xo + k of the address xqp (cpu_isa.emit_dot_u8_x16)."""
    def cg(context, builder, sig, vals):
        xty, xp = sig.args[n], vals[n]
        xo = context.cast(builder, vals[n + 1], sig.args[n + 1], types.uint64)
        k = context.cast(builder, vals[n + 2], sig.args[n + 2], types.uint64)
        bn = ir.VectorType(_I8, 4 * n)
        p0 = _ptr(context, builder, xty, xp, types.uint64, xo, bn, _I8)
        p1 = _ptr(context, builder, xty, xp, types.uint64, builder.add(xo, k), bn, _I8)
        return cpu_isa.emit_dot_u8_x16(builder, vals[:n], builder.load(p0, align=1), builder.load(p1, align=1))
    return cg


@intrinsic
def vdot8_x16(typingctx, w0, w1, w2, w3, w4, w5, w6, w7, xqp, xo, k):
    """A q8 block's two-plane dot (32 values), as _dot_q8_i8 with passes == 2 computes it."""
    return I32x16(w0, w1, w2, w3, w4, w5, w6, w7, xqp, xo, k), _dot_x16_cg(8)


@intrinsic
def vdot4_x16(typingctx, w0, w1, w2, w3, xqp, xo, k):
    """Half a q8 block's two-plane dot (16 values), as _dot16_i8 with passes == 2 computes it."""
    return I32x16(w0, w1, w2, w3, xqp, xo, k), _dot_x16_cg(4)


@intrinsic
def vdpbusd4_nib(typingctx, acc, a0, b0, a1, b1, a2, b2, a3, b3):
    """vdpbusd of 4 (a, b) pairs into acc, a's bytes 0..31 (q4 nibbles, q5 codes): on avx2 their int16
    pair sums add up without saturating (4 * 2 * 31 * 127 < 2^15), so one vpmaddwd serves all four."""
    def cg(context, builder, sig, args):
        return cpu_isa.emit_dot4_nibbles(builder, args[0], [(args[i], args[i + 1]) for i in (1, 3, 5, 7)])
    return I32x16(acc, a0, b0, a1, b1, a2, b2, a3, b3), cg


@intrinsic
def prefetch_l2(typingctx, a, i):
    """A hint that the cache line holding byte i of a (uint8/int8 array or raw address) is read soon: it is
    brought into L2 (x86 prefetcht1, ARM prfm pldl2keep). A prefetch never faults, past an array's end too."""
    if not _c(a):
        return None

    def cg(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], _I8, _I8)
        fn = _fn(builder, "llvm.prefetch.p0", ir.VoidType(), [p.type, _I32, _I32, _I32])
        # read (0), locality 2 (L2), data cache (1)
        builder.call(fn, [p, ir.Constant(_I32, 0), ir.Constant(_I32, 2), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.none(a, i), cg
