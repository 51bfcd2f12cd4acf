"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end on the CPU backend."""
from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cpu import CpuBackend
from engine.llm import LLM
from engine.sampling import SamplingParams
from models.llama import LlamaModel, StepInput
from models.loader import load_model
from tests import reference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(model=default_model)


def test_capital_of_france_is_paris(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert out.outputs[0].text.startswith(" Paris"), out.outputs[0].text


def test_chat_answers_and_stops_at_end_of_turn(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                   SamplingParams(temperature=0.0, max_tokens=40))[0]
    c = out.outputs[0]
    assert "Paris" in c.text and c.finish_reason == "stop"
    assert c.token_ids[-1] in llm.tokenizer.stop_token_ids


def _logits(model, tokens):
    k, v = model.allocate_kv_cache(-(-len(tokens) // 16) + 1, 16)
    n = len(tokens)
    pos = np.arange(n, dtype=np.int32)
    step = StepInput(np.asarray(tokens, np.int32), pos, np.zeros(n, np.int32), pos.astype(np.int64),
                     np.arange(k.shape[1], dtype=np.int32)[None, :], np.arange(n, dtype=np.int32))
    return model.forward(step, k, v)


def test_f32_greedy_matches_the_reference_token_for_token(default_model):
    weights, tok = load_model(default_model, quantization="f32")
    model = LlamaModel(weights, CpuBackend())
    ids = tok.encode("The history of the Roman Empire")
    ours, ref = list(ids), list(ids)
    for _ in range(12):
        ours.append(int(np.argmax(_logits(model, ours)[-1])))
    dense = reference.densify(weights)
    for _ in range(12):
        ref.append(int(np.argmax(reference.forward(dense, ref)[-1])))
    assert ours == ref
    lg = _logits(model, ids)
    want = reference.forward(dense, ids)
    assert np.abs(lg - want).max() / np.abs(want).max() < 1e-4


def test_quantized_path_stays_close_on_logits(default_model):
    weights, tok = load_model(default_model)
    model = LlamaModel(weights, CpuBackend())
    ids = tok.encode("Water boils at a temperature of")
    got = _logits(model, ids)
    want = reference.forward(reference.densify(weights), ids)
    for g, w in zip(got, want):
        assert np.dot(g, w) / (np.linalg.norm(g) * np.linalg.norm(w)) > 0.999
