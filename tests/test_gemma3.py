"""Gemma 3 on a tiny random model: its ops against the float64 reference, the whole forward pass (chunked
prefill and decode over the paged cache, across the sliding window) against tests/reference.py's
gemma3_forward, and the GGUF and safetensors forms of the same model."""
from __future__ import annotations

import numpy as np
import pytest

from engine.backends import cpu_attention as attention
from engine.backends.cpu import CpuBackend
from engine.llm import LLM
from engine.sampling import SamplingParams
from models.build import build_model
from models.gemma3 import Gemma3Model
from models.llama import StepInput
from models.loader import load_model
from tests import reference as R
from tests.tiny_gemma import TINY_GEMMA_WINDOW, make_tiny_gemma_weights, make_tiny_spm_tokenizer, \
    write_tiny_gemma_gguf
from tests.tiny_model import write_tiny_safetensors


@pytest.fixture(scope="module")
def tiny_gemma_gguf(tmp_path_factory) -> str:
    return write_tiny_gemma_gguf(tmp_path_factory.mktemp("gemma") / "tiny-gemma.gguf", make_tiny_gemma_weights(3))


# ---- ops -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dh", [8, 16, 64])
@pytest.mark.parametrize("window", [1, 5, 16])
def test_windowed_paged_attention_matches_reference(dh, window):
    rng = np.random.default_rng(dh * 100 + window)
    bs = 4
    # a prefill chunk that crosses the window, a decode far past it, a short decode inside it
    case = R.paged_kv_case(rng, [(3, 9), (37, 1), (2, 1)], h=4, hkv=2, dh=dh, bs=bs)
    q, _, kc, vc = R.rope_store_kv(case, 10000.0)
    want = R.paged_attention(q, kc, vc, case["tables"], case["ctx"], case["qsl"], dh ** -0.5, window=window)
    be = CpuBackend()
    qkv = case["qkv"].copy()
    kcache, vcache = case["kc"].copy(), case["vc"].copy()
    cos, sin = be.rope_tables(64, dh, 10000.0)
    out = np.zeros((len(qkv), 4 * dh), np.float32)
    be.rope_attention(qkv, case["positions"], cos, sin, kcache, vcache, case["slot"], case["tables"],
                      case["token_seq"], 4, 2, dh ** -0.5, out, window=window)
    np.testing.assert_allclose(out, want.reshape(len(qkv), -1), rtol=1e-4, atol=1e-4)
    full = R.paged_attention(q, kc, vc, case["tables"], case["ctx"], case["qsl"], dh ** -0.5)
    assert np.abs(want - full).max() > 1e-3   # the window changed the answer: the case tests it


def test_head_rmsnorm_post_norm_and_gelu_match_reference():
    rng = np.random.default_rng(7)
    be = CpuBackend()
    t, h, hkv, dh, d, f = 5, 4, 2, 32, 48, 40
    qkv = rng.standard_normal((t, (h + 2 * hkv) * dh)).astype(np.float32)
    qw, kw = (1 + 0.1 * rng.standard_normal((2, dh))).astype(np.float32)
    got = qkv.copy()
    be.head_rmsnorm(got, qw, kw, h, hkv, 1e-6)
    q = R.rmsnorm(qkv[:, :h * dh].reshape(t, h, dh), qw, 1e-6).reshape(t, -1)
    k = R.rmsnorm(qkv[:, h * dh:(h + hkv) * dh].reshape(t, hkv, dh), kw, 1e-6).reshape(t, -1)
    np.testing.assert_allclose(got, np.concatenate([q, k, qkv[:, (h + hkv) * dh:]], axis=1), rtol=1e-5, atol=1e-5)

    x = rng.standard_normal((t, d)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    res = rng.standard_normal((t, d)).astype(np.float32)
    want = res + R.rmsnorm(x, w, 1e-6)
    be.rmsnorm_add(x.copy(), w, 1e-6, res)
    np.testing.assert_allclose(res, want, rtol=1e-5, atol=1e-5)

    gu = (3 * rng.standard_normal((t, 2 * f))).astype(np.float32)
    from models.quant import QuantTensor
    wd = rng.standard_normal((d, f)).astype(np.float32)
    out = np.zeros((t, d), np.float32)
    be.gelu_mul_matmul(gu, be.linear([QuantTensor.from_float(wd, "f32")]), out)
    np.testing.assert_allclose(out, R.gelu_tanh_mul(gu) @ wd.T, rtol=1e-4, atol=1e-4)
    h2 = rng.standard_normal((t, d)).astype(np.float32)
    want = h2 * np.sqrt(d)
    be.scale(h2, np.sqrt(d))
    np.testing.assert_allclose(h2, want, rtol=1e-6)


# ---- the whole forward pass ----------------------------------------------------------------------------

def run_chunks(model, tokens, chunks, block_size=4, seed=0):
    """Logits [len(tokens), V] computed in consecutive steps of `chunks` tokens (prefill chunks, then
    decode steps of 1) over a paged cache whose blocks (every layer group's) are in a random order."""
    n = len(tokens)
    per_table = -(-n // block_size)
    groups = 1 + model.window_groups
    nblocks = per_table * groups + 2
    tables = np.random.default_rng(seed).permutation(nblocks)[:per_table * groups].astype(np.int32)
    tables = tables.reshape(groups, 1, per_table)
    k, v = model.allocate_kv_cache(nblocks, block_size)
    out, start = [], 0
    for c in chunks:
        pos = np.arange(start, start + c, dtype=np.int32)
        slots = tables[:, 0, pos // block_size].astype(np.int64) * block_size + pos % block_size
        step = StepInput(np.asarray(tokens[start:start + c], np.int32), pos, np.zeros(c, np.int32), slots[0],
                         tables[0], np.arange(c, dtype=np.int32), slots[1:], tables[1:])
        out.append(np.array(model.forward(step, k, v)))
        start += c
    assert start == n
    return np.concatenate(out)


def test_forward_matches_reference_across_the_window(tiny_gemma_gguf):
    weights, tok = load_model(tiny_gemma_gguf)
    cfg = weights.config
    assert cfg.architecture == "gemma3" and cfg.sliding_window == TINY_GEMMA_WINDOW
    assert [cfg.is_local(i) for i in range(cfg.num_layers)] == [True] * 5 + [False]
    model = build_model(weights, CpuBackend())
    assert isinstance(model, Gemma3Model)
    tokens = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 3 * TINY_GEMMA_WINDOW + 3))
    got = run_chunks(model, tokens, [7, 9, 5] + [1] * (len(tokens) - 21))
    want = R.gemma3_forward(weights, tokens)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    # the window, the local RoPE base and the post-norms each change the logits: the reference checks them
    for changed in (R.gemma3_forward(weights, tokens, window=0), R.gemma3_forward(weights, tokens, local_theta=1e6)):
        assert np.abs(changed - want).max() / np.abs(want).max() > 1e-2


def test_gguf_and_safetensors_forms_give_the_same_model(tiny_gemma_gguf, tmp_path):
    weights, tok = load_model(tiny_gemma_gguf)
    write_tiny_safetensors(tmp_path / "hf", weights, tok)
    again, tok2 = load_model(tmp_path / "hf")
    assert again.config == weights.config
    for a, b in zip(weights.layers, again.layers):
        for name, v in a.norms().items():
            np.testing.assert_allclose(getattr(b, name), v, rtol=0, atol=1e-6)
        for name, m in a.matrices().items():
            np.testing.assert_array_equal(getattr(b, name).dequantize(), m.dequantize())
    import json
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["model_type"] == "gemma3_text" and hf["hidden_act"] == "gelu_pytorch_tanh"
    # Hugging Face stores Gemma's norm weights without the 1 that the GGUF (and ModelWeights) include
    from safetensors.numpy import load_file
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))["model.layers.0.input_layernorm.weight"]
    np.testing.assert_allclose(stored + 1, weights.layers[0].attn_norm, atol=1e-6)
    ids = tok.encode("the cat is on the mat")
    assert ids == tok2.encode("the cat is on the mat")
    np.testing.assert_allclose(R.gemma3_forward(again, ids), R.gemma3_forward(weights, ids), rtol=1e-6, atol=1e-6)
    # transformers leaves tie_word_embeddings out of a Gemma 3 config (its default, true)
    del hf["tie_word_embeddings"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
    assert load_model(tmp_path / "hf")[0].config == weights.config


def test_quantized_tiny_gemma_stays_close(tmp_path):
    path = write_tiny_gemma_gguf(tmp_path / "q8.gguf", make_tiny_gemma_weights(3, fmt="q8_0"))
    weights, _ = load_model(path)
    assert weights.formats() == {"q8_0"}
    model = build_model(weights, CpuBackend())
    tokens = list(np.random.default_rng(2).integers(0, weights.config.vocab_size, 20))
    got = run_chunks(model, tokens, [20])
    want = R.gemma3_forward(weights, tokens)
    for g, w in zip(got, want):
        assert np.dot(g, w) / (np.linalg.norm(g) * np.linalg.norm(w)) > 0.999


def test_engine_greedy_generation_equals_reference(tiny_gemma_gguf):
    llm = LLM(model=tiny_gemma_gguf, kv_cache_bytes=1 << 22, block_size=4)
    tok = make_tiny_spm_tokenizer()
    prompt = "what is the cat on"
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))[0].outputs[0]
    weights, _ = load_model(tiny_gemma_gguf)
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_token_id
    ref = list(ids)
    for _ in range(14):
        ref.append(int(np.argmax(R.gemma3_forward(weights, ref)[-1])))
    assert out.token_ids == ref[len(ids):]
    assert len(ref) > TINY_GEMMA_WINDOW   # the generation runs past the sliding window


# ---- the paged KV cache and the sliding window ------------------------------------------------------

def test_kv_cache_frees_local_blocks_out_of_the_window(tiny_gemma_gguf):
    from tests.test_engine import make_engine, req
    eng = make_engine(tiny_gemma_gguf, num_blocks=160, block_size=4, max_batched=16)
    model, kv = eng.model, eng.kv
    # 1 global layer, 5 local ones: groups of one layer; the KV cache shape says so
    assert (model.group_size, model.window_groups) == (1, 5) and eng.runner.k_cache.shape[0] == 1
    assert not kv.enable_prefix_caching
    prompts = [prompt_ids(s, n) for s, n in ((1, 30), (2, 5), (3, 19))]
    for i, p in enumerate(prompts):
        eng.add_request(req(f"r{i}", p, max_tokens=12, ignore_eos=True))
    outputs, saved = {}, []
    while eng.has_unfinished():
        for d in eng.step():
            outputs.setdefault(d.request_id, []).extend(d.token_ids)
        live = [t for s in eng.scheduler.running for t in kv.live_tables(s)]
        eng.pool.check_invariants(live)
        for s in eng.scheduler.running:
            held = [b for t in s.window_tables for b in t if b >= 0]
            # a local group holds blocks from the one the next query's window starts in, to the end
            first = kv.first_window_block(s.num_computed_tokens)
            assert all(len(t) == len(s.block_table) for t in s.window_tables)
            assert len(held) == kv.window_groups * (len(s.block_table) - first)
        saved.append(kv.window_saved_blocks)
    # a 42-token sequence keeps its local layers' last 8 positions (+ the block they start in) only
    assert max(saved) >= 5 * (42 // 4 - 3) and kv.window_saved_blocks == 0
    eng.pool.check_invariants([])
    weights, _ = load_model(tiny_gemma_gguf)
    for i, p in enumerate(prompts):   # what the freed blocks held was never needed again
        ref = list(p)
        for _ in range(12):
            ref.append(int(np.argmax(R.gemma3_forward(weights, ref, last_only=True)[-1])))
        assert outputs[f"r{i}"] == ref[len(p):]


def test_kv_capacity_counts_the_window(tiny_gemma_gguf):
    from tests.test_engine import make_engine
    eng = make_engine(tiny_gemma_gguf, num_blocks=60, block_size=4, max_batched=8)
    # all six groups for the first blocks, then only the global group's: longer than 60 / 6 blocks
    assert eng.max_seq_tokens > 60 // 6 * 4
    assert eng.kv.blocks_for_tokens(eng.max_seq_tokens, 8) <= 60 < eng.kv.blocks_for_tokens(eng.max_seq_tokens + 4, 8)


def prompt_ids(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(6, 300, n)]


@pytest.mark.parametrize("layers, groups", [(12, (2, 5)), (26, (26, 0))])
def test_layer_groups_of_other_depths(layers, groups):
    """12 layers: 2 global, 10 local in 5 groups of 2. 26 (Gemma 3 1B): 4 global and 22 local do not
    split evenly: one group, every layer's K/V kept, the same logits."""
    weights = make_tiny_gemma_weights(5, hidden=32, heads=2, head_dim=16, ffn=32, layers=layers, window=3)
    model = Gemma3Model(weights, CpuBackend())
    assert (model.group_size, model.window_groups) == groups
    assert sorted(set(model.layer_kv)) == sorted({(g, s) for g in range(groups[1] + 1) for s in range(groups[0])})
    tokens = list(np.random.default_rng(3).integers(0, weights.config.vocab_size, 11))
    got = run_chunks(model, tokens, [5, 6])
    want = R.gemma3_forward(weights, tokens)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


# ---- every layer in one call ---------------------------------------------------------------------------

def test_layer_stack_matches_the_layer_loop_bit_for_bit(monkeypatch):
    """run_gemma3_layers (one call for every layer) runs the forward's kernels in its order: the logits are
    identical, with formats that change from layer to layer and within q|k|v (as in a K-quant mix), scales
    of both kinds (halves in the legacy formats, float32 in the K-quants), every layer group and slot of
    the cache, prefill chunks and decodes across the window, and past one split attention part in the global
    layers. Chunks of at most CLAIMED_MAX_ROWS rows (the 7-token chunk, the decodes) run in one parallel
    region (run_gemma3_layers_claimed)."""
    import dataclasses

    from engine.backends import cpu_gemma3_layers
    from itertools import cycle

    from models.quant import QuantTensor
    w = make_tiny_gemma_weights(7, hidden=256, heads=4, head_dim=64, ffn=256, layers=12, window=5)
    mixes = cycle([("q5_0", "q5_0", "q8_0", "q4_k", "q5_0", "q6_k"), ("q4_k", "q6_k", "q6_k", "q8_0", "q4_1", "q4_k"),
                   ("q5_1", "q5_1", "q5_1", "q4_0", "q5_k", "q6_k")])

    def enc(m, fmt):
        return QuantTensor.from_float(m.dequantize(), fmt)
    layers = [dataclasses.replace(ly, q=enc(ly.q, q), k=enc(ly.k, k), v=enc(ly.v, v), o=enc(ly.o, o),
                                  gate=enc(ly.gate, gu), up=enc(ly.up, gu), down=enc(ly.down, down))
              for ly, (q, k, v, o, gu, down) in zip(w.layers, mixes)]
    model = Gemma3Model(dataclasses.replace(w, layers=layers), CpuBackend(int8_activations=True))
    stack = model.layer_stack
    assert stack is not None and (model.group_size, model.window_groups) == (2, 5)
    parts = [p for ly in model.layers for s in ("qkv", "o", "gate_up", "down") for p in getattr(ly, s).parts]
    assert {p.family for p in parts} == {"q4", "q5", "q8", "q8h"} and stack.s16.size
    assert {p.arrays[1].itemsize for p in parts} == {1, 2}   # K-quant byte scales (in codes) and halves
    assert any(len(ly.qkv.parts) > 1 for ly in model.layers)
    # the layers read the packed weights: one copy, not two
    assert all(np.shares_memory(p.arrays[0], stack.codes) for p in parts)
    tokens = list(np.random.default_rng(4).integers(0, w.config.vocab_size, attention.SPLIT_PART_KEYS + 8))
    regions = []
    claimed = cpu_gemma3_layers.run_gemma3_layers_claimed
    monkeypatch.setattr(cpu_gemma3_layers, "run_gemma3_layers_claimed",
                        lambda *a: regions.append(a[0].shape[0]) or claimed(*a))
    logits = {}
    chunks = [7, 9] + [1] * (len(tokens) - 16)
    for use_stack in (True, False):
        model.layer_stack = stack if use_stack else None
        logits[use_stack] = run_chunks(model, tokens, chunks)
    assert regions == [c for c in chunks if c <= 8]      # the 9-token chunk: a region per kernel
    np.testing.assert_array_equal(logits[True], logits[False])
    # and right: the packed copy is what the layers' own linears read too, so the reference checks both
    want = R.gemma3_forward(dataclasses.replace(w, layers=layers), tokens)
    for g, r in zip(logits[True], want):
        assert np.dot(g, r) / (np.linalg.norm(g) * np.linalg.norm(r)) > 0.999


def test_layer_stack_only_on_int8_products():
    w = make_tiny_gemma_weights(2, hidden=64, fmt="q8_0")
    assert Gemma3Model(w, CpuBackend(int8_activations=True)).layer_stack is not None
    assert Gemma3Model(w, CpuBackend(int8_activations=False)).layer_stack is None   # exact float path
    assert Gemma3Model(make_tiny_gemma_weights(2, hidden=64), CpuBackend()).layer_stack is None   # float weights
