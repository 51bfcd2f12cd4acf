"""Random weight matrices in each block format, for the kernel tests: legacy formats encoded from random
floats by gguf, K-quants packed from random fields (super-scales, 6/8-bit sub-block scales and mins, codes),
as gguf cannot encode those. Either way a test compares with gguf's own dequantization
(QuantTensor.dequantize calls gguf.quants.dequantize)."""
from __future__ import annotations

import numpy as np

from models import kquants
from models.formats import K_FORMATS
from models.quant import BLOCK_VALUES, QuantTensor


def row_length(fmt: str, k: int) -> int:
    """k rounded up to the format's block (K-quants: 256)."""
    block = BLOCK_VALUES.get(fmt, 1)
    return -(-k // block) * block


def random_kquant(rng, fmt: str, n: int, k: int, scale: float = 0.5) -> QuantTensor:
    """Random K-quant super-blocks whose values are about `scale` in size."""
    blocks = n * k // kquants.QK_K
    subs = kquants.QK_K // kquants.SUB[fmt]
    top = 1 << kquants.CODE_BITS[fmt]
    spread = scale / (32 * top / 2)   # sub-block scales ~32 times codes ~top/2 ~ scale

    def half(x):
        return np.asarray(x, np.float16).astype(np.float32)

    d = half(spread * rng.uniform(0.5, 1.5, blocks))
    if fmt == "q6_k":
        sc = rng.integers(-127, 128, (blocks, subs)) // 2
        m = np.zeros((blocks, subs))
        dmin = np.zeros(blocks, np.float32)
    else:
        sc, m = rng.integers(1, 64, (blocks, subs)), rng.integers(0, 64, (blocks, subs))
        dmin = half(spread * top / 2 * rng.uniform(0.5, 1.5, blocks))
    fields = kquants.KFields(d, dmin, sc.astype(np.int32), m.astype(np.int32),
                             rng.integers(0, top, (blocks, kquants.QK_K)).astype(np.uint8))
    return QuantTensor(fmt, (n, k), kquants.pack(fmt, fields).reshape(n, -1))


def random_tensor(rng, fmt: str, n: int, k: int, scale: float = 0.5) -> QuantTensor:
    if fmt in K_FORMATS:
        return random_kquant(rng, fmt, n, k, scale)
    w = rng.standard_normal((n, k)).astype(np.float32) * np.float32(scale)
    w[w == 0] = scale
    return QuantTensor.from_float(w, fmt)


# the per-matrix formats of a Q4_K_M file like Gemma 3's (q5_0 where rows are 640 long there)
MIXED_LAYERS = (
    {"q": "q5_0", "k": "q5_0", "v": "q8_0", "o": "q4_k", "gate": "q5_0", "up": "q5_0", "down": "q6_k"},
    {"q": "q5_0", "k": "q5_0", "v": "q5_0", "o": "q4_k", "gate": "q5_0", "up": "q5_0", "down": "q4_k"},
)


def mixed_format_weights(w, layer_formats=MIXED_LAYERS, embed: str = "q8_0", lm_head: str = "q6_k"):
    """The model `w` (float weights, rows of 256 multiples) with its matrices in a mix of formats, by default
    Q4_K_M-style: q8_0 embedding, q5_0 / q8_0 / q4_k / q6_k layers (layer_formats, cycled over the layers)."""
    from models.weights import LayerWeights, ModelWeights
    layers = []
    for i, lw in enumerate(w.layers):
        fmts = layer_formats[i % len(layer_formats)]
        layers.append(LayerWeights(attn_norm=lw.attn_norm, ffn_norm=lw.ffn_norm,
                                   **{n: m.convert(fmts[n]) for n, m in lw.matrices().items()}))
    head = None if w.lm_head is None else w.lm_head.convert(lm_head)
    return ModelWeights(w.config, w.embed.convert(embed), layers, w.final_norm, head, dict(w.metadata))
