"""Both model families on one node, over HTTP: a Llama and a Gemma 3 resident side by side within the memory
budget, concurrent streams alternating between them (each answering as it does alone), a completions-only
model refusing chat, and the least recently used idle model evicted when a third does not fit."""
from __future__ import annotations

import threading

import pytest

from tests.node_fixtures import (  # noqa: F401 (start_node: a fixture)
    assert_openai_error, generate, make_tiny_model, metric, node_state, scrape, sse_events, start_node)
from tests.tiny_gemma import make_tiny_gemma_weights, write_tiny_gemma_gguf

pytestmark = pytest.mark.slow

SECRET = "two-families-test-secret"
BUDGET = 12 << 20   # tiny-llama (0.4 MB + 4 MiB KV) and tiny-gemma (0.8 MB + 4 MiB KV), not tiny-b as well


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("two-families")
    gemma = write_tiny_gemma_gguf(d / "tiny-gemma.gguf", make_tiny_gemma_weights(seed=21, max_position=1024))
    return {"llama": make_tiny_model(d, "tiny-llama", seed=11, max_position=1024), "gemma": gemma,
            "b": make_tiny_model(d, "tiny-b", seed=12, hidden=128, ffn=256, max_position=1024)}


def body(model: str, prompt: str, n: int = 20) -> dict:
    return {"model": model, "prompt": prompt, "sampling": {"max_tokens": n, "temperature": 0, "ignore_eos": True}}


def stream_tokens(url: str, b: dict) -> list[int]:
    with generate(url, {**b, "stream": True}, SECRET, stream=True) as r:
        assert r.status_code == 200, r.text
        events = sse_events(r)
    assert events[-1]["type"] == "done", events[-1]
    return [e["token_id"] for e in events if e["type"] == "token"]


def test_two_families_side_by_side_then_lru_eviction(start_node, models):
    url = start_node([models["llama"] + "=tiny-llama", models["gemma"] + "=tiny-gemma", models["b"] + "=tiny-b"],
                     SECRET, memory_budget=BUDGET, preload=["tiny-llama", "tiny-gemma"])
    s = node_state(url, SECRET)
    assert sorted(m["id"] for m in s["models"]) == ["tiny-gemma", "tiny-llama"]
    assert sum(m["bytes"] for m in s["models"]) <= BUDGET

    # what each prompt gives alone, then all of them at once, the two models alternating
    jobs = [body("tiny-llama" if i % 2 == 0 else "tiny-gemma", p)
            for i, p in enumerate(["the cat", "the cat is", "and the", "what is the cat on", "is it", "the"])]
    alone = [generate(url, j, SECRET).json()["choices"][0]["token_ids"] for j in jobs]
    assert all(len(t) == 20 for t in alone)
    together: list = [None] * len(jobs)

    def run(i):
        together[i] = stream_tokens(url, jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert together == alone
    m = scrape(url)
    assert metric(m, "zen_node_model_evictions_total") == 0

    # a base model without a chat template serves completions only
    chat = {"model": "tiny-gemma", "messages": [{"role": "user", "content": "hi"}], "sampling": {"max_tokens": 2}}
    assert_openai_error(generate(url, chat, SECRET), 400, "chat_not_supported", "messages")

    # tiny-gemma used last: a third model evicts the least recently used idle one, tiny-llama
    assert generate(url, body("tiny-gemma", "the cat", 2), SECRET).status_code == 200
    r = generate(url, body("tiny-b", "the cat", 3), SECRET)
    assert r.status_code == 200, r.text
    s = node_state(url, SECRET)
    assert sorted(m["id"] for m in s["models"]) == ["tiny-b", "tiny-gemma"]
    m = scrape(url)
    assert metric(m, "zen_node_model_evictions_total", model="tiny-llama") == 1
    assert metric(m, "zen_node_model_evictions_total", model="tiny-gemma") == 0
