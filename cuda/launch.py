"""Launch configurations of the CUDA kernels, one table keyed by SM architecture.

The backend picks one row when it is created (`for_current_device()`), from the GPU's compute
capability: 9.x -> sm_90 (H100/H200), 8.0 -> sm_80 (A100), anything else -> fallback (conservative
sizes valid on every GPU numba supports). Fields marked "compile-time" size shared/local arrays, so each
distinct value is a distinct kernel variant (built lazily, and compiled offline by `make kernels`).

Limits: threads per block are powers of two in 32..1024 (the block reductions halve them); a GEMM tile
(bm, bn, tm, tn) has bm % tm == bn % tn == 0 and runs (bm/tm)*(bn/tn) threads; attention holds
attn_rows query rows x head_dim (<= 128) in shared memory: 2*rows*128 + chunk*129 + rows*chunk floats
must stay under 48 KiB; heads up to 256 wide (Gemma 3) take half the rows and half the chunk in the same room.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

STATIC_SHARED_LIMIT = 48 * 1024  # bytes of static shared memory a kernel may declare
ATTN_HEAD_DIM = 128   # the head width attention's shared buffers (and decode_step's) are sized for
MAX_HEAD_DIM = 256    # per-op attention: heads wider than ATTN_HEAD_DIM take fewer rows per block
GEMM_BK = 32  # GEMM reduction depth per shared-memory stage: one quantization block per row


def decode_gemm_tile(threads: int) -> tuple[int, int, int, int]:
    """(bm, bn, tm, tn) of decode_step's tiled phases for a block of `threads`: 4 x 2 outputs a thread, 16
    threads across 32 columns, threads / 16 across the tokens (4 x 4 spilled registers in sm_80's variant)."""
    return threads // 4, 32, 4, 2


def decode_shared_floats(threads: int, tok: int, attn_rows: int, attn_chunk: int, dh_max: int) -> int:
    """Floats of decode_step's one shared buffer: the largest of the GEMV's, the tiled GEMM's and attention's."""
    bm, bn, _, _ = decode_gemm_tile(threads)
    gemv = 2 * tok * threads
    gemm = GEMM_BK * (bm + 1) + GEMM_BK * (bn + 1)
    attention = 2 * attn_rows * dh_max + attn_chunk * (dh_max + 1) + attn_rows * attn_chunk + 3 * attn_rows
    return max(gemv, gemm, attention, threads)


@dataclass(frozen=True)
class LaunchConfig:
    arch: str
    sm_count: int            # streaming multiprocessors assumed when sizing grids (the real count wins)
    threads: int             # row/elementwise kernels: rmsnorm, rope_store_kv, embedding, silu_mul, gather
    gemv_threads: int        # GEMV: one warp per output row, gemv_threads / 32 rows per block (compile-time)
    gemv_tokens: int         # GEMV: tokens whose dot products share one read of a weight word (compile-time)
    gemv_max_tokens: int     # above this many input rows the shared-memory tiled GEMM is used
    gemm_tiles: tuple        # GEMM tiles (bm tokens, bn outputs, tm, tn per thread), largest first; the first
                             # that gives at least sm_count blocks is used, else the last (compile-time)
    attn_rows: int           # attention: query rows (tokens x GQA heads) per block (compile-time)
    attn_chunk: int          # attention: context positions staged in shared memory per step (compile-time)
    attn_threads: int        # attention: threads per block
    attn_min_split: int      # attention: fewest context positions per split-K part
    sample_threads: int      # sampling: threads per row (one block per row, compile-time)
    decode_threads: int      # decode_step: threads per block (compile-time; registers x threads must fit the SM)
    decode_blocks_per_sm: int  # decode_step: blocks per SM at most (the driver's cooperative limit may be lower)
    decode_buckets: tuple    # decode_step: batch-size buckets (static buffers for the largest; more -> per-op)

    def attention_variant(self, head_dim: int) -> tuple[int, int, int]:
        """(query rows, chunk, head width) of the attention kernel for heads of head_dim: up to
        ATTN_HEAD_DIM the table's rows and chunk, wider ones half of each, in no more shared memory."""
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported by the cuda attention kernel")
        if head_dim <= 64:
            return self.attn_rows, self.attn_chunk, 64
        if head_dim <= ATTN_HEAD_DIM:
            return self.attn_rows, self.attn_chunk, ATTN_HEAD_DIM
        return self.attn_rows // 2, self.attn_chunk // 2, MAX_HEAD_DIM

    def gemm_tile(self, ntok: int, nout: int) -> tuple[int, int, int, int]:
        """The GEMM tile for an [ntok, K] x [K, nout] product."""
        for tile in self.gemm_tiles:
            if -(-ntok // tile[0]) * -(-nout // tile[1]) >= self.sm_count:
                return tile
        return self.gemm_tiles[-1]

    @property
    def attn_target_blocks(self) -> int:
        """Attention is split over the context while fewer blocks than this would run."""
        return 2 * self.sm_count

    def with_sm_count(self, n: int) -> "LaunchConfig":
        return dataclasses.replace(self, sm_count=int(n))

    def validate(self) -> "LaunchConfig":
        def pow2(n):
            return 32 <= n <= 1024 and n & (n - 1) == 0

        for f in ("threads", "gemv_threads", "attn_threads", "sample_threads", "decode_threads"):
            if not pow2(getattr(self, f)):
                raise ValueError(f"{self.arch}: {f}={getattr(self, f)} must be a power of two in 32..1024")
        if not self.gemm_tiles:
            raise ValueError(f"{self.arch}: no GEMM tile")
        shared = {}
        for bm, bn, tm, tn in self.gemm_tiles:
            if bm % tm or bn % tn or not pow2((bm // tm) * (bn // tn)):
                raise ValueError(f"{self.arch}: GEMM tile {(bm, bn, tm, tn)}: per-thread tile must divide it into "
                                 "a power of two of threads in 32..1024")
            shared[f"gemm {bm}x{bn}"] = 4 * GEMM_BK * (bm + bn + 2)
        for dh in (ATTN_HEAD_DIM, MAX_HEAD_DIM):
            rows, chunk, width = self.attention_variant(dh)
            shared[f"attention {width}"] = 4 * (2 * rows * width + chunk * (width + 1) + rows * chunk + 3 * rows)
        for what, nbytes in shared.items():
            if nbytes > STATIC_SHARED_LIMIT:
                raise ValueError(f"{self.arch}: {what} needs {nbytes} B of static shared memory")
        if self.decode_blocks_per_sm < 1 or not self.decode_buckets or min(self.decode_buckets) < 1:
            raise ValueError(f"{self.arch}: decode_step needs >= 1 block per SM and positive batch buckets")
        decode_floats = decode_shared_floats(self.decode_threads, self.gemv_tokens, self.attn_rows, self.attn_chunk,
                                             ATTN_HEAD_DIM)
        if 4 * (decode_floats + 1) + 4 * (self.decode_threads + 1) > STATIC_SHARED_LIMIT:
            raise ValueError(f"{self.arch}: decode_step needs more than {STATIC_SHARED_LIMIT} B of static shared memory")
        if self.gemv_max_tokens < 0 or self.gemv_tokens < 1:
            raise ValueError(f"{self.arch}: gemv_tokens must be positive, gemv_max_tokens >= 0 (0: always GEMM)")
        return self


# Starting points from the hardware; sm_90 measured once on an H200 (cuda/RESULTS.md, docs/gpu.md), not
# tuned yet. sm_90: 132 SMs (H100 SXM / H200), 228 KiB shared per SM, 64 warps per SM.
# sm_80: 108 SMs (A100), 164 KiB shared per SM, 64 warps per SM. fallback: small blocks that fit anywhere.
# decode_step's registers (docs/gpu.md, from `make kernels`, no register cap) fit 256 threads once or 128 threads
# twice into the 64 Ki registers of an SM on both architectures, not more.
#   sm_90: 256 x 1 per SM: 132 blocks, so each of the ~160 grid barriers of a step waits on fewer blocks, and
#          8 warps per SM stream HBM3 through the GEMV phases.
#   sm_80: 128 x 2 per SM: 216 blocks of 4 warps on the 108 SMs, the same warps per SM in finer blocks,
#          which balances the per-block phases (attention items, sampler rows) that there are fewer SMs for.
#   fallback: 128 x 1, valid on any GPU with 32 Ki registers an SM.
# buckets: static buffers are sized for the largest; batches above it take the per-op path.
TABLE: dict[str, LaunchConfig] = {
    "sm_90": LaunchConfig(
        arch="sm_90", sm_count=132, threads=256, gemv_threads=256, gemv_tokens=8, gemv_max_tokens=32,
        gemm_tiles=((64, 64, 4, 4), (32, 32, 2, 2)),
        attn_rows=16, attn_chunk=32, attn_threads=128, attn_min_split=256, sample_threads=1024,
        decode_threads=256, decode_blocks_per_sm=1, decode_buckets=(1, 16, 64, 256),
    ),
    "sm_80": LaunchConfig(
        arch="sm_80", sm_count=108, threads=256, gemv_threads=128, gemv_tokens=8, gemv_max_tokens=32,
        gemm_tiles=((64, 64, 4, 4), (32, 32, 2, 2)),
        attn_rows=16, attn_chunk=32, attn_threads=128, attn_min_split=256, sample_threads=1024,
        decode_threads=128, decode_blocks_per_sm=2, decode_buckets=(1, 16, 64, 256),
    ),
    "fallback": LaunchConfig(
        arch="fallback", sm_count=16, threads=128, gemv_threads=128, gemv_tokens=4, gemv_max_tokens=16,
        gemm_tiles=((32, 32, 2, 2),),
        attn_rows=8, attn_chunk=32, attn_threads=64, attn_min_split=256, sample_threads=256,
        decode_threads=128, decode_blocks_per_sm=1, decode_buckets=(1, 16, 64),
    ),
}
for _c in TABLE.values():
    _c.validate()


def arch_for(compute_capability) -> str:
    """The table row for a compute capability (major, minor)."""
    major, minor = (int(v) for v in compute_capability)
    if major == 9:
        return "sm_90"
    if (major, minor) == (8, 0):
        return "sm_80"
    return "fallback"


def select(compute_capability, sm_count: int | None = None) -> LaunchConfig:
    cfg = TABLE[arch_for(compute_capability)]
    return cfg.with_sm_count(sm_count) if sm_count else cfg


def for_current_device() -> LaunchConfig:
    """The configuration of the current CUDA device (needs a driver)."""
    from numba import cuda

    dev = cuda.get_current_device()
    sms = getattr(dev, "MULTIPROCESSOR_COUNT", None)
    return select(dev.compute_capability, sms)
