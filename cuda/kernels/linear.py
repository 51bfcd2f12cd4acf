"""y = x @ W.T (optionally y += ...): GEMV for few input rows, a shared-memory tiled GEMM for many.

Weights stay in their stored format (layouts in cuda/kernels/common.py) and are dequantized in registers
(GEMV) or while a tile is staged into shared memory (GEMM); all arithmetic is float32. Every kernel writes
the output columns col0 .. col0 + N - 1 of `out`, so fused matrices (q|k|v, gate|up) stored in different
formats write one shared output; `accumulate` adds into `out` (the residual add of o and down).

GEMV: warp w of a block owns row n, its lanes stride over the row's words; tokens are processed `tok` at a
time so one read of a weight word serves `tok` dot products. `gemv_block` is one block's rows: the per-op
kernel runs it once (grid = ceil(N / (threads/32)), one row per warp), the phases of the persistent decode
step walk it with a grid-stride loop (`gemv_rows`, any grid). `row_dot` optionally multiplies x by an RMSNorm weight g
and `gemv_rows` by a per-token inverse RMS: the norm fused into the GEMV.
GEMM launch: grid = (ceil(N / bn), ceil(T / bm)), block = (bm/tm) * (bn/tn) threads; bk = 32 (one
quantization block per row and stage).
"""
from __future__ import annotations

import functools

from numba import cuda, float32

from cuda.kernels.common import F0, F1, LOADERS, Q8_GROUPS, inv_rms


@functools.lru_cache(maxsize=None)
def row_dot(family: str, normed: bool, tok: int):
    """acc[i] += this lane's share of sum_k W[n, k] x'[t0 + i, k] for i < tok, t0 + i < ntok; x' = x * g
    when normed (g: the RMSNorm weight [K], unused otherwise). Lanes stride over the row by 32."""
    if family in ("q4", "q4k"):  # q4k: float32 d, m, read through the same float32() casts
        @cuda.jit(device=True, fastmath=True)
        def dot_q4(x, g, t0, ntok, qs, d, m, n, lane, acc):
            """Q4 words: 8 nibbles = bytes 4c..4c+3 of a block, low halves elements 4c.., high 4c+16.."""
            for w in range(lane, qs.shape[1], 32):
                b = w >> 2
                k = (b << 5) + ((w & 3) << 2)
                word = qs[n, w]
                dd = float32(d[n, b])
                mm = float32(m[n, b])
                q0 = float32(word & 15)
                q1 = float32((word >> 8) & 15)
                q2 = float32((word >> 16) & 15)
                q3 = float32((word >> 24) & 15)
                q4 = float32((word >> 4) & 15)
                q5 = float32((word >> 12) & 15)
                q6 = float32((word >> 20) & 15)
                q7 = float32((word >> 28) & 15)
                g0 = g1 = g2 = g3 = g4 = g5 = g6 = g7 = F1
                if normed:
                    g0, g1, g2, g3 = g[k], g[k + 1], g[k + 2], g[k + 3]
                    g4, g5, g6, g7 = g[k + 16], g[k + 17], g[k + 18], g[k + 19]
                for i in range(tok):
                    t = t0 + i
                    if t < ntok:
                        x0 = x[t, k] * g0
                        x1 = x[t, k + 1] * g1
                        x2 = x[t, k + 2] * g2
                        x3 = x[t, k + 3] * g3
                        y0 = x[t, k + 16] * g4
                        y1 = x[t, k + 17] * g5
                        y2 = x[t, k + 18] * g6
                        y3 = x[t, k + 19] * g7
                        sqx = q0 * x0 + q1 * x1 + q2 * x2 + q3 * x3 + q4 * y0 + q5 * y1 + q6 * y2 + q7 * y3
                        sx = (x0 + x1) + (x2 + x3) + (y0 + y1) + (y2 + y3)
                        acc[i] += dd * sqx + mm * sx
        return dot_q4
    if family in Q8_GROUPS:
        group_shift, with_min = Q8_GROUPS[family]
        word_shift = group_shift - 2

        @cuda.jit(device=True, fastmath=True)
        def dot_q8(x, g, t0, ntok, qs, d, m, n, lane, acc):
            """q8-style words: 4 signed bytes, elements 4c..4c+3 of scale group w >> word_shift, plus the
            group's min where the family has one (Q8_GROUPS)."""
            for w in range(lane, qs.shape[1], 32):
                k = w << 2
                word = qs[n, w]
                dd = float32(d[n, w >> word_shift])
                b0 = word & 255
                b1 = (word >> 8) & 255
                b2 = (word >> 16) & 255
                b3 = (word >> 24) & 255
                q0 = float32(b0) - float32((b0 & 128) << 1)
                q1 = float32(b1) - float32((b1 & 128) << 1)
                q2 = float32(b2) - float32((b2 & 128) << 1)
                q3 = float32(b3) - float32((b3 & 128) << 1)
                g0 = g1 = g2 = g3 = F1
                if normed:
                    g0, g1, g2, g3 = g[k], g[k + 1], g[k + 2], g[k + 3]
                for i in range(tok):
                    t = t0 + i
                    if t < ntok:
                        x0 = x[t, k] * g0
                        x1 = x[t, k + 1] * g1
                        x2 = x[t, k + 2] * g2
                        x3 = x[t, k + 3] * g3
                        acc[i] += dd * (q0 * x0 + q1 * x1 + q2 * x2 + q3 * x3)
                        if with_min:
                            acc[i] += float32(m[n, w >> word_shift]) * ((x0 + x1) + (x2 + x3))
        return dot_q8
    load = LOADERS[family]

    @cuda.jit(device=True, fastmath=True)
    def dot_float(x, g, t0, ntok, wa, wb, wc, n, lane, acc):
        """Float weights (f16, bf16 bits, f32): lanes stride over the row's elements."""
        for k in range(lane, x.shape[1], 32):
            wv = load(wa, wb, wc, n, k)
            if normed:
                wv *= g[k]
            for i in range(tok):
                t = t0 + i
                if t < ntok:
                    acc[i] += wv * x[t, k]
    return dot_float


@functools.lru_cache(maxsize=None)
def warp_reduce(tok: int, threads: int):
    """Sums of acc[i] over each warp, left in red[i * threads + warp's first thread]; every thread calls it."""

    @cuda.jit(device=True, fastmath=True)
    def reduce(red, acc, tid, lane):
        # a tree in shared memory (the simulator has no shuffles)
        for i in range(tok):
            red[i * threads + tid] = acc[i]
        cuda.syncthreads()  # partials written
        s = 16
        while s > 0:
            if lane < s:
                for i in range(tok):
                    red[i * threads + tid] += red[i * threads + tid + s]
            cuda.syncthreads()  # level complete
            s >>= 1
    return reduce


@functools.lru_cache(maxsize=None)
def gemv_block(family: str, normed: bool, square: bool, tok: int, threads: int):
    """out[t, col0 + n] (+)= sum_k x'[t, k] W[n, k] for t < ntok and the block's rows n = base + warp; red: tok *
    threads shared floats, acc: tok local floats.
    normed: x' = rmsnorm(x) * g with the row's sum of squares read from ss_in[t] (the RMSNorm fused in);
    square: the written value's square is added to ss_out[t] (for the next fused RMSNorm)."""
    dot = row_dot(family, normed, tok)
    reduce = warp_reduce(tok, threads)

    @cuda.jit(device=True, fastmath=True)
    def block_rows(base, x, g, ss_in, eps, ntok, wa, wb, wc, out, col0, accumulate, ss_out, red, acc):
        tid = cuda.threadIdx.x
        lane = tid & 31
        rows = wa.shape[0]
        n = base + (tid >> 5)
        for t0 in range(0, ntok, tok):
            for i in range(tok):
                acc[i] = F0
            if n < rows:
                dot(x, g, t0, ntok, wa, wb, wc, n, lane, acc)
            reduce(red, acc, tid, lane)
            t = t0 + lane
            if lane < tok and n < rows and t < ntok:
                v = red[lane * threads + tid - lane]
                if normed:
                    v *= inv_rms(ss_in[t], x.shape[1], eps)
                if accumulate:
                    v += out[t, col0 + n]
                out[t, col0 + n] = v
                if square:
                    cuda.atomic.add(ss_out, t, v * v)
            cuda.syncthreads()  # red is rewritten by the next token chunk
    return block_rows


@functools.lru_cache(maxsize=None)
def gemv_rows(family: str, normed: bool, square: bool, tok: int, threads: int):
    """gemv_block over every row, spread over warps with a grid-stride loop: correct for any grid."""
    block_rows = gemv_block(family, normed, square, tok, threads)
    rows_per_block = threads // 32

    @cuda.jit(device=True, fastmath=True)
    def rows_loop(x, g, ss_in, eps, ntok, wa, wb, wc, out, col0, accumulate, ss_out, red, acc):
        for base in range(cuda.blockIdx.x * rows_per_block, wa.shape[0], cuda.gridDim.x * rows_per_block):
            block_rows(base, x, g, ss_in, eps, ntok, wa, wb, wc, out, col0, accumulate, ss_out, red, acc)
    return rows_loop


@functools.lru_cache(maxsize=None)
def gemv(family: str, tok: int, threads: int):
    """The GEMV kernel of one weight family: grid = ceil(N / (threads/32)), block = threads, a row a warp (no
    grid-stride loop: it would cost ~24 registers a thread here)."""
    block_rows = gemv_block(family, False, False, tok, threads)
    red_size = tok * threads  # a compile-time shared array size must be a constant of the closure
    rows_per_block = threads // 32

    @cuda.jit(fastmath=True)
    def gemv_kernel(x, wa, wb, wc, out, col0, accumulate):
        """out[t, col0 + n] (+)= sum_k x[t, k] W[n, k]; one warp per row."""
        red = cuda.shared.array(red_size, float32)
        acc = cuda.local.array(tok, float32)
        unused = cuda.local.array(1, float32)  # g, ss_in, ss_out: read only when normed / squared
        block_rows(cuda.blockIdx.x * rows_per_block, x, unused, unused, F0, x.shape[0], wa, wb, wc, out, col0,
                   accumulate, unused, red, acc)

    return gemv_kernel


@functools.lru_cache(maxsize=None)
def gemm_tile(family: str, normed: bool, bm: int, bn: int, bk: int, tm: int, tn: int):
    """One [bm, bn] output tile: x tile [bm, bk] and dequantized W tile [bn, bk] staged k-major in the shared
    arrays xs (bk * (bm + 1)) and ws (bk * (bn + 1)), each thread accumulating acc[i * tn + j] for row
    m0 + ty + i*(bm/tm) and column n0 + tx + j*(bn/tn) (conflict-free reads, coalesced writes); x' = x * g
    when normed. Every one of the (bm/tm) * (bn/tn) threads of the block calls it."""
    load = LOADERS[family]
    tx_n = bn // tn
    ty_n = bm // tm
    nthreads = tx_n * ty_n
    xw = bm + 1  # +1: the transposed stores of consecutive k hit distinct banks
    ww = bn + 1
    x_elems = bm * bk
    w_elems = bn * bk

    @cuda.jit(device=True, fastmath=True)
    def tile(x, g, ntok, wa, wb, wc, n0, m0, xs, ws, acc, av, bv):
        tid = cuda.threadIdx.x
        tx = tid % tx_n
        ty = tid // tx_n
        kdim = x.shape[1]
        rows = wa.shape[0]
        for i in range(tm * tn):
            acc[i] = F0
        for k0 in range(0, kdim, bk):
            for e in range(tid, x_elems, nthreads):
                mm = e // bk
                kk = e - mm * bk
                v = F0
                if m0 + mm < ntok and k0 + kk < kdim:
                    v = x[m0 + mm, k0 + kk]
                    if normed:
                        v *= g[k0 + kk]
                xs[kk * xw + mm] = v
            for e in range(tid, w_elems, nthreads):
                nn = e // bk
                kk = e - nn * bk
                v = F0
                if n0 + nn < rows and k0 + kk < kdim:
                    v = load(wa, wb, wc, n0 + nn, k0 + kk)
                ws[kk * ww + nn] = v
            cuda.syncthreads()  # both tiles staged before any thread reads them
            for kk in range(bk):
                for i in range(tm):
                    av[i] = xs[kk * xw + ty + i * ty_n]
                for j in range(tn):
                    bv[j] = ws[kk * ww + tx + j * tx_n]
                for i in range(tm):
                    for j in range(tn):
                        acc[i * tn + j] += av[i] * bv[j]
            cuda.syncthreads()  # all reads done before the next stage overwrites the tiles
    return tile


@functools.lru_cache(maxsize=None)
def gemm(family: str, bm: int, bn: int, bk: int, tm: int, tn: int):
    """Tiled GEMM kernel: one gemm_tile per block, grid = (ceil(N / bn), ceil(T / bm)), block = (bm/tm) * (bn/tn)."""
    tile = gemm_tile(family, False, bm, bn, bk, tm, tn)
    tx_n = bn // tn
    ty_n = bm // tm
    xs_size = bk * (bm + 1)
    ws_size = bk * (bn + 1)
    tile_size = tm * tn  # a local array's size must be a constant of the closure

    @cuda.jit(fastmath=True)
    def gemm_kernel(x, wa, wb, wc, out, col0, accumulate):
        """out[t, col0 + n] (+)= sum_k x[t, k] W[n, k] over a [bm, bn] output tile per block."""
        xs = cuda.shared.array(xs_size, float32)
        ws = cuda.shared.array(ws_size, float32)
        acc = cuda.local.array(tile_size, float32)
        av = cuda.local.array(tm, float32)
        bv = cuda.local.array(tn, float32)
        tid = cuda.threadIdx.x
        tx = tid % tx_n
        ty = tid // tx_n
        n0 = cuda.blockIdx.x * bn
        m0 = cuda.blockIdx.y * bm
        ntok = x.shape[0]
        rows = wa.shape[0]
        tile(x, x, ntok, wa, wb, wc, n0, m0, xs, ws, acc, av, bv)
        for i in range(tm):
            t = m0 + ty + i * ty_n
            if t < ntok:
                for j in range(tn):
                    n = n0 + tx + j * tx_n
                    if n < rows:
                        v = acc[i * tn + j]
                        if accumulate:
                            v += out[t, col0 + n]
                        out[t, col0 + n] = v

    return gemm_kernel


@functools.lru_cache(maxsize=None)
def gemm_rows(family: str, normed: bool, square: bool, bm: int, bn: int, bk: int, tm: int, tn: int):
    """gemm_tile over every output tile, spread over the blocks with a grid-stride loop (any grid): the decode
    step's phases at batches past the GEMV's, with gemv_rows' epilogue (per-token inverse RMS when normed, the
    residual add when accumulate, the sum of squares into ss_out when square). smem: the shared floats of xs
    and ws; acc, av, bv: tm * tn, tm and tn local floats."""
    tile = gemm_tile(family, normed, bm, bn, bk, tm, tn)
    tx_n = bn // tn
    ty_n = bm // tm
    xs_size = bk * (bm + 1)
    ws_size = bk * (bn + 1)

    @cuda.jit(device=True, fastmath=True)
    def tiles_loop(x, g, ss_in, eps, ntok, wa, wb, wc, out, accumulate, ss_out, smem, acc, av, bv):
        xs = smem[:xs_size]
        ws = smem[xs_size:xs_size + ws_size]
        tid = cuda.threadIdx.x
        tx = tid % tx_n
        ty = tid // tx_n
        rows = wa.shape[0]
        ncol = (rows + bn - 1) // bn
        for w in range(cuda.blockIdx.x, ncol * ((ntok + bm - 1) // bm), cuda.gridDim.x):
            m0 = (w // ncol) * bm
            n0 = (w - (w // ncol) * ncol) * bn
            tile(x, g, ntok, wa, wb, wc, n0, m0, xs, ws, acc, av, bv)
            for i in range(tm):
                t = m0 + ty + i * ty_n
                if t < ntok:
                    inv = F1
                    if normed:
                        inv = inv_rms(ss_in[t], x.shape[1], eps)
                    for j in range(tn):
                        n = n0 + tx + j * tx_n
                        if n < rows:
                            v = acc[i * tn + j] * inv
                            if accumulate:
                                v += out[t, n]
                            out[t, n] = v
                            if square:
                                cuda.atomic.add(ss_out, t, v * v)
    return tiles_loop
