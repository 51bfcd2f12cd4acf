"""numba.cuda kernels of the `cuda` backend, one module per op family (layouts: tests/reference.py).

  common     float32 constants, block reductions, weight element loaders per storage family
  rowwise    embedding gather, RMSNorm, RoPE + paged KV write, SwiGLU, row gather
  linear     GEMV (few tokens, weights dequantized in registers) and tiled GEMM (shared-memory stages)
  attention  paged attention for prefill and decode (online softmax, GQA, split-K) and the split merge
  sampling   the sampler of engine/backends/cpu_sampler.py, one block per row

Every kernel is decorated lazily (`@cuda.jit`, no signature), so importing needs no driver; variants whose
shared/local arrays depend on the launch configuration are built by cached factories (cuda/launch.py).
Note: the `cuda/` folder above has no __init__.py on purpose: it is a namespace package shared with NVIDIA's
cuda.bindings / cuda.core, which numba-cuda imports.
"""
