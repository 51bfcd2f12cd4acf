"""Sizes of every check and benchmark of gpu_check: FULL on a GPU, TINY in the CUDA simulator."""
from __future__ import annotations

import dataclasses

BLOCK_SIZE = 16
CHECK_PROMPT = "Explain in two sentences why the sky is blue."


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes of every check and benchmark. FULL runs on the GPU; TINY runs the same code in the CUDA simulator
    (tests/test_cuda_kernels.py) so the script is exercised without a GPU."""
    batches: tuple = (1, 16, 64, 256)   # decode batch sizes
    prompt_len: int = 128               # context of every sequence before the timed decode steps
    decode_steps: int = 32              # timed decode steps per batch size (after plan.warmup_steps)
    prefill_seqs: int = 16              # prefill benchmark: this many prompts of prompt_len in one step
    greedy_tokens: int = 24             # cpu/cuda greedy comparison
    k: int = 576                        # kernel checks: input features
    n: int = 300                        # kernel checks: output features
    vocab: int = 49152                  # sampler check: vocabulary
    sample_rows: int = 32               # sampler check: rows (the first 8 exercise every parameter)
    attn_seqs: tuple = ((0, 100), (700, 1), (300, 37))     # (first position, tokens) of each sequence
    attn_heads: tuple = ((9, 3, 64), (8, 2, 128))          # (H, Hkv, Dh)
    formats: tuple = ("q4_1", "q4_0", "q8_0", "f16", "bf16", "f32")  # weight formats of the matmul checks
    warmup_steps: int = 3               # decode steps before the timed ones
    prefill_reps: int = 5               # timed repetitions of the prefill step
    timing_tokens: tuple = (1, 16, 64, 256)   # kernel timings: input rows of the matmuls
    timing_batches: tuple = (1, 64, 256)      # kernel timings: decode batches of attention and sampling
    timing_contexts: tuple = (160, 2048)      # kernel timings: attention context lengths
    timing_max_reps: int = 200                # kernel timings: most timed repetitions of one call
    profile_batches: tuple = (1, 256)         # decode_step profile: batch sizes
    profile_steps: int = 5                    # decode_step profile: steps timed per batch size
    tiny_model: bool = False            # a tiny synthetic model instead of the default one


FULL = Plan()
TINY = Plan(batches=(2,), prompt_len=5, decode_steps=1, prefill_seqs=1, greedy_tokens=2, k=64, n=20, vocab=300,
            sample_rows=9, attn_seqs=((0, 9), (40, 1), (20, 5)), attn_heads=((2, 1, 72),), formats=("q4_1",),
            warmup_steps=1, prefill_reps=1, timing_tokens=(3,), timing_batches=(2,), timing_contexts=(12,),
            timing_max_reps=1, profile_batches=(2,), profile_steps=1, tiny_model=True)


def tiny_launch_config():
    """A small launch configuration that the CUDA simulator runs in seconds."""
    from cuda import launch

    return dataclasses.replace(launch.TABLE["fallback"], arch="simulator", sm_count=1, threads=32, gemv_threads=64,
                               gemv_tokens=2, gemv_max_tokens=1, gemm_tiles=((16, 16, 2, 2),),
                               attn_rows=8, attn_chunk=8, attn_threads=32, attn_min_split=8, sample_threads=32,
                               decode_threads=32, decode_buckets=(2,))
