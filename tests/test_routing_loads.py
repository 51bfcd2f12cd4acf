"""One cold load per model, not one per gateway worker (issue 25), with real processes: two engine nodes
of the default model (A with zen-small resident, B empty, small KV budgets) behind one gateway under
gunicorn with the shipped two workers, the shipped embedded store and the shipped poll interval; the
cold load weighs a hundred times its seconds, so that no request is worth a second copy.

  * zen-small-q8 requests one after another: one load of q8_0 over both nodes (it was one per worker);
  * a burst of eight concurrent zen-small-f16 requests: one load of f16;
  * a node killed while it loads a model is skipped and the load is retried on the other node.

The loads are counted by each node's zen_node_model_loads_total.
"""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.node_fixtures import launch_node, metric, node_state, scrape
from tests.serving_fixtures import NODE_SECRET, ServingStack, gateway_config, launch_gateway

pytestmark = pytest.mark.slow

MODEL_PATH = Path(__file__).resolve().parents[1] / "models" / "weights" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "SmolLM2-135M-Instruct"
LOADS = "zen_node_model_loads_total"
ALIASES = ["zen-small", "zen-small-q8", "zen-small-f16"]
GATEWAY = {
    "limits": {"storage_url": "embedded://"},                 # the shipped store
    "nodes": {"poll_interval_s": 1.0, "state_ttl_s": 5.0},    # the shipped poll: a view is up to 1 s old
    "tiers": {"load": {"models": ALIASES}},
    # a second copy never pays off here: the rule's exception (a second load when the first node's
    # estimated wait exceeds a cold load) turns on the nodes' timings; tests/test_gateway_router.py has it
    "routing": {"gamma": 100.0},
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not MODEL_PATH.exists():
        pytest.fail(f"the default model is missing: run `make model` ({MODEL_PATH})")
    directory = str(tmp_path_factory.mktemp("routing-loads"))
    started = ServingStack(directory)
    try:
        for preload in (None, []):     # A loads zen-small at start; B starts empty
            started.nodes.append(launch_node([str(MODEL_PATH)], NODE_SECRET, log_dir=directory, threads=48,
                                             kv_cache_bytes="4MiB", load_wait=300, preload=preload))
        started.gateway = launch_gateway(gateway_config(GATEWAY), node_urls=[n.url for n in started.nodes],
                                         workers=2, threads=16, log_dir=directory)
        yield started
    finally:
        started.stop()


def _chat(stack, alias: str, i: int) -> requests.Response:
    return requests.post(stack.url + "/v1/chat/completions", headers=stack.auth("loadco"), timeout=600, json={
        "model": alias, "messages": [{"role": "user", "content": f"Say hi {i}"}], "max_tokens": 2})


def _loads(stack, quantization: str, nodes=None) -> list[float]:
    return [metric(scrape(n.url), LOADS, model=MODEL_ID, quantization=quantization)
            for n in (nodes if nodes is not None else stack.nodes)]


def test_the_setting_of_the_report(stack):
    """A holds zen-small, B holds nothing; zen-small goes to A."""
    assert [m["quantization"] for m in node_state(stack.nodes[0].url, NODE_SECRET)["models"]] == ["q4_1"]
    assert node_state(stack.nodes[1].url, NODE_SECRET)["models"] == []
    for i in range(4):
        assert _chat(stack, "zen-small", i).status_code == 200
    assert _loads(stack, "q4_1") == [1, 0]


def test_requests_one_after_another_load_the_model_once(stack):
    for i in range(4):
        r = _chat(stack, "zen-small-q8", i)
        assert r.status_code == 200, r.text
    assert sum(_loads(stack, "q8_0")) == 1, (_loads(stack, "q8_0"), stack.logs())


def test_a_burst_of_concurrent_requests_loads_the_model_once(stack):
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _chat(stack, "zen-small-f16", i), range(8)))
    assert [r.status_code for r in answers] == [200] * 8, [r.text[:200] for r in answers]
    assert sum(_loads(stack, "f16")) == 1, (_loads(stack, "f16"), stack.logs())


def test_a_node_that_dies_while_loading_is_skipped_and_the_load_retried_elsewhere(stack):
    # no node holds f16 again: the idle copy goes (the burst is over)
    for node in stack.nodes:
        requests.post(node.url + "/v1/models/unload", json={"model": MODEL_ID, "quantization": "f16"},
                      headers={"X-Node-Secret": NODE_SECRET}, timeout=30)
    before = _loads(stack, "f16")
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_chat, stack, "zen-small-f16", 99)
        loading = None
        deadline = time.monotonic() + 120
        while loading is None and time.monotonic() < deadline:
            for node in stack.nodes:
                if any(x["quantization"] == "f16" for x in node_state(node.url, NODE_SECRET)["loading"]):
                    loading = node
            time.sleep(0.02)
        assert loading is not None, "no node started loading f16"
        os.killpg(loading.proc.pid, signal.SIGKILL)
        loading.proc.wait(10)
        r = answer.result(timeout=600)
    assert r.status_code == 200, r.text
    survivor = next(n for n in stack.nodes if n is not loading)
    i = stack.nodes.index(survivor)
    assert _loads(stack, "f16", [survivor]) == [before[i] + 1]
    # the dead node is skipped from now on, and nothing loads the model a second time
    for j in range(3):
        assert _chat(stack, "zen-small-f16", 100 + j).status_code == 200
    assert _loads(stack, "f16", [survivor]) == [before[i] + 1]
