"""The `cuda` backend: every op of the forward pass and the sampler as numba.cuda kernels.

The backend contract (engine/backends/contract.py) on the GPU. Weights are uploaded once (repacked into the
device layouts of cuda/kernels/common.py); activations, the KV cache and logits stay on the device; `sample`
returns only the token ids and the logprobs asked for. Launch configurations come from cuda/launch.py, chosen
for the GPU when the backend is created. Importing this module needs no driver; creating a CudaBackend does
(or the simulator, NUMBA_ENABLE_CUDASIM=1).
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
from numba import config as numba_config
from numba import cuda

from cuda import launch
from cuda.kernels import attention as attn_k
from cuda.kernels import linear as lin_k
from cuda.kernels import rowwise as row_k
from cuda.kernels import sampling as samp_k
from cuda.decode_state import StepCounters
from cuda.kernels.common import FAMILIES, SIMULATOR
from engine.backends.contract import ComposedOps, QuantTensor, SampleResult, StackedLinear, rope_tables
from models.quant import BLOCK_FORMATS, CODE_ZERO, HALF_SCALES

if SIMULATOR:
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray as _DeviceArrayBase
else:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray as _DeviceArrayBase

GATHER_THREADS = 128
log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- device arrays

def _is_device_array(a) -> bool:
    return isinstance(a, _DeviceArrayBase) or hasattr(a, "__cuda_array_interface__")


def _is_row_index(item) -> bool:
    """A 1-D integer array used as an index (fancy indexing of rows)."""
    if isinstance(item, np.ndarray) or _is_device_array(item):
        return item.ndim == 1 and np.dtype(item.dtype).kind in "iu"
    return False


class DeviceTensor(_DeviceArrayBase):
    """A device array that also takes rows by an integer index array (`h[logits_indices]`, done by a gather
    kernel), and remembers the host array it was uploaded from (`host`), so metadata such as positions can be
    read without a device-to-host copy."""

    host: np.ndarray | None = None

    def __getitem__(self, item):
        if _is_row_index(item):
            return take_rows(self, item)
        r = super().__getitem__(item)
        return _tensor(r) if isinstance(r, _DeviceArrayBase) and not isinstance(r, DeviceTensor) else r


if SIMULATOR:
    def _tensor(a) -> DeviceTensor:
        return DeviceTensor(a._ary, a.stream)

    def _empty(shape, dtype) -> DeviceTensor:
        return DeviceTensor(np.empty(shape, dtype))

    def _zeros(shape, dtype) -> DeviceTensor:
        return DeviceTensor(np.zeros(shape, dtype))

    def _to_device(a: np.ndarray) -> DeviceTensor:
        return _tensor(cuda.to_device(np.ascontiguousarray(a)))
else:
    from numba.cuda.cudadrv import driver as _driver

    def _tensor(a) -> DeviceTensor:
        return DeviceTensor(a.shape, a.strides, a.dtype, stream=a.stream, gpu_data=a.gpu_data)

    def _empty(shape, dtype) -> DeviceTensor:
        return _tensor(cuda.device_array(shape, dtype))

    def _zeros(shape, dtype) -> DeviceTensor:
        a = _empty(shape, dtype)
        if a.size:
            _driver.device_memset(a, 0, a.nbytes)
        return a

    def _to_device(a: np.ndarray) -> DeviceTensor:
        return _tensor(cuda.to_device(np.ascontiguousarray(a)))


def take_rows(src, index) -> DeviceTensor:
    """src[index] for a 2-D device array and a 1-D integer index (host or device)."""
    if src.ndim != 2:
        raise IndexError("row indexing by an array is supported on 2-D device arrays only")
    if isinstance(index, np.ndarray):
        index = _to_device(np.ascontiguousarray(index, np.int32))
    out = _empty((index.shape[0], src.shape[1]), src.dtype)
    if index.shape[0] and src.shape[1]:
        row_k.gather_rows[index.shape[0], GATHER_THREADS](src, index, out)
    return out


# --------------------------------------------------------------------------- weights

def device_layout(t: QuantTensor):
    """(family, host arrays (wa, wb, wc)) of a stored matrix (layouts in cuda/kernels/common.py)."""
    n = t.shape[0]
    dummy = np.zeros((1, 1), np.float16)
    if t.format in BLOCK_FORMATS:
        return _block_layout(t, dummy)
    if t.format == "f16":
        return "f16", (np.asarray(t.data, np.float16), dummy, dummy)
    if t.format == "bf16":
        return "bf16", (np.asarray(t.data, np.uint16), dummy, dummy)
    return "f32", (np.asarray(t.data, np.float32).reshape(n, -1), dummy, dummy)


def _block_layout(t: QuantTensor, dummy: np.ndarray):
    """A block format through its affine view (QuantTensor.affine): w = d * code + m per group."""
    codes, d, m, g = t.affine()
    n, k = t.shape
    half = t.format in HALF_SCALES   # float16 scales as stored; K-quants' exact products need float32
    if t.format in ("q4_0", "q4_1", "q4_k"):
        c = codes.reshape(n, k // 32, 32)
        qs = np.ascontiguousarray(c[:, :, :16] | (c[:, :, 16:] << 4)).reshape(n, -1).view(np.uint32)
        if half:
            return "q4", (qs, d.astype(np.float16), m.astype(np.float16))
        return "q4k", (qs, d, m)
    if t.format in CODE_ZERO:   # signed bytes code - zero under d alone
        qs = (codes.astype(np.int16) - CODE_ZERO[t.format]).astype(np.int8).view(np.uint8).view(np.uint32)
        if g == 16:
            return "q8h", (qs, d, dummy)
        return "q8", (qs, d.astype(np.float16), dummy)
    return "q8m", (codes.view(np.uint32), d, m)


def layout_nbytes(family: str, host: tuple) -> int:
    """Bytes of a matrix in its device layout: the arrays its family's kernels read (the rest are dummies)."""
    used = {"q4": 3, "q4k": 3, "q8m": 3, "q8": 2, "q8h": 2}.get(family, 1)
    return sum(int(a.nbytes) for a in host[:used])


class CudaLinear(StackedLinear):
    """y = x @ W.T for one or more stored matrices stacked along the output (q|k|v, gate|up), on the device."""

    def __init__(self, tensors: list[QuantTensor]):
        self.nbytes = 0  # bytes a full pass over the weights reads
        super().__init__(tensors, self._upload)

    def _upload(self, t: QuantTensor) -> tuple[str, tuple]:
        family, host = device_layout(t)
        self.nbytes += layout_nbytes(family, host)
        return family, tuple(_to_device(a) for a in host)


# --------------------------------------------------------------------------- the backend

class _HostCache:
    """Device copies (and derived metadata) of small per-step host arrays, reused while they are unchanged.

    Keyed by the identity of the objects it is made from; an entry holds references to them (so their ids stay
    unique) and, for numpy arrays, copies of their contents, compared on every hit (a host array refilled in
    place is uploaded again). Device arrays are taken as unchanged while they are the same object."""

    def __init__(self, capacity: int = 32):
        self.capacity = capacity
        self._d: OrderedDict = OrderedDict()

    def get(self, key: str, objs: tuple, make):
        full = (key,) + tuple(id(o) for o in objs)
        hit = self._d.get(full)
        if hit is not None:
            refs, snaps, value = hit
            if all(r is o for r, o in zip(refs, objs)) and all(
                    s is None or (s.shape == o.shape and np.array_equal(s, o)) for s, o in zip(snaps, objs)):
                self._d.move_to_end(full)
                return value
        value = make()
        snaps = tuple(o.copy() if isinstance(o, np.ndarray) else None for o in objs)
        self._d[full] = (objs, snaps, value)
        self._d.move_to_end(full)
        while len(self._d) > self.capacity:
            self._d.popitem(last=False)
        return value


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def attention_tiles(positions: np.ndarray, token_seq: np.ndarray, max_q: int):
    """Query tiles of a step: runs of consecutive tokens of one sequence at consecutive positions, cut every
    max_q tokens -> (first token int32 [n], length int32 [n], longest context)."""
    pos = np.asarray(positions).astype(np.int64)
    seq = np.asarray(token_seq).astype(np.int64)
    n = len(pos)
    new_run = np.ones(n, bool)
    new_run[1:] = (seq[1:] != seq[:-1]) | (pos[1:] != pos[:-1] + 1)
    run_start = np.flatnonzero(new_run)
    in_run = np.arange(n) - run_start[np.cumsum(new_run) - 1]
    starts = np.flatnonzero(new_run | (in_run % max_q == 0))
    lens = np.diff(np.append(starts, n))
    return starts.astype(np.int32), lens.astype(np.int32), int(pos.max()) + 1


def split_plan(c: launch.LaunchConfig, work_items: int, max_ctx: int) -> tuple[int, int]:
    """(number of context splits, positions per split) of paged attention: the context is split only while
    the grid would have fewer blocks than c.attn_target_blocks, into parts of at least c.attn_min_split."""
    if work_items >= c.attn_target_blocks or max_ctx <= c.attn_min_split:
        return 1, _ceil_div(max_ctx, c.attn_chunk) * c.attn_chunk
    n = min(_ceil_div(max_ctx, c.attn_min_split), _ceil_div(c.attn_target_blocks, work_items))
    split = _ceil_div(_ceil_div(max_ctx, n), c.attn_chunk) * c.attn_chunk
    return _ceil_div(max_ctx, split), split


class CudaBackend(ComposedOps):
    """The backend contract (engine/backends/contract.py) on the device. No fused kernels: the fused ops
    are composed from the basic ones (ComposedOps)."""

    name = "cuda"

    def share_cpu(self, sharing: bool) -> None:
        """Nothing to share: the kernels run on the GPU (see CpuBackend.share_cpu)."""

    def __init__(self, config: launch.LaunchConfig | None = None):
        if config is None:
            config = launch.TABLE["fallback"] if SIMULATOR else launch.for_current_device()
        self.config = config.validate()
        self._cache = _HostCache()
        self._scratch: dict[str, DeviceTensor] = {}
        c = self.config
        self._gemv = {fam: lin_k.gemv(fam, c.gemv_tokens, c.gemv_threads) for fam in FAMILIES}
        self._part_dummy = _zeros((1, 1, 1, 1), np.float32)
        self._launchers: dict = {}
        self.counters = StepCounters()  # the per-op path's launches and copies (gpu-check reads them per step)
        if not SIMULATOR:
            # numba warns (through warnings.warn, on every launch) about grids under 128 blocks; decode steps
            # launch many such small grids on purpose
            numba_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0

    # --- weights and buffers
    def linear(self, tensors: list[QuantTensor]) -> CudaLinear:
        return CudaLinear(tensors)

    def vector(self, v: np.ndarray) -> DeviceTensor:
        return _to_device(np.ascontiguousarray(v, dtype=np.float32))

    def zeros(self, shape, dtype=np.float32) -> DeviceTensor:
        return _zeros(shape, dtype)

    def empty(self, shape, dtype=np.float32) -> DeviceTensor:
        return _empty(shape, dtype)

    def upload(self, a: np.ndarray) -> DeviceTensor:
        if _is_device_array(a):
            return a
        self.counters.uploads += 1
        a = np.ascontiguousarray(a)
        d = _to_device(a)
        d.host = a.copy()
        return d

    def download(self, a) -> np.ndarray:
        if not _is_device_array(a):
            return np.asarray(a)
        self.counters.downloads += 1
        return a.copy_to_host()

    def layer_stack(self, layers) -> None:
        """No one-call layer loop on this backend: the forward runs the layers op by op."""
        return None

    def gemma3_layer_stack(self, layers, layer_kv) -> None:
        """No one-call Gemma 3 layer loop on this backend: the forward runs its layers op by op."""
        return None

    def fused_decode(self, model, k_cache, v_cache):
        """The one-launch decode step for this model (cuda/fused_decode.py), or None where it cannot serve it
        (the per-op path then serves every step): a role whose layers mix weight formats, a head shape the
        kernel does not take, no cooperative launch on this GPU."""
        from cuda.fused_decode import FusedDecode, Unsupported

        if not self.cooperative_launch():
            log.info("no cooperative launch on this GPU: the per-op path serves every step")
            return None
        try:
            return FusedDecode(self, model, k_cache, v_cache)
        except Unsupported as e:
            log.info("fused decode step unavailable, the per-op path serves every step: %s", e)
            return None

    @staticmethod
    def cooperative_launch() -> bool:
        """Whether this GPU takes cooperative launches (always in the simulator, on a one-block grid)."""
        if SIMULATOR:
            return True
        return bool(getattr(cuda.get_current_device(), "COOPERATIVE_LAUNCH", 0))

    def synchronize(self) -> None:
        cuda.synchronize()

    def rope_tables(self, max_position, head_dim, theta):
        cos, sin = rope_tables(max_position, head_dim, theta)
        return self.vector(cos), self.vector(sin)

    # --- per-step metadata
    def _ints(self, a, dtype):
        """A device int array for a host or device one (host arrays are converted to `dtype` and cached)."""
        if _is_device_array(a):
            return a
        return self._cache.get("ints" + np.dtype(dtype).str, (a,), lambda: self._upload_host(a, dtype))

    def _upload_host(self, a: np.ndarray, dtype=None) -> DeviceTensor:
        """A counted upload of per-step data."""
        self.counters.uploads += 1
        return _to_device(np.ascontiguousarray(a, dtype))

    @staticmethod
    def _host(a) -> np.ndarray:
        if isinstance(a, np.ndarray):
            return a
        h = getattr(a, "host", None)
        return h if h is not None else a.copy_to_host()

    def _scratch_view(self, name: str, shape, dtype=np.float32) -> DeviceTensor:
        """A C-contiguous view of a grow-only scratch buffer."""
        n = max(int(np.prod(shape)), 1)
        buf = self._scratch.get(name)
        if buf is None or buf.size < n or buf.dtype != np.dtype(dtype):
            buf = self._scratch[name] = _empty(n, dtype)
        return buf[:n].reshape(*shape)

    def _k(self, kern, grid, block):
        """kern[grid, block], the configured launch reused across calls (numba builds one per subscript)."""
        self.counters.launches += 1  # every caller launches what it gets
        if SIMULATOR:  # the simulator's kernel object holds a single configuration: no reuse
            return kern[grid, block]
        key = (kern, grid, block)
        launcher = self._launchers.get(key)
        if launcher is None:
            if len(self._launchers) > 4096:
                self._launchers.clear()
            launcher = self._launchers[key] = kern[grid, block]
        return launcher

    # --- ops
    def embedding(self, table: CudaLinear, tokens, out) -> None:
        t = out.shape[0]
        if t == 0:
            return
        p = table.parts[0]
        self._k(row_k.embedding(p.family), t, self.config.threads)(self._ints(tokens, np.int32), *p.arrays, out)

    def rmsnorm(self, x, w, eps, out) -> None:
        if x.shape[0]:
            self._k(row_k.rmsnorm, x.shape[0], self.config.threads)(x, w, np.float32(eps), out)

    def matmul(self, x, lin: CudaLinear, out, accumulate: bool = False) -> None:
        ntok = x.shape[0]
        if ntok == 0:
            return
        c = self.config
        acc = bool(accumulate)
        for p in lin.parts:
            if ntok <= c.gemv_max_tokens:
                grid = _ceil_div(p.rows, c.gemv_threads // 32)
                self._k(self._gemv[p.family], grid, c.gemv_threads)(x, *p.arrays, out, p.col0, acc)
            else:
                bm, bn, tm, tn = c.gemm_tile(ntok, p.rows)
                kern = lin_k.gemm(p.family, bm, bn, launch.GEMM_BK, tm, tn)
                grid = (_ceil_div(p.rows, bn), _ceil_div(ntok, bm))
                self._k(kern, grid, (bm // tm) * (bn // tn))(x, *p.arrays, out, p.col0, acc)

    def rope_store_kv(self, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads):
        t = qkv.shape[0]
        if t:
            self._k(row_k.rope_store_kv, t, self.config.threads)(
                qkv, self._ints(positions, np.int32), cos, sin, k_cache, v_cache,
                self._ints(slot_mapping, np.int64), int(num_heads), int(num_kv_heads))

    def attention(self, qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads,
                  scale, out, window: int = 0) -> None:
        ntok = qkv.shape[0]
        if ntok == 0:
            return
        c = self.config
        dh = k_cache.shape[3]
        rows, chunk, width = c.attention_variant(dh)
        group = num_heads // num_kv_heads
        if group > rows:
            raise ValueError(f"{group} query heads per KV head exceed the {rows} attention rows of {c.arch} "
                             f"for heads of {dh}")
        tok0, tlen, ntiles, max_ctx = self._tiles(positions, token_seq, rows // group)
        nsplit, split = self.split_plan(ntiles * num_kv_heads, max_ctx)
        kern = attn_k.paged_attention(rows, chunk, width)
        pos = self._ints(positions, np.int32)
        args = (qkv, k_cache, v_cache, self._ints(block_tables, np.int32), pos, self._ints(token_seq, np.int32),
                tok0, tlen, int(num_heads), int(num_kv_heads), np.float32(scale), int(split), int(window), out)
        if nsplit == 1:
            self._k(kern, (ntiles, num_kv_heads, 1), c.attn_threads)(*args, self._part_dummy, self._part_dummy)
            return
        part_acc = self._scratch_view("attn_acc", (ntok, num_heads, nsplit, dh))
        part_ml = self._scratch_view("attn_ml", (ntok, num_heads, nsplit, 2))
        self._k(kern, (ntiles, num_kv_heads, nsplit), c.attn_threads)(*args, part_acc, part_ml)
        self._k(attn_k.attention_reduce, ntok, c.threads)(part_acc, part_ml, pos, int(split), out)

    def _tiles(self, positions, token_seq, max_q: int):
        """(tile first token, tile length) on the device, tile count, longest context; cached per step."""
        def make():
            starts, lens, max_ctx = attention_tiles(self._host(positions), self._host(token_seq), max_q)
            return self._upload_host(starts), self._upload_host(lens), len(starts), max_ctx
        return self._cache.get(f"tiles{max_q}", (positions, token_seq), make)

    def split_plan(self, work_items: int, max_ctx: int) -> tuple[int, int]:
        return split_plan(self.config, work_items, max_ctx)

    def silu_mul(self, gate_up, out) -> None:
        self._gated(row_k.silu_mul, gate_up, out)

    def gelu_mul(self, gate_up, out) -> None:
        self._gated(row_k.gelu_mul, gate_up, out)

    def _gated(self, kern, gate_up, out) -> None:
        """A gated activation's grid-stride kernel over out's T * F items."""
        n = out.shape[0] * out.shape[1]
        if n:
            c = self.config
            blocks = min(_ceil_div(n, c.threads), 32 * c.sm_count)
            self._k(kern, blocks, c.threads)(gate_up, out)

    # --- what Gemma 3 adds
    def scale(self, x, factor) -> None:
        if x.shape[0]:
            self._k(row_k.scale_rows, x.shape[0], self.config.threads)(x, np.float32(factor))

    def head_rmsnorm(self, qkv, q_w, k_w, num_heads, num_kv_heads, eps) -> None:
        if qkv.shape[0]:
            self._k(row_k.head_rmsnorm, (qkv.shape[0], num_heads + num_kv_heads), self.config.threads)(
                qkv, q_w, k_w, int(num_heads), int(num_kv_heads), np.float32(eps))

    def rmsnorm_add(self, x, w, eps, out) -> None:
        if x.shape[0]:
            self._k(row_k.rmsnorm_add, x.shape[0], self.config.threads)(x, w, np.float32(eps), out)

    # --- sampling
    def sample(self, logits, batch):
        """The CPU sampler's semantics on the device: logits [S, V] stay there; ids and logprobs come back."""
        batch.check_logits_shape(logits.shape)
        nrows, vocab = logits.shape
        k = batch.max_num_logprobs
        res = SampleResult.empty(nrows, k)
        if nrows == 0:
            return res
        if not _is_device_array(logits):
            logits = self._upload_host(logits, np.float32)
        b = batch
        # the batch's arrays travel in four uploads, one per dtype, and are passed as slices of them
        f32 = _Packer(np.float32, b.temperature, b.top_p, b.min_p, b.repetition_penalty, b.presence_penalty,
                      b.frequency_penalty, b.bias_values)
        i32 = _Packer(np.int32, b.top_k, b.num_logprobs, b.hist_num_prompt, b.bias_token_ids, b.mask_token_ids,
                      b.hist_token_ids, b.allowed_row)
        i64 = _Packer(np.int64, b.step, b.bias_indptr, b.mask_indptr, b.hist_indptr)
        u64 = _Packer(np.uint64, b.seed)
        temperature, top_p, min_p, rep, pres, freq, bias_values = f32.device()
        top_k, num_logprobs, hist_num_prompt, bias_ids, mask_ids, hist_ids, allowed_row = i32.device()
        # the constrained rows' packed masks: one upload; without any, a placeholder that no row reads
        allowed = _to_device(b.allowed_mask) if b.constrained else self._scratch_view("sample_no_mask", (1, 1),
                                                                                       np.uint32)
        step, bias_indptr, mask_indptr, hist_indptr = i64.device()
        (seed,) = u64.device()
        self.counters.uploads += 4 + bool(b.constrained)
        processed = len(b.bias_token_ids) or len(b.mask_token_ids) or len(b.hist_token_ids) or b.constrained
        shape = (nrows, vocab) if processed else (1, 1)
        work = self._scratch_view("sample_work", shape)
        cnt = self._scratch_view("sample_cnt", shape, np.int32)
        tok = self._scratch_view("sample_tok", (nrows,), np.int64)
        lp = self._scratch_view("sample_lp", (nrows,), np.float32)
        top_ids = self._scratch_view("sample_top_ids", (nrows, max(k, 1)), np.int64)
        top_lp = self._scratch_view("sample_top_lp", (nrows, max(k, 1)), np.float32)
        self._k(samp_k.sample_rows, nrows, self.config.sample_threads)(
            logits, work, cnt, temperature, top_p, top_k, min_p, rep, pres, freq, seed, step, num_logprobs,
            bias_indptr, bias_ids, bias_values, mask_indptr, mask_ids, hist_indptr, hist_ids, hist_num_prompt,
            allowed_row, allowed, tok, lp, top_ids, top_lp)
        res.token_ids[:] = tok.copy_to_host()
        res.logprobs[:] = lp.copy_to_host()
        self.counters.downloads += 2 + 2 * bool(k)
        if k:
            ids, lps = top_ids.copy_to_host(), top_lp.copy_to_host()
            own = np.arange(k)[None, :] < np.asarray(b.num_logprobs)[:, None]
            res.top_token_ids[own] = ids[own]
            res.top_logprobs[own] = lps[own]
        return res


class _Packer:
    """Host arrays of one dtype packed into one buffer, uploaded at once and handed out as device slices
    (each at least one element long, so an empty array is still a valid kernel argument)."""

    def __init__(self, dtype, *arrays):
        parts = [np.ascontiguousarray(a, dtype).ravel() for a in arrays]
        self.bounds = []
        pos = 0
        for a in parts:
            self.bounds.append((pos, pos + len(a)))
            pos += max(len(a), 1)
        self.host = np.zeros(pos, dtype)
        for a, (lo, hi) in zip(parts, self.bounds):
            self.host[lo:hi] = a

    def device(self) -> list:
        d = _to_device(self.host)
        return [d[lo:max(hi, lo + 1)] for lo, hi in self.bounds]
