"""Q5_0, Q5_1 and the K-quants end to end on the CPU: a tiny model written in each format by
`python -m models.convert`, read back and run (model forward and engine), against the float path of the
same dequantized weights; and a Gemma-style mix of formats in one model, each linear in its own format."""
from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cpu import CpuBackend
from engine.llm import LLM
from engine.sampling import SamplingParams
from models import convert
from models.llama import LlamaModel, StepInput
from models.quant import LAYOUT_BYTES_PER_WEIGHT
from models.loader import load_model
from tests import reference as R
from tests.quant_blocks import MIXED_LAYERS, mixed_format_weights
from tests.tiny_model import make_tiny_weights, write_tiny_gguf

NEW_FORMATS = ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
TOKENS = np.array([1, 5, 40, 260, 100, 7, 77, 270, 3, 12, 150, 9], np.int32)


def _forward(model, tokens, chunks=(7, 3, 1, 1)):
    """Logits of every token: prefill chunks, then decodes, through the paged KV cache."""
    bs = 4
    nblk = -(-len(tokens) // bs)
    k, v = model.allocate_kv_cache(nblk + 1, bs)
    table = np.arange(nblk, dtype=np.int32)[::-1].copy()[None]
    out, start = [], 0
    for n in chunks:
        pos = np.arange(start, start + n, dtype=np.int32)
        step = StepInput(tokens[start:start + n], pos, np.zeros(n, np.int32),
                         table[0, pos // bs].astype(np.int64) * bs + pos % bs, table, np.arange(n, dtype=np.int32))
        out.append(np.array(model.forward(step, k, v)))
        start += n
    return np.concatenate(out)


def _check_close(got, ref, int8, what):
    """The tolerances of test_cpu_kernels.test_tiny_model_forward: exact path 1e-4 relative, int8
    activations cosine > 0.999 per token."""
    if int8:
        cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
        assert cos.min() > 0.999, f"{what}: int8 cosine {cos.min()}"
    else:
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < 1e-4, f"{what}: relative error {err}"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny float model (rows of 256) as GGUF, converted to each new format by models.convert."""
    d = tmp_path_factory.mktemp("formats")
    src = write_tiny_gguf(d / "tiny-f32.gguf", make_tiny_weights(11, "f32", hidden=256, ffn=256))
    out = {}
    for fmt in NEW_FORMATS:
        assert convert.main([src, str(d / fmt), "--format", fmt]) == 0
        out[fmt] = str(d / fmt)
    return out


@pytest.mark.parametrize("fmt", NEW_FORMATS)
def test_converted_model_keeps_its_format_and_matches_the_float_path(converted, fmt):
    weights, _ = load_model(converted[fmt])
    assert weights.formats() == {fmt}
    ref = R.forward(weights, TOKENS)   # float64, on the dequantized weights
    for int8 in (False, True):
        got = _forward(LlamaModel(weights, CpuBackend(int8)), TOKENS)
        _check_close(got, ref, int8, f"{fmt} int8={int8}")
    # and the backend's own float path of the same dequantized weights
    f32 = _forward(LlamaModel(weights.converted("f32"), CpuBackend(False)), TOKENS)
    _check_close(_forward(LlamaModel(weights, CpuBackend(False)), TOKENS), f32, False, f"{fmt} vs f32 path")


def test_a_model_whose_rows_no_block_divides_converts_to_f16_and_runs(tmp_path):
    """Rows of 80 and 112 values: neither a K-quant's 256 nor its fallback's 32 divides them; the
    conversion writes them in f16 (llama.cpp's last fallback) and the model runs as its float path."""
    src = write_tiny_gguf(tmp_path / "odd.gguf", make_tiny_weights(5, "f32", hidden=80, ffn=112))
    assert convert.main([src, str(tmp_path / "odd-q4_k"), "--format", "q4_k"]) == 0
    weights, _ = load_model(str(tmp_path / "odd-q4_k"))
    assert weights.formats() == {"f16"}
    _check_close(_forward(LlamaModel(weights, CpuBackend(False)), TOKENS), R.forward(weights, TOKENS), False, "f16")


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_engine_serves_a_converted_model_like_its_float_path(converted, fmt):
    """LLM on the converted directory vs LLM on the same weights dequantized to float32 (quantization='f32'):
    the same greedy tokens (fixed weights and prompt, so the comparison is deterministic)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = {}
    for quant in (None, "f32"):
        llm = LLM(converted[fmt], quantization=quant, backend="cpu", kv_cache_bytes=1 << 22)
        assert llm.engine.formats == [quant or fmt]
        outs[quant] = llm.generate(TOKENS.tolist(), params)[0].outputs[0].token_ids
    assert len(outs[None]) == 8 and outs[None] == outs["f32"]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    w = mixed_format_weights(make_tiny_weights(12, "f32", hidden=256, ffn=256, tie_embeddings=False))
    path = write_tiny_gguf(tmp_path_factory.mktemp("mixed") / "mixed.gguf", w)
    return load_model(path)[0]


def test_mixed_formats_from_one_gguf_each_linear_in_its_own_format(mixed):
    assert mixed.embed.format == "q8_0" and mixed.lm_head.format == "q6_k"
    for lw, fmts in zip(mixed.layers, MIXED_LAYERS):
        assert {n: m.format for n, m in lw.matrices().items()} == fmts
    backend = CpuBackend(True)
    model = LlamaModel(mixed, backend)
    qkv = model.layers[0].qkv
    assert qkv.formats == ("q5_0", "q5_0", "q8_0") and [p.family for p in qkv.parts] == ["q5", "q5", "q8"]
    assert [p.family for p in model.layers[0].o.parts] == ["q4"] and model.layers[1].qkv.formats == ("q5_0",)
    assert [p.family for p in model.layers[0].down.parts] == ["q8h"]
    assert model.layer_stack is None   # the slots differ between layers: the per-op loop
    ref = R.forward(mixed, TOKENS)
    for int8 in (False, True):
        _check_close(_forward(LlamaModel(mixed, CpuBackend(int8)), TOKENS), ref, int8, f"mixed int8={int8}")


@pytest.mark.parametrize("fmt", sorted(LAYOUT_BYTES_PER_WEIGHT["cpu"]))
def test_the_layout_sizes_a_budget_counts_are_the_backends_layouts(fmt):
    """models.quant.LAYOUT_BYTES_PER_WEIGHT (what a node's memory budget counts before a load) is what the
    CPU's and the CUDA backend's layouts of the format take."""
    from cuda.backend import device_layout, layout_nbytes
    from tests.quant_blocks import random_tensor
    t = random_tensor(np.random.default_rng(0), fmt, 64, 512)
    n = t.shape[0] * t.shape[1]
    assert CpuBackend().linear([t]).nbytes / n == LAYOUT_BYTES_PER_WEIGHT["cpu"][fmt]
    assert layout_nbytes(*device_layout(t)) / n == LAYOUT_BYTES_PER_WEIGHT["cuda"][fmt]
