"""Gemma 3 270M (`make model-gemma`) end to end on the CPU backend, in float32 (`quantization="f32"`, which
dequantizes its Q4_K / Q5_0 / Q6_K / Q8_0 tensors), against the float64 reference (tests/reference.py),
and its SentencePiece tokenizer against a plain SentencePiece BPE over the file's own vocabulary."""
from __future__ import annotations

import os

import numpy as np
import pytest

from engine.llm import LLM
from engine.sampling import SamplingParams
from models.loader import REPO_ROOT, load_model, load_tokenizer, read_gguf_fields
from tests import reference
from tests.test_tokenizer_spm import spm_encode_reference

pytestmark = pytest.mark.slow

GEMMA_PATH = os.path.join(REPO_ROOT, "models", "weights", "gemma-3-270m-q4_k_m.gguf")
PROMPTS = ["The history of the Roman Empire", "def fibonacci(n):\n", "Les fleurs du jardin sont"]
# ~700 tokens: the last positions' local layers see only the window's 512, the global ones all of it
LONG_PROMPT = " ".join(f"Line {i}: the river flows past the old mill towards the sea." for i in range(50))


@pytest.fixture(scope="module")
def gemma_path() -> str:
    if not os.path.exists(GEMMA_PATH):
        pytest.fail(f"{GEMMA_PATH} is missing: run `make model-gemma` first")
    return GEMMA_PATH


@pytest.fixture(scope="module")
def llm(gemma_path):
    return LLM(model=gemma_path, quantization="f32", kv_cache_bytes=96 << 20, backend="cpu")


@pytest.fixture(scope="module")
def dense(gemma_path):
    weights, _ = load_model(gemma_path, quantization="f32")
    return reference.densify(weights)


def test_the_file_is_what_the_issue_describes(gemma_path):
    weights, tok = load_model(gemma_path)
    c = weights.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == \
        ("gemma3", 18, 640, 4, 1, 256)
    assert (c.intermediate_size, c.vocab_size, c.tie_embeddings, c.sliding_window) == (2048, 262144, True, 512)
    assert [i for i in range(18) if not c.is_local(i)] == [5, 11, 17]
    assert (c.rope_theta, c.rope_local_theta) == (1e6, 1e4) and abs(c.rms_norm_eps - 1e-6) < 1e-12
    assert weights.layers[0].q.shape == (1024, 640) and weights.lm_head is None
    assert tok.chat_template is None and tok.bos_token_id == 2


def test_tokenizer_matches_sentencepiece_bpe_on_the_real_vocabulary(gemma_path):
    tok = load_tokenizer(gemma_path)
    fields = dict(read_gguf_fields(gemma_path))
    for text in PROMPTS + ["Question: What is the capital of France?\nAnswer:", "  indented\n\n\tcode();",
                           "emoji 🦙, accents é à ü, 漢字, Ω", LONG_PROMPT[:300]]:
        ids = tok.encode(text)
        assert ids == spm_encode_reference(text, fields), text
        assert ids[0] == 2 and tok.decode(ids) == text


def test_paris(llm):
    out = llm.generate("Question: What is the capital of France?\nAnswer:",
                       SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0]
    assert out.text.startswith(" Paris"), out.text


def _reference_greedy(dense, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(np.argmax(reference.gemma3_forward(dense, ids, last_only=True)[-1])))
    return ids


@pytest.mark.parametrize("prompt", PROMPTS)
def test_f32_greedy_equals_the_reference(llm, dense, prompt):
    ids = llm.tokenizer.encode(prompt)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert ids + out.token_ids == _reference_greedy(dense, ids, 16)


def test_f32_greedy_equals_the_reference_past_the_sliding_window(llm, dense):
    ids = llm.tokenizer.encode(LONG_PROMPT)
    assert len(ids) > 512 + 64
    out = llm.generate(LONG_PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert ids + out.token_ids == _reference_greedy(dense, ids, 4)


def test_stored_formats_stay_close_to_the_reference(gemma_path, dense):
    """The file as stored (Q4_K, Q5_0, Q6_K, Q8_0 matrices dequantized in registers, int8 activations
    where the kernels use them): every position's logits close to the float64 reference of the same
    dequantized weights, and the answer the float path gives."""
    from engine.backends.cpu import CpuBackend
    from models.build import build_model
    from tests.test_gemma3 import run_chunks
    from models.inspect import inspect_model
    weights, tok = load_model(gemma_path)
    assert weights.formats() >= {"q4_k", "q5_0", "q6_k", "q8_0"}
    ids = tok.encode("Question: What is the capital of France?\nAnswer:")
    model = build_model(weights, CpuBackend())
    # a node's memory budget counts the CPU's layouts before a load, from the file's tensor types alone
    info = inspect_model(gemma_path)
    assert info.weight_bytes(None, "cpu") == model.nbytes > info.stored_bytes
    got = run_chunks(model, ids, [len(ids)], block_size=16)
    want = reference.gemma3_forward(dense, ids)
    for g, w in zip(got, want):
        assert np.dot(g, w) / (np.linalg.norm(g) * np.linalg.norm(w)) > 0.999
    assert tok.decode([int(np.argmax(got[-1]))]) == " Paris"
