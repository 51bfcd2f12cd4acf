"""Every Gemma 3 decoder layer of a step in one kernel call (the loop of models/gemma3.py's forward).

The forward calls eight kernels a layer from Python, more where q|k|v are stored in several formats, and
each call costs interpreter and dispatch time on top of the kernel's launch (cpu_layers.py says why one
call serves better). Gemma files mix formats from layer to layer (a K-quant mix: one layer's down
projection q6_k, the next one's q4_k), so the layers' matrices cannot stack into one array a slot as
cpu_layers' do. Here every matrix lies in two flat arrays instead (codes with the K-quants' byte scales,
and half scales), and a table says where each part lies and what it is; the loop views each part from
them and runs the same kernels, in the same order, as the forward's layer loop: the logits are the same
bit for bit.
"""
from __future__ import annotations

import warnings

import numpy as np
from numba import get_num_threads, njit, prange
from numba.core.errors import NumbaPerformanceWarning

from engine.backends import cpu_claims, cpu_int8, cpu_matmul, cpu_norm_act, cpu_simd, cpu_transforms
from engine.backends import cpu_attention as attention
from engine.backends.cpu_cache import flush_stale_caches
from engine.backends.cpu_claims import chunk_of, claim, finish, phase_counters, wait
from engine.backends.cpu_matmul import matmul_q4_i8, matmul_q5_i8, matmul_q8_i8, matmul_q8h_i8, prepare_x, tiles_i8
from engine.backends.cpu_norm_act import head_rmsnorm, rmsnorm_add
from engine.backends.cpu_transforms import X_GELU_MUL, X_PLAIN, X_RMSNORM, transform, transformed

# parallel=True although nothing here is a parallel loop: callers of parallel kernels must be (cpu_layers.py)
warnings.filterwarnings("ignore", message=r"(?s).*'parallel=True' was specified but no transformation.*"
                        r"cpu_gemma3_layers\.py", category=NumbaPerformanceWarning)

FAMILIES = ("q4", "q5", "q8", "q8h")     # the int8 kernels' families, by their index in the part table
# the part table's columns; SIZE: the scales' item size (2: halves, in s16; 1: K-quant bytes, in codes)
FAMILY, Q_OFF, TILES, BLOCKS, LANES, S_OFF, SCALES, SIZE, COL0, ROWS = range(10)
SLOTS = ("qkv", "o", "gate_up", "down")
QKV, O, GATE_UP, DOWN = range(4)


@njit(cache=True, parallel=True)
def _product(family, x, qs, sc, out, col0, rows, accumulate, passes, kind, aux, eps):
    """The family's kernel (compiled once for each kind of scales: float32, IEEE halves)."""
    if family == 0:
        matmul_q4_i8(x, qs, sc, out, col0, rows, accumulate, passes, kind, aux, eps)
    elif family == 1:
        matmul_q5_i8(x, qs, sc, out, col0, rows, accumulate, passes, kind, aux, eps)
    elif family == 2:
        matmul_q8_i8(x, qs, sc, out, col0, rows, accumulate, passes, kind, aux, eps)
    else:
        matmul_q8h_i8(x, qs, sc, out, col0, rows, accumulate, passes, kind, aux, eps)


@njit(cache=True, inline="always")
def _codes(p, codes):
    return codes[p[Q_OFF]:p[Q_OFF] + p[TILES] * p[BLOCKS] * p[LANES] * 64].reshape((p[TILES], p[BLOCKS], p[LANES], 16, 4))


@njit(cache=True, inline="always")
def _scales(p, store):
    """Part p's scales in store (s16, or codes for K-quant bytes: a row of blocks per super-block)."""
    blocks = p[BLOCKS] // 8 if p[SIZE] == 1 else p[BLOCKS]
    n = p[TILES] * blocks * p[SCALES] * 16
    return store[p[S_OFF]:p[S_OFF] + n].reshape((p[TILES], blocks, p[SCALES], 16))


@njit(cache=True, parallel=True)
def _part(x, parts, j, codes, s16, out, accumulate, passes, kind, aux, eps):
    """Part j of the table: out[:, col0 : col0 + rows] (+)= f(x) @ W.T."""
    p = parts[j]
    qs = _codes(p, codes)
    if p[SIZE] == 2:
        _product(p[FAMILY], x, qs, _scales(p, s16), out, p[COL0], p[ROWS], accumulate, passes, kind, aux, eps)
    else:
        _product(p[FAMILY], x, qs, _scales(p, codes), out, p[COL0], p[ROWS], accumulate, passes, kind, aux, eps)


@njit(cache=True, parallel=True)
def _linear(x, layout, i, slot, parts, codes, s16, out, accumulate, passes, kind, aux, eps):
    """CpuLinear.__call__ for slot `slot` of layer i: a transform shared by several parts runs once first."""
    first, count = layout[i, slot, 0], layout[i, slot, 1]
    if count > 1 and kind != X_PLAIN:
        x = transform(x, kind, aux, eps)
        kind = X_PLAIN
    for j in range(first, first + count):
        _part(x, parts, j, codes, s16, out, accumulate, passes, kind, aux, eps)


@njit(cache=True, inline="always")
def _cache_of(layer_kv, i, slot_mapping, block_tables, window_slot_mapping, window_block_tables):
    """Layer i's slot in its cache group, and the group's slot mapping and block tables."""
    group, slot = layer_kv[i, 0], layer_kv[i, 1]
    if group == 0:
        return slot, slot_mapping, block_tables
    return slot, window_slot_mapping[group - 1], window_block_tables[group - 1]


@njit(cache=True, inline="always")
def _o_warm(parts, layout, i, codes, s16):
    """Layer i's o first part, codes and scales as bytes: what rope_attention reads into the caches
    (CpuLinear.warm)."""
    o = parts[layout[i, O, 0]]
    o_codes = _codes(o, codes).reshape(-1)
    if o[SIZE] == 2:
        return o_codes, _scales(o, s16).reshape(-1).view(np.uint8)
    return o_codes, _scales(o, codes).reshape(-1)


@njit(cache=True, parallel=True)
def run_gemma3_layers(h, qkv, attn, gate_up, branch, positions, token_seq, slot_mapping, block_tables,
                      window_slot_mapping, window_block_tables, k_cache, v_cache, cos, sin, num_heads,
                      num_kv_heads, scale, eps, passes, layer_kv, rope, window, norms, head_norms, layout, parts,
                      codes, s16):
    """The layer loop of Gemma3Model.forward. layer_kv [L, 2]: each layer's cache group and slot in it;
    rope [L]: its (cos, sin) table; window [L]: its attention window (0: global); norms [L, 4, hidden]:
    the attn, post-attn, ffn and post-ffn norms; head_norms [L, 2, head_dim]: q's and k's; layout [L, 4,
    2]: each slot's first part and part count."""
    no_aux = norms[0, 0, :1]
    for i in range(layer_kv.shape[0]):
        slot, slots, tables = _cache_of(layer_kv, i, slot_mapping, block_tables, window_slot_mapping,
                                        window_block_tables)
        _linear(h, layout, i, QKV, parts, codes, s16, qkv, False, passes, X_RMSNORM, norms[i, 0], eps)
        head_rmsnorm(qkv, head_norms[i, 0], head_norms[i, 1], num_heads, num_kv_heads, np.float32(eps))
        o_codes, o_scales = _o_warm(parts, layout, i, codes, s16)
        attention.rope_attention(qkv, positions, cos[rope[i]], sin[rope[i]], k_cache[slot], v_cache[slot], slots,
                                 tables, token_seq, num_heads, num_kv_heads, scale, attn, o_codes, o_scales, window[i])
        _linear(attn, layout, i, O, parts, codes, s16, branch, False, passes, X_PLAIN, no_aux, eps)
        rmsnorm_add(branch, norms[i, 1], np.float32(eps), h)
        _linear(h, layout, i, GATE_UP, parts, codes, s16, gate_up, False, passes, X_RMSNORM, norms[i, 2], eps)
        _linear(gate_up, layout, i, DOWN, parts, codes, s16, branch, False, passes, X_GELU_MUL, no_aux, eps)
        rmsnorm_add(branch, norms[i, 3], np.float32(eps), h)


@njit(cache=True, fastmath=True)
def _slot_claimed(x, layout, i, slot, parts, codes, s16, out, accumulate, passes, kind, aux, eps, counters,
                  phase, threads):
    """One thread's part of _linear inside run_gemma3_layers_claimed: the row tiles of all the slot's parts
    (disjoint columns of out) claimed as one phase, x transformed and rounded by every thread itself."""
    first, count = layout[i, slot, 0], layout[i, slot, 1]
    halves = False   # some part is q8h, which reads x's sums per 16 values
    total = 0
    for j in range(first, first + count):
        halves = halves or parts[j, FAMILY] == 3
        total += parts[j, TILES]
    # prepare_x's halves as literals, as the matmul kernels pass it: a flag known only at run time let
    # LLVM fold the block sums' fast-math arithmetic differently (last bits of the logits)
    xt = transformed(x, kind, aux, eps)
    xq, xd, xs = prepare_x(xt, passes)
    xqh, xdh, xsh = prepare_x(xt, passes, True) if halves else (xq, xd, xs)
    chunk = chunk_of(total, threads)
    c = claim(counters, phase, chunk)
    while c < total:
        e = min(c + chunk, total)
        base = 0
        for j in range(first, first + count):
            p = parts[j]
            nt = p[TILES]
            t0, t1 = max(c - base, 0), min(e - base, nt)
            base += nt
            if t0 >= t1:
                continue
            qs = _codes(p, codes)
            pq, pd, ps = (xqh, xdh, xsh) if p[FAMILY] == 3 else (xq, xd, xs)
            if p[SIZE] == 2:
                tiles_i8(p[FAMILY], qs, _scales(p, s16), pq, pd, ps, out, p[COL0], p[ROWS], t0, t1, accumulate)
            else:
                tiles_i8(p[FAMILY], qs, _scales(p, codes), pq, pd, ps, out, p[COL0], p[ROWS], t0, t1, accumulate)
        finish(counters, phase, e - c)
        c = claim(counters, phase, chunk)
    wait(counters, phase, total)


_PHASES = 10  # q|k|v, q/k norms, rope and cache write, attention, its parts combined, o, post-attention norm,
              # gate|up, down, post-FFN norm


@njit(cache=True, parallel=True)
def run_gemma3_layers_claimed(h, qkv, attn, gate_up, branch, positions, token_seq, slot_mapping, block_tables,
                              window_slot_mapping, window_block_tables, k_cache, v_cache, cos, sin, num_heads,
                              num_kv_heads, scale, eps, passes, layer_kv, rope, window, norms, head_norms, layout,
                              parts, codes, s16, partial, counters, threads):
    """run_gemma3_layers in one parallel region, its products and attention as phases that the threads
    claim items of (cpu_claims; cpu_layers.run_layers_claimed says why); the serial steps between them are
    phases of one item. The same kernels on the same items: the same results bit for bit."""
    no_aux = norms[0, 0, :1]
    for w in prange(threads):
        for i in range(layer_kv.shape[0]):
            ph = i * _PHASES
            slot, slots, tables = _cache_of(layer_kv, i, slot_mapping, block_tables, window_slot_mapping,
                                            window_block_tables)
            _slot_claimed(h, layout, i, QKV, parts, codes, s16, qkv, False, passes, X_RMSNORM, norms[i, 0], eps,
                          counters, ph, threads)
            if claim(counters, ph + 1, 1) == 0:
                head_rmsnorm(qkv, head_norms[i, 0], head_norms[i, 1], num_heads, num_kv_heads, np.float32(eps))
                finish(counters, ph + 1, 1)
            wait(counters, ph + 1, 1)
            o_codes, o_scales = _o_warm(parts, layout, i, codes, s16)
            attention.rope_attention_claimed(qkv, positions, cos[rope[i]], sin[rope[i]], k_cache[slot], v_cache[slot],
                                             slots, tables, token_seq, num_heads, num_kv_heads, scale, attn, o_codes,
                                             o_scales, window[i], partial, counters, ph + 2)
            _slot_claimed(attn, layout, i, O, parts, codes, s16, branch, False, passes, X_PLAIN, no_aux, eps,
                          counters, ph + 5, threads)
            if claim(counters, ph + 6, 1) == 0:
                rmsnorm_add(branch, norms[i, 1], np.float32(eps), h)
                finish(counters, ph + 6, 1)
            wait(counters, ph + 6, 1)
            _slot_claimed(h, layout, i, GATE_UP, parts, codes, s16, gate_up, False, passes, X_RMSNORM,
                          norms[i, 2], eps, counters, ph + 7, threads)
            _slot_claimed(gate_up, layout, i, DOWN, parts, codes, s16, branch, False, passes, X_GELU_MUL, no_aux,
                          eps, counters, ph + 8, threads)
            if claim(counters, ph + 9, 1) == 0:
                rmsnorm_add(branch, norms[i, 3], np.float32(eps), h)
                finish(counters, ph + 9, 1)
            wait(counters, ph + 9, 1)


class Gemma3LayerStack:
    """Gemma 3's layers for run_gemma3_layers: their matrices moved into two flat arrays (each layer's
    CpuLinear then reads its parts there, so the weights are held once) and the tables of where they lie."""

    def __init__(self, layers, layer_kv):
        self.passes = layers[0].qkv.passes
        self.layer_kv = np.array(layer_kv, np.int64)
        tables = {id(ly.rope[0]): ly.rope for ly in layers}   # one (cos, sin) per RoPE base
        order = list(tables)
        self.rope = np.array([order.index(id(ly.rope[0])) for ly in layers], np.int64)
        self.cos = np.ascontiguousarray(np.stack([tables[k][0] for k in order]), np.float32)
        self.sin = np.ascontiguousarray(np.stack([tables[k][1] for k in order]), np.float32)
        for ly, r in zip(layers, self.rope):   # the layers' tables become views of the stacked ones: held once
            ly.rope = (self.cos[r], self.sin[r])
        self.window = np.array([ly.window for ly in layers], np.int64)
        self.norms = np.ascontiguousarray(np.stack([[ly.attn_norm, ly.post_attn_norm, ly.ffn_norm, ly.post_ffn_norm]
                                                    for ly in layers]), np.float32)
        self.head_norms = np.ascontiguousarray(np.stack([[ly.q_norm, ly.k_norm] for ly in layers]), np.float32)
        self._pack([[getattr(ly, s) for s in SLOTS] for ly in layers])

    def _pack(self, slots) -> None:
        # by the scales' item size: the flat array and what it holds so far (K-quant bytes go with the codes)
        stores = {1: [], 2: []}
        held = {1: 0, 2: 0}
        rows = []
        self.layout = np.zeros((len(slots), len(SLOTS), 2), np.int64)
        for i, layer in enumerate(slots):
            for s, lin in enumerate(layer):
                self.layout[i, s] = len(rows), len(lin.parts)
                for p in lin.parts:
                    qs, sc = p.arrays
                    nt, nb, lanes = qs.shape[:3]
                    q_off = held[1]
                    stores[1].append(qs.reshape(-1).view(np.uint8))
                    held[1] += qs.nbytes
                    rows.append((FAMILIES.index(p.family), q_off, nt, nb, lanes, held[sc.itemsize], sc.shape[2],
                                 sc.itemsize, p.col0, p.rows))
                    stores[sc.itemsize].append(sc.reshape(-1))
                    held[sc.itemsize] += sc.size
        self.parts = np.array(rows, np.int64)
        self.codes = np.concatenate(stores[1])
        self.s16 = np.concatenate(stores[2] or [np.zeros(0, np.uint16)]).astype(np.uint16, copy=False)
        # the layers' own linears now read the packed copy
        for i, layer in enumerate(slots):
            for s, lin in enumerate(layer):
                for k, p in enumerate(lin.parts):
                    row = self.parts[self.layout[i, s, 0] + k]
                    qs, sc = p.arrays
                    store = self.s16 if row[SIZE] == 2 else self.codes
                    arrays = (self.codes[row[Q_OFF]:row[Q_OFF] + qs.nbytes].view(qs.dtype).reshape(qs.shape),
                              store[row[S_OFF]:row[S_OFF] + sc.size].reshape(sc.shape))
                    lin.use_arrays(arrays, part=k)

    @classmethod
    def of(cls, layers, layer_kv) -> "Gemma3LayerStack | None":
        """A stack of these layers, or None where a product does not run on int8 activations (float
        weights, the exact float path) or the passes differ."""
        if not layers:
            return None
        passes = layers[0].qkv.passes
        for ly in layers:
            for s in SLOTS:
                lin = getattr(ly, s)
                if not lin.int8 or lin.passes != passes or any(p.family not in FAMILIES for p in lin.parts):
                    return None
        return cls(layers, layer_kv)

    def run(self, h, qkv, attn, gate_up, branch, step, k_cache, v_cache, num_heads, num_kv_heads, scale, eps):
        win_slots = step.slot_mapping[None] if step.window_slot_mapping is None else step.window_slot_mapping
        win_tables = step.block_tables[None] if step.window_block_tables is None else step.window_block_tables
        args = (h, qkv, attn, gate_up, branch, step.positions, step.token_seq, step.slot_mapping, step.block_tables,
                win_slots, win_tables, k_cache, v_cache, self.cos, self.sin, num_heads, num_kv_heads,
                np.float32(scale), float(eps), self.passes, self.layer_kv, self.rope, self.window, self.norms,
                self.head_norms, self.layout, self.parts, self.codes, self.s16)
        if h.shape[0] <= cpu_claims.CLAIMED_MAX_ROWS:
            partial = attention.split_scratch(step.positions, num_heads, k_cache.shape[-1])
            run_gemma3_layers_claimed(*args, partial, phase_counters(_PHASES * len(self.layer_kv)), get_num_threads())
        else:
            run_gemma3_layers(*args)


flush_stale_caches(globals(), "cpu_gemma3_layers", cpu_simd.__file__, cpu_int8.__file__, cpu_transforms.__file__,
                   cpu_matmul.__file__, cpu_norm_act.__file__, attention.__file__, cpu_claims.__file__)
