"""The phases of one decode step (one new token for each of ntok sequences) as device functions.

A decode step is the list of (phase, layer) pairs of `phase_plan`; `run_phase` runs one of them with the
whole grid. Every phase spreads its work over the blocks with grid-stride loops, so it is correct for any
grid size, and it reads only what earlier phases completed: between two phases the caller puts a grid
barrier (`cuda.cg.this_grid().sync()` in the persistent kernel `decode_step`, a kernel boundary when the
phases are launched one by one; cuda/kernels/decode_step.py has both).

  EMBED      h = E[tokens]; ss_attn += h^2 (the sum of squares the next RMSNorm needs)
  QKV        q|k|v = rmsnorm(h) Wqkv^T (the norm fused: ss_attn gives the scale); epilogue: RoPE on the
             (i, i + Dh/2) pair a warp computed, q into qkv, k and v into the paged cache; ss_ffn = 0
  ATTN       paged attention, item = (sequence, kv head, context split): the group's query heads share each
             K/V load, online softmax; with several splits, partials for MERGE
  MERGE      the splits of each (token, head) combined (only when the context is split)
  O          h += attn Wo^T; ss_ffn += h^2
  GATE_UP    mlp = silu(gate) * up with gate|up = rmsnorm(h) Wgu^T, a warp computes gate row n and up row n
             together (SiLU in the epilogue); ss_attn = 0
  DOWN       h += mlp Wdown^T; ss_attn += h^2
  LM_HEAD    logits = rmsnorm(h) Wlm^T
  SAMPLE     one row a block (cuda/kernels/sampling.py, the grammar's allowed-token mask included); ss_attn = 0
             for the next step
Past the GEMV's batch (launch table's gemv_max_tokens) the matmuls are tiled GEMMs (linear.gemm_rows, a tile of
tokens x outputs a block, weights read once a tile of tokens instead of once every `tok` tokens): QKV_T writes
the normed q|k|v unrotated and ROPE_KV rotates them and fills the cache; GATE_UP_T writes gate|up [B, 2F] and
SILU makes mlp; O_T, DOWN_T and LM_HEAD_T keep the GEMV phases' epilogues.

Weights keep their stored formats (one family per role, stacked over layers: wa[layer] is that layer's
matrix in the layout of cuda/kernels/common.py) and are dequantized in registers by the GEMV code of
cuda/kernels/linear.py. Argument tuples (built by cuda/fused_decode.py, typed in cuda/compile_check.py):
  inputs   tokens i32 [B], positions i32 [B], slots i64 [B], block_tables i32 [B, W], then the sampler's
           arrays in the order of sampling.sample_row
  weights  embedding (a, b, c), attn_norm f32 [L, D], qkv (a, b, c), o (a, b, c), ffn_norm f32 [L, D],
           gate_up (a, b, c), down (a, b, c), final_norm f32 [D], lm_head (a, b, c), cos, sin [P, Dh/2],
           k_cache, v_cache [L, blocks, block_size, Hkv, Dh]
  state    h [B, D], qkv [B, (H + 2 Hkv) Dh], attn [B, H Dh], mlp [B, F], logits [B, V], part_acc
           [B, H, splits, Dh], part_ml [B, H, splits, 2], work f32 [B, V], cnt i32 [B, V], ss_attn, ss_ffn [B],
           gate_up [B, 2F] (the tiled phases)
  outputs  token i64 [B], logprob f32 [B], top ids i64 [B, K], top logprobs f32 [B, K]
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda

from cuda.kernels import attention as attn_k
from cuda.kernels import linear as lin_k
from cuda.kernels.common import F0, LOADERS, inv_rms, silu
from cuda.kernels.rowwise import gated_rows, rope_store_unit, rotate
from cuda.kernels.sampling import sample_row
from cuda.launch import GEMM_BK, decode_gemm_tile, decode_shared_floats

EMBED, QKV, ATTN, MERGE, O, GATE_UP, DOWN, LM_HEAD, SAMPLE = range(9)
QKV_T, ROPE_KV, O_T, GATE_UP_T, SILU, DOWN_T, LM_HEAD_T = range(9, 16)  # tiled: batches past the GEMV's
PHASE_NAMES = ("embed", "qkv", "attn", "merge", "o", "gate_up", "down", "lm_head", "sample",
               "qkv tiled", "rope_kv", "o tiled", "gate_up tiled", "silu", "down tiled", "lm_head tiled")
ROLES = ("embedding", "qkv", "o", "gate_up", "down", "lm_head")


@dataclass(frozen=True)
class DecodeSpec:
    """What a decode_step variant is compiled for: the weight family of each role (ROLES) and the tiles."""
    families: tuple          # one of q4, q8, f16, bf16, f32 per role
    threads: int             # threads per block: a power of two in 32..1024
    tok: int                 # GEMV: tokens sharing one read of a weight word
    attn_rows: int           # attention: query heads of a group held at once (>= num_heads / num_kv_heads)
    attn_chunk: int          # attention: context positions staged per step
    dh_max: int              # attention: largest head dim (64 or 128)
    tiled: bool = False      # the matmul phases as tiled GEMMs (batches past gemv_max_tokens), else GEMVs

    @classmethod
    def for_config(cls, cfg, families: tuple, head_dim: int) -> "DecodeSpec":
        """The variant a launch-table row (cuda/launch.py) builds for a model's role families and head dim."""
        return cls(families=tuple(families), threads=cfg.decode_threads, tok=cfg.gemv_tokens,
                   attn_rows=cfg.attn_rows, attn_chunk=cfg.attn_chunk, dh_max=64 if head_dim <= 64 else 128)

    @property
    def gemm_tile(self) -> tuple[int, int, int, int]:
        """(bm, bn, tm, tn) of the tiled phases (cuda/launch.py: decode_gemm_tile)."""
        return decode_gemm_tile(self.threads)

    @property
    def shared_floats(self) -> int:
        """Floats of the one shared buffer every phase carves its scratch from."""
        return decode_shared_floats(self.threads, self.tok, self.attn_rows, self.attn_chunk, self.dh_max)


def phase_plan(num_layers: int, split: bool, tiled: bool = False) -> np.ndarray:
    """The (phase, layer) pairs of one decode step, in order, int32 [n, 2]; MERGE only when split; tiled: the
    matmuls as tiled GEMMs, RoPE + the KV write and SiLU x up then phases of their own."""
    if tiled:
        per_layer = (QKV_T, ROPE_KV, ATTN) + ((MERGE,) if split else ()) + (O_T, GATE_UP_T, SILU, DOWN_T)
    else:
        per_layer = (QKV, ATTN) + ((MERGE,) if split else ()) + (O, GATE_UP, DOWN)
    head = LM_HEAD_T if tiled else LM_HEAD
    plan = [(EMBED, 0)] + [(p, li) for li in range(num_layers) for p in per_layer] + [(head, 0), (SAMPLE, 0)]
    return np.asarray(plan, np.int32)


@functools.lru_cache(maxsize=None)
def paired_gemv(family: str, tok: int, threads: int, qkv: bool):
    """Rows computed in pairs by one warp with the RMSNorm fused in, so the epilogue can combine the two:
    qkv: the RoPE pair (i, i + Dh/2) of each q and k head (then single v rows), rotated, k and v written
    to the cache; otherwise (gate_up): gate row n and up row F + n, silu(gate) * up written to out[t, n]."""
    dot = lin_k.row_dot(family, True, tok)
    reduce = lin_k.warp_reduce(tok, threads)
    rows_per_block = threads // 32

    @cuda.jit(device=True, fastmath=True)
    def pairs_loop(x, g, ss, eps, ntok, wa, wb, wc, out, positions, slots, cos, sin, k_cache, v_cache,
                   num_heads, num_kv_heads, red, acc1, acc2):
        tid = cuda.threadIdx.x
        lane = tid & 31
        red2 = red[tok * threads:]
        dh = k_cache.shape[3]
        half = dh >> 1
        bs = k_cache.shape[1]
        if qkv:
            npairs = (num_heads + num_kv_heads) * half
            units = npairs + num_kv_heads * dh
        else:
            npairs = out.shape[1]
            units = npairs
        for base in range(cuda.blockIdx.x * rows_per_block, units, cuda.gridDim.x * rows_per_block):
            u = base + (tid >> 5)
            hh = u // half
            i = u - hh * half
            if not qkv:
                n1 = u
                n2 = npairs + u
            elif u < npairs:
                n1 = hh * dh + i
                n2 = n1 + half
            else:
                n1 = (num_heads + num_kv_heads) * dh + (u - npairs)
                n2 = -1
            for t0 in range(0, ntok, tok):
                for j in range(tok):
                    acc1[j] = F0
                    acc2[j] = F0
                if u < units:
                    dot(x, g, t0, ntok, wa, wb, wc, n1, lane, acc1)
                    if n2 >= 0:
                        dot(x, g, t0, ntok, wa, wb, wc, n2, lane, acc2)
                reduce(red, acc1, tid, lane)
                reduce(red2, acc2, tid, lane)
                t = t0 + lane
                if lane < tok and u < units and t < ntok:
                    inv = inv_rms(ss[t], x.shape[1], eps)
                    a = red[lane * threads + tid - lane] * inv
                    b = red2[lane * threads + tid - lane] * inv
                    if not qkv:
                        out[t, n1] = silu(a) * b
                    else:
                        slot = slots[t]
                        blk = slot // bs
                        off = slot - blk * bs
                        if n2 >= 0:
                            p = positions[t]
                            ra, rb = rotate(a, b, cos[p, i], sin[p, i])
                            out[t, n1] = ra
                            out[t, n2] = rb
                            if hh >= num_heads and slot >= 0:
                                k_cache[blk, off, hh - num_heads, i] = ra
                                k_cache[blk, off, hh - num_heads, i + half] = rb
                        else:
                            out[t, n1] = a
                            if slot >= 0:
                                e = u - npairs
                                kvh = e // dh
                                v_cache[blk, off, kvh, e - kvh * dh] = a
                cuda.syncthreads()  # red is rewritten by the next token chunk
    return pairs_loop


@functools.lru_cache(maxsize=None)
def embed_phase(family: str):
    load = LOADERS[family]

    @cuda.jit(device=True, fastmath=True)
    def embed(tokens, ntok, wa, wb, wc, h, ss):
        """h[t] = E[tokens[t]] dequantized, ss[t] += its squares; a grid-stride loop over ntok * D."""
        d = h.shape[1]
        for e in range(cuda.grid(1), ntok * d, cuda.gridsize(1)):
            t = e // d
            v = load(wa, wb, wc, tokens[t], e - t * d)
            h[t, e - t * d] = v
            cuda.atomic.add(ss, t, v * v)
    return embed


@cuda.jit(device=True, fastmath=True)
def rope_kv_phase(ntok, qkv, positions, slots, cos, sin, k_cache, v_cache, num_heads, num_kv_heads):
    """The QKV GEMV's epilogue as a phase after the tiled QKV: the per-op rope_store_kv's units (RoPE on q and
    k in qkv, k and v into the paged cache), a grid-stride loop over ntok x units."""
    units = (num_heads + 3 * num_kv_heads) * (k_cache.shape[3] >> 1)
    for e in range(cuda.grid(1), ntok * units, cuda.gridsize(1)):
        t = e // units
        rope_store_unit(t, e - t * units, qkv, positions, slots, cos, sin, k_cache, v_cache, num_heads,
                        num_kv_heads)


@cuda.jit(device=True)
def zero_rows(ss, ntok):
    """ss[:ntok] = 0 (grid-stride)."""
    for t in range(cuda.grid(1), ntok, cuda.gridsize(1)):
        ss[t] = F0


@functools.lru_cache(maxsize=None)
def attention_phase(rows: int, chunk: int, dh_max: int):
    item = attn_k.attend(rows, chunk, dh_max)
    q_size = rows * dh_max
    kv_size = chunk * (dh_max + 1)

    @cuda.jit(device=True, fastmath=True)
    def attention(ntok, nsplit, split_size, qkv, k_cache, v_cache, block_tables, positions, num_heads,
                  num_kv_heads, scale, out, part_acc, part_ml, smem):
        """Items (token t = sequence t, kv head g, split z) spread over the blocks."""
        o1 = 2 * q_size
        o2 = o1 + kv_size
        o3 = o2 + rows * chunk
        q_s = smem[:q_size]
        acc_s = smem[q_size:o1]
        kv_s = smem[o1:o2]
        s_s = smem[o2:o3]
        m_s = smem[o3:o3 + rows]
        l_s = smem[o3 + rows:o3 + 2 * rows]
        c_s = smem[o3 + 2 * rows:o3 + 3 * rows]
        per_token = num_kv_heads * nsplit
        for w in range(cuda.blockIdx.x, ntok * per_token, cuda.gridDim.x):
            t = w // per_token
            r = w - t * per_token
            g = r // nsplit
            # window 0: the fused step serves only full-attention models (the others have no fused step)
            item(t, 1, t, g, r - g * nsplit, nsplit, qkv, k_cache, v_cache, block_tables, positions, num_heads,
                 num_kv_heads, scale, split_size, 0, out, part_acc, part_ml, q_s, acc_s, kv_s, s_s, m_s, l_s, c_s)
    return attention


@cuda.jit(device=True, fastmath=True)
def merge_phase(ntok, part_acc, part_ml, positions, split_size, out):
    """The split-K partials merged, a grid-stride loop over ntok * H * Dh."""
    nh = part_acc.shape[1]
    dh = part_acc.shape[3]
    for e in range(cuda.grid(1), ntok * nh * dh, cuda.gridsize(1)):
        t = e // (nh * dh)
        r = e - t * nh * dh
        h = r // dh
        attn_k.merge_split(t, h, r - h * dh, part_acc, part_ml, positions, split_size, out)


@functools.lru_cache(maxsize=None)
def gemv_matmuls(spec: DecodeSpec):
    """The matmul phases QKV, O, GATE_UP, DOWN, LM_HEAD as GEMVs (a warp a row, `tok` tokens a weight read)."""
    _, f_qkv, f_o, f_gu, f_down, f_lm = spec.families
    tok, threads = spec.tok, spec.threads
    qkv_rows = paired_gemv(f_qkv, tok, threads, True)
    gate_up_rows = paired_gemv(f_gu, tok, threads, False)
    o_rows = lin_k.gemv_rows(f_o, False, True, tok, threads)
    down_rows = lin_k.gemv_rows(f_down, False, True, tok, threads)
    lm_rows = lin_k.gemv_rows(f_lm, True, False, tok, threads)

    @cuda.jit(device=True, fastmath=True)
    def matmuls(phase, layer, ntok, num_heads, num_kv_heads, eps, positions, slots, weights, state, smem, acc1,
                acc2, tacc, av, bv):
        h, qkv, attn, mlp, logits = state[0], state[1], state[2], state[3], state[4]
        ss_attn, ss_ffn = state[9], state[10]
        unused = acc2  # the ss_out of a GEMV that squares nothing
        if phase == QKV:
            zero_rows(ss_ffn, ntok)
            qkv_rows(h, weights[3][layer], ss_attn, eps, ntok, weights[4][layer], weights[5][layer],
                     weights[6][layer], qkv, positions, slots, weights[21], weights[22], weights[23][layer],
                     weights[24][layer], num_heads, num_kv_heads, smem, acc1, acc2)
        elif phase == O:
            o_rows(attn, unused, unused, eps, ntok, weights[7][layer], weights[8][layer], weights[9][layer], h,
                   0, True, ss_ffn, smem, acc1)
        elif phase == GATE_UP:
            zero_rows(ss_attn, ntok)
            gate_up_rows(h, weights[10][layer], ss_ffn, eps, ntok, weights[11][layer], weights[12][layer],
                         weights[13][layer], mlp, positions, slots, weights[21], weights[22], weights[23][layer],
                         weights[24][layer], num_heads, num_kv_heads, smem, acc1, acc2)
        elif phase == DOWN:
            down_rows(mlp, unused, unused, eps, ntok, weights[14][layer], weights[15][layer], weights[16][layer],
                      h, 0, True, ss_attn, smem, acc1)
        elif phase == LM_HEAD:
            lm_rows(h, weights[17], ss_attn, eps, ntok, weights[18], weights[19], weights[20], logits, 0, False,
                    unused, smem, acc1)
    return matmuls


@functools.lru_cache(maxsize=None)
def tiled_matmuls(spec: DecodeSpec):
    """The matmul phases QKV_T, ROPE_KV, O_T, GATE_UP_T, SILU, DOWN_T, LM_HEAD_T: tiled GEMMs (linear.gemm_rows)
    and the GEMV epilogues they cannot hold as phases of their own."""
    _, f_qkv, f_o, f_gu, f_down, f_lm = spec.families
    tile = spec.gemm_tile[:2] + (GEMM_BK,) + spec.gemm_tile[2:]
    qkv_tiles = lin_k.gemm_rows(f_qkv, True, False, *tile)
    gate_up_tiles = lin_k.gemm_rows(f_gu, True, False, *tile)
    o_tiles = lin_k.gemm_rows(f_o, False, True, *tile)
    down_tiles = lin_k.gemm_rows(f_down, False, True, *tile)
    lm_tiles = lin_k.gemm_rows(f_lm, True, False, *tile)
    silu_rows = gated_rows("silu")

    @cuda.jit(device=True, fastmath=True)
    def matmuls(phase, layer, ntok, num_heads, num_kv_heads, eps, positions, slots, weights, state, smem, acc1,
                acc2, tacc, av, bv):
        h, qkv, attn, mlp, logits = state[0], state[1], state[2], state[3], state[4]
        ss_attn, ss_ffn, gate_up = state[9], state[10], state[11]
        unused = acc2
        if phase == QKV_T:
            zero_rows(ss_ffn, ntok)
            qkv_tiles(h, weights[3][layer], ss_attn, eps, ntok, weights[4][layer], weights[5][layer],
                      weights[6][layer], qkv, False, unused, smem, tacc, av, bv)
        elif phase == ROPE_KV:
            rope_kv_phase(ntok, qkv, positions, slots, weights[21], weights[22], weights[23][layer],
                          weights[24][layer], num_heads, num_kv_heads)
        elif phase == O_T:
            o_tiles(attn, unused, unused, eps, ntok, weights[7][layer], weights[8][layer], weights[9][layer], h,
                    True, ss_ffn, smem, tacc, av, bv)
        elif phase == GATE_UP_T:
            zero_rows(ss_attn, ntok)
            gate_up_tiles(h, weights[10][layer], ss_ffn, eps, ntok, weights[11][layer], weights[12][layer],
                          weights[13][layer], gate_up, False, unused, smem, tacc, av, bv)
        elif phase == SILU:
            silu_rows(gate_up, mlp, ntok)
        elif phase == DOWN_T:
            down_tiles(mlp, unused, unused, eps, ntok, weights[14][layer], weights[15][layer], weights[16][layer],
                       h, True, ss_attn, smem, tacc, av, bv)
        elif phase == LM_HEAD_T:
            lm_tiles(h, weights[17], ss_attn, eps, ntok, weights[18], weights[19], weights[20], logits, False,
                     unused, smem, tacc, av, bv)
    return matmuls


@functools.lru_cache(maxsize=None)
def phases(spec: DecodeSpec):
    """run_phase(phase, layer, ...) for this spec: one (phase, layer) of phase_plan(..., spec.tiled) with the
    whole grid. The GEMV and the tiled matmul phases are separate variants: one kernel holding both needed
    more than 255 registers a thread (sm_90, 256 threads), each alone fits without spills."""
    embed = embed_phase(spec.families[0])
    attention = attention_phase(spec.attn_rows, spec.attn_chunk, spec.dh_max)
    matmuls = tiled_matmuls(spec) if spec.tiled else gemv_matmuls(spec)

    @cuda.jit(device=True, fastmath=True)
    def run_phase(phase, layer, ntok, nsplit, split_size, num_heads, num_kv_heads, scale, eps, inputs, weights,
                  state, outputs, smem, ibuf, found, acc1, acc2, tacc, av, bv):
        tokens, positions, slots, block_tables = inputs[0], inputs[1], inputs[2], inputs[3]
        h, qkv, attn, logits = state[0], state[1], state[2], state[4]
        part_acc, part_ml, ss_attn = state[5], state[6], state[9]
        if phase == EMBED:
            embed(tokens, ntok, weights[0], weights[1], weights[2], h, ss_attn)
        elif phase == ATTN:
            attention(ntok, nsplit, split_size, qkv, weights[23][layer], weights[24][layer], block_tables,
                      positions, num_heads, num_kv_heads, scale, attn, part_acc, part_ml, smem)
        elif phase == MERGE:
            merge_phase(ntok, part_acc, part_ml, positions, split_size, attn)
        elif phase == SAMPLE:
            for i in range(cuda.blockIdx.x, ntok, cuda.gridDim.x):
                sample_row(i, logits, state[7], state[8], inputs[4], inputs[5], inputs[6], inputs[7], inputs[8],
                           inputs[9], inputs[10], inputs[11], inputs[12], inputs[13], inputs[14], inputs[15],
                           inputs[16], inputs[17], inputs[18], inputs[19], inputs[20], inputs[21], inputs[22],
                           inputs[23], outputs[0], outputs[1], outputs[2], outputs[3], smem, ibuf, found)
            zero_rows(ss_attn, ntok)
        else:
            matmuls(phase, layer, ntok, num_heads, num_kv_heads, eps, positions, slots, weights, state, smem, acc1,
                    acc2, tacc, av, bv)
    return run_phase
