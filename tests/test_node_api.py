"""The engine node over real HTTP (gunicorn on loopback): generation, streaming, state, metrics, auth,
bad input, model management, and abort when a streaming client goes away."""
from __future__ import annotations

import json
import os

import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.node_fixtures import (SECRET_HEADER, assert_openai_error, generate, launch_node, metric, node_state,
                                 scrape, sse_events, tiny_models, wait_for)  # noqa: F401 (tiny_models: fixture)

SECRET = "node-api-test-secret"
AUTH = {SECRET_HEADER: SECRET}
METRIC_NAMES = [
    "zen_node_time_to_first_token_seconds", "zen_node_inter_token_latency_seconds",
    "zen_node_e2e_request_latency_seconds", "zen_node_request_queue_time_seconds",
    "zen_node_request_prefill_time_seconds", "zen_node_request_decode_time_seconds",
    "zen_node_num_requests_running", "zen_node_num_requests_waiting", "zen_node_kv_cache_usage_perc",
    "zen_node_prefix_cache_queries", "zen_node_prefix_cache_hits", "zen_node_prefix_cache_hit_rate",
    "zen_node_iteration_batch_size", "zen_node_prompt_tokens", "zen_node_generation_tokens",
    "zen_node_request_success", "zen_node_accelerator_memory_used_bytes", "zen_node_accelerator_memory_total_bytes",
    "zen_node_accelerator_utilization_ratio", "zen_node_model_load_time_seconds", "zen_node_models_resident",
    "zen_node_kv_cache_window_saved_bytes",
]


@pytest.fixture(scope="module")
def node(tiny_models, tmp_path_factory):
    n = launch_node([tiny_models["a"] + "=tiny-a", tiny_models["b"] + "=tiny-b"], SECRET,
                    log_dir=str(tmp_path_factory.mktemp("node-api")))
    yield n.url
    n.stop()


def post(url, body, **kw):
    return generate(url, body, SECRET, **kw)


def state(url) -> dict:
    return node_state(url, SECRET)


def test_generate_json(node):
    r = post(node, {"request_id": "r-json", "model": "tiny-a", "org": "acme", "latency_class": "realtime",
                    "prompt": "the cat is", "sampling": {"max_tokens": 6, "temperature": 0, "logprobs": 2,
                                                        "ignore_eos": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["request_id"] == "r-json" and body["model"] == "tiny-a"
    (c,) = body["choices"]
    assert c["index"] == 0 and c["finish_reason"] == "length" and len(c["token_ids"]) == 6
    assert isinstance(c["text"], str)
    assert len(c["logprobs"]) == 6
    lp = c["logprobs"][0]
    assert lp["token_id"] == c["token_ids"][0] and lp["logprob"] <= 0 and isinstance(lp["token"], str)
    assert len(lp["top"]) == 2 and {"token_id", "token", "bytes", "logprob"} == set(lp["top"][0])
    # a token's bytes are its own: all of them together are the text's (which ends on a whole character)
    raw = b"".join(bytes(e["bytes"]) for e in c["logprobs"])
    assert raw.decode("utf-8", errors="replace") == c["text"]
    u = body["usage"]
    assert u["completion_tokens"] == 6 and u["prompt_tokens"] > 0
    assert u["total_tokens"] == u["prompt_tokens"] + 6
    t = body["timings"]
    assert set(t) == {"queue_s", "prefill_s", "ttft_s", "mean_itl_s", "total_s"}
    assert 0 <= t["queue_s"] <= t["ttft_s"] <= t["total_s"] and t["mean_itl_s"] >= 0


def test_greedy_is_deterministic_and_n_sums_usage(node):
    body = {"model": "tiny-b", "prompt_token_ids": [5, 6, 7, 8], "sampling": {"max_tokens": 5, "temperature": 0,
                                                                             "ignore_eos": True}}
    a, b = post(node, body).json(), post(node, body).json()
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    many = post(node, {**body, "sampling": {"max_tokens": 4, "n": 3, "seed": 7, "ignore_eos": True}}).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert many["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16, "cached_tokens": 0}


def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(node):
    body = {"model": "tiny-b", "prompt_token_ids": list(range(60, 100)), "sampling": {"max_tokens": 2}}
    first, again = post(node, body).json()["usage"], post(node, body).json()["usage"]
    assert first["cached_tokens"] == 0 and 0 < again["cached_tokens"] < 40 and again["prompt_tokens"] == 40


def test_generate_stream(node):
    with post(node, {"model": "tiny-a", "messages": [{"role": "user", "content": "hi there"}], "stream": True,
                     "sampling": {"max_tokens": 7, "ignore_eos": True, "logprobs": 0, "seed": 3}},
              stream=True) as r:
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(r)
    tokens, done = events[:-1], events[-1]
    assert [e["type"] for e in tokens] == ["token"] * 7
    assert all(e["index"] == 0 and isinstance(e["token_id"], int) and isinstance(e["text"], str) for e in tokens)
    assert all(e["logprobs"]["token_id"] == e["token_id"] for e in tokens)
    assert done["type"] == "done" and done["choices"] == [{"index": 0, "finish_reason": "length"}]
    assert done["usage"]["completion_tokens"] == 7
    assert done["timings"]["ttft_s"] is not None and done["timings"]["total_s"] >= done["timings"]["ttft_s"]


def test_stream_text_matches_json_text(node):
    body = {"model": "tiny-a", "prompt": "and the", "sampling": {"max_tokens": 12, "temperature": 0,
                                                              "ignore_eos": True}}
    whole = post(node, body).json()["choices"][0]
    with post(node, {**body, "stream": True}, stream=True) as r:
        events = sse_events(r)
    assert "".join(e["text"] for e in events if e["type"] == "token") == whole["text"]
    assert [e["token_id"] for e in events if e["type"] == "token"] == whole["token_ids"]


def test_a_stop_string_ends_the_text_before_it_or_with_it_kept_after_it(node):
    body = {"model": "tiny-a", "prompt": "and the", "sampling": {"max_tokens": 12, "temperature": 0,
                                                              "ignore_eos": True}}
    text = post(node, body).json()["choices"][0]["text"]
    stop = text[3:5]
    assert len(stop) == 2
    for kept in (False, True):
        c = post(node, {**body, "sampling": {**body["sampling"], "stop": [stop],
                                             "include_stop_str_in_output": kept}}).json()["choices"][0]
        assert c["finish_reason"] == "stop" and c["text"] == text[:text.index(stop) + (2 if kept else 0)]


def test_state_shape(node):
    s = state(node)
    assert s["healthy"] is True and s["node_id"]
    assert s["available_models"] == ["tiny-a", "tiny-b"]
    ids = sorted(m["id"] for m in s["models"])
    assert ids == ["tiny-a", "tiny-b"]
    for m in s["models"]:
        for key in ("version", "quantization", "bytes", "load_time_s", "prefill_tokens_per_s",
                    "decode_tokens_per_s", "running", "waiting", "admitted"):
            assert key in m
        assert m["quantization"] == "f32" and m["bytes"] > 0 and m["load_time_s"] > 0
    assert 0.0 <= s["utilization"] <= 1.0 and 0.0 <= s["kv_cache_usage"] <= 1.0
    assert set(s["queue"]) == {"waiting", "running", "admitted", "max_waiting", "max_running", "admitted_by_class",
                               "admitted_tokens_by_class"}
    assert s["queue"]["admitted_by_class"] == [0, 0, 0] and s["loading"] == []
    assert s["memory"]["total_bytes"] >= s["memory"]["used_bytes"] > 0
    assert "temperature_c" in s and "power_w" in s   # None on hosts without sensors: never invented
    post(node, {"model": "tiny-a", "prompt": "abc", "sampling": {"max_tokens": 3}})
    rates = {m["id"]: m for m in state(node)["models"]}["tiny-a"]
    assert rates["prefill_tokens_per_s"] > 0 and rates["decode_tokens_per_s"] > 0


def test_metrics_present_and_moving(node):
    before = scrape(node)
    names = {n for n, _ in before}
    missing = [n for n in METRIC_NAMES if not any(s == n or s.startswith(n + "_") for s in names)]
    assert not missing, missing
    labels = {"model": "tiny-b", "latency_class": "batch"}
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    for _ in range(2):   # the second one hits the prefix cache
        r = post(node, {"model": "tiny-b", "org": "metrics-org", "latency_class": "batch",
                        "prompt_token_ids": prompt, "sampling": {"max_tokens": 5, "ignore_eos": True}})
        assert r.status_code == 200
    after = scrape(node)

    def delta(name, **ls):
        return metric(after, name, **ls) - metric(before, name, **ls)
    assert delta("zen_node_time_to_first_token_seconds_count", **labels) == 2
    assert delta("zen_node_e2e_request_latency_seconds_count", **labels) == 2
    assert delta("zen_node_inter_token_latency_seconds_count", **labels) == 8
    assert delta("zen_node_request_queue_time_seconds_count", **labels) == 2
    for name in ("zen_node_request_queue_time_seconds_bucket", "zen_node_request_prefill_time_seconds_bucket"):
        assert any(n == name and ("le", "0.001") in ls for n, ls in after), name   # milliseconds resolved
    assert delta("zen_node_request_decode_time_seconds_count", **labels) == 2
    assert delta("zen_node_generation_tokens_total", **labels) == 10
    assert delta("zen_node_prompt_tokens_total", **labels) == 2 * len(prompt)
    r = post(node, {"model": "tiny-b", "org": "metrics-org", "latency_class": "batch", "queue_timeout_s": 1e-9,
                    "prompt_token_ids": prompt, "sampling": {"max_tokens": 5}})
    assert r.status_code == 503      # timed out in the queue: its prompt was never served
    assert metric(scrape(node), "zen_node_prompt_tokens_total", **labels) == metric(after, "zen_node_prompt_tokens_total", **labels)
    assert delta("zen_node_request_success_total", finished_reason="length", **labels) == 2
    assert delta("zen_node_iteration_batch_size_count", model="tiny-b") >= 5
    assert delta("zen_node_prefix_cache_queries_total", model="tiny-b") >= 2 * len(prompt)
    assert delta("zen_node_prefix_cache_hits_total", model="tiny-b") >= 16
    assert metric(after, "zen_node_models_resident") == 2
    assert metric(after, "zen_node_accelerator_memory_total_bytes") > 0
    assert metric(after, "zen_node_model_load_time_seconds", model="tiny-a") > 0
    buckets = [float(dict(ls)["le"]) for n, ls in after if n == "zen_node_e2e_request_latency_seconds_bucket"
               and dict(ls)["le"] != "+Inf"]
    assert max(buckets) >= 480


def test_open_metrics_carry_no_org(node):
    """/metrics needs no secret, so it names no organization: per-org figures are the gateway's, behind its token."""
    served = metric(scrape(node), "zen_node_request_success_total")
    for org in ("org-alpha-31", "org-bravo-47"):
        for stream in (False, True):
            r = post(node, {"model": "tiny-a", "org": org, "prompt": "hello", "stream": stream,
                            "sampling": {"max_tokens": 3}}, stream=stream)
            assert r.status_code == 200, r.text
            r.content   # read to the end: the sequence is counted once its response is closed
    wait_for(lambda: metric(scrape(node), "zen_node_request_success_total") == served + 4, what="the 4 counted")
    r = requests.get(node + "/metrics", timeout=10)
    assert r.status_code == 200 and "zen_node_request_success_total" in r.text
    assert "org-alpha-31" not in r.text and "org-bravo-47" not in r.text
    labels = {name for fam in text_string_to_metric_families(r.text) for s in fam.samples for name in s.labels}
    assert "org" not in labels and {"model", "latency_class", "finished_reason"} <= labels


def test_secret_required(node):
    for path, method in (("/state", "get"), ("/v1/models", "get"), ("/v1/generate", "post"),
                         ("/v1/models/load", "post"), ("/v1/models/unload", "post")):
        r = requests.request(method, node + path, json={"model": "tiny-a", "prompt": "x"}, timeout=10)
        assert_openai_error(r, 401, "invalid_node_secret")
        r = requests.request(method, node + path, json={}, headers={SECRET_HEADER: SECRET + "x"}, timeout=10)
        assert r.status_code == 401
    assert requests.get(node + "/health", timeout=10).json() == {"status": "ok"}
    assert requests.get(node + "/metrics", timeout=10).status_code == 200


@pytest.mark.parametrize("body, status, code, param", [
    (b"{not json", 400, "invalid_json", None),
    (b"[1, 2]", 400, "invalid_json", None),
    ({"prompt": "x"}, 400, "missing_required_parameter", "model"),
    ({"model": 7, "prompt": "x"}, 400, None, "model"),
    ({"model": "tiny-a"}, 400, None, "prompt"),
    ({"model": "tiny-a", "prompt": "x", "prompt_token_ids": [1]}, 400, None, "prompt"),
    ({"model": "tiny-a", "prompt": ["x"]}, 400, None, "prompt"),
    ({"model": "tiny-a", "prompt_token_ids": [1, "2"]}, 400, None, "prompt_token_ids"),
    ({"model": "tiny-a", "prompt_token_ids": [1, 99999]}, 400, None, "prompt"),
    ({"model": "tiny-a", "messages": "hello"}, 400, None, "messages"),
    ({"model": "tiny-a", "messages": [{"content": "no role"}]}, 400, None, "messages"),
    ({"model": "tiny-a", "prompt": "x", "sampling": {"temperature": "hot"}}, 400, None, "temperature"),
    ({"model": "tiny-a", "prompt": "x", "sampling": {"top_p": 1.01}}, 400, None, "top_p"),
    ({"model": "tiny-a", "prompt": "x", "sampling": {"max_tokens": -1}}, 400, None, "max_tokens"),
    ({"model": "tiny-a", "prompt": "x", "sampling": {"logit_bias": {"abc": 1}}}, 400, None, "logit_bias"),
    ({"model": "tiny-a", "prompt": "x", "sampling": {"warp_speed": 9}}, 400, "unknown_parameter", "warp_speed"),
    ({"model": "tiny-a", "prompt": "x", "sampling": [1]}, 400, None, "sampling"),
    ({"model": "tiny-a", "prompt": "x", "stream": "yes"}, 400, None, "stream"),
    ({"model": "tiny-a", "prompt": "x", "latency_class": "urgent"}, 400, None, "latency_class"),
    ({"model": "tiny-a", "prompt": "x", "quantization": "q3_k"}, 400, None, "quantization"),
    ({"model": "tiny-a", "prompt": "x", "queue_timeout_s": -1}, 400, None, "queue_timeout_s"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json", None),
    ({"model": "tiny-a", "prompt": "\ud800"}, 400, "invalid_json", None),      # a lone surrogate
    ({"model": "tiny-a", "prompt": "x", "sampling": {"temperature": 10 ** 400}}, 400, None, "temperature"),
    ({"model": "tiny-a", "prompt": "x", "sampling": {"logit_bias": {"1": 10 ** 400}}}, 400, None, "logit_bias"),
    ({"model": "tiny-a", "prompt": "x", "queue_timeout_s": 10 ** 400}, 400, None, "queue_timeout_s"),
    ({"model": "no-such-model", "prompt": "x"}, 404, "model_not_found", "model"),
    ({"model": "tiny-a", "prompt_token_ids": [5] * 4096}, 400, "context_length_exceeded", "prompt"),
    ({"model": "tiny-a", "prompt_token_ids": [5] * 10, "sampling": {"max_tokens": 4090}}, 400,
     "context_length_exceeded", "max_tokens"),
])
def test_bad_input_gives_openai_error_and_node_keeps_serving(node, body, status, code, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = requests.post(node + "/v1/generate", data=data, headers={**AUTH, "Content-Type": "application/json"},
                      timeout=10)
    assert_openai_error(r, status, code, param)
    ok = post(node, {"model": "tiny-a", "prompt": "ok", "sampling": {"max_tokens": 2}})
    assert ok.status_code == 200


def test_an_oversized_chunked_body_is_413_not_cut_short(node):
    """With a Content-Length werkzeug answers 413; a chunked body was cut at the limit and called bad JSON."""
    body = json.dumps({"model": "tiny-a", "prompt": "a" * (17 << 20)}).encode()
    r = requests.post(node + "/v1/generate", data=iter([body]), timeout=60,      # an iterator: sent chunked
                      headers={**AUTH, "Content-Type": "application/json"})
    assert_openai_error(r, 413, "request_too_large")


def test_unknown_route_and_method(node):
    assert_openai_error(requests.get(node + "/nope", headers=AUTH, timeout=10), 404)
    assert_openai_error(requests.get(node + "/v1/generate", headers=AUTH, timeout=10), 405)


def test_models_list_unload_and_cold_load(node):
    listed = requests.get(node + "/v1/models", headers=AUTH, timeout=10).json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["tiny-a", "tiny-b"]
    r = requests.post(node + "/v1/models/unload", json={"model": "tiny-b"}, headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json()["unloaded"] == [{"id": "tiny-b", "quantization": "f32"}]
    assert [m["id"] for m in state(node)["models"]] == ["tiny-a"]
    assert_openai_error(requests.post(node + "/v1/models/unload", json={"model": "tiny-b"}, headers=AUTH,
                                      timeout=10), 404, "model_not_loaded")
    assert_openai_error(requests.post(node + "/v1/models/load", json={"model": "nope"}, headers=AUTH,
                                      timeout=10), 404, "model_not_found")
    # a request for a model that is not resident loads it (cold) and is then served
    r = post(node, {"model": "tiny-b", "prompt": "cold", "sampling": {"max_tokens": 3}})
    assert r.status_code == 200, r.text
    assert sorted(m["id"] for m in state(node)["models"]) == ["tiny-a", "tiny-b"]
    assert metric(scrape(node), "zen_node_model_loads_total", model="tiny-b") == 2
    # an explicit load of another quantization of the same model sits beside it
    r = requests.post(node + "/v1/models/load", json={"model": "tiny-b", "quantization": "q8_0"}, headers=AUTH,
                      timeout=120)   # a load on a cold numba cache compiles its kernels
    assert r.status_code == 200 and r.json()["quantization"] == "q8_0"
    r = post(node, {"model": "tiny-b", "quantization": "q8_0", "prompt": "q8", "sampling": {"max_tokens": 2}})
    assert r.status_code == 200 and r.json()["quantization"] == "q8_0"
    assert requests.post(node + "/v1/models/unload", json={"model": "tiny-b", "quantization": "q8_0"},
                         headers=AUTH, timeout=10).status_code == 200


def test_disconnect_aborts_running_stream(node):
    before = scrape(node)
    r = post(node, {"model": "tiny-a", "org": "leaver", "prompt_token_ids": [9], "stream": True,
                    "sampling": {"max_tokens": 4000, "ignore_eos": True}}, stream=True)
    lines = r.iter_lines()
    got = 0
    for line in lines:
        if line.startswith(b"data: "):
            got += 1
            if got == 3:
                break
    s = state(node)
    assert s["queue"]["running"] == 1 and s["kv_cache_usage"] > 0
    r.close()   # the client goes away mid-stream
    wait_for(lambda: (lambda s: s["queue"]["running"] == 0 and s["kv_cache_usage"] == 0.0)(state(node)),
             what="running 0 and the KV cache empty after the disconnect")
    after = scrape(node)
    labels = {"model": "tiny-a"}
    assert metric(after, "zen_node_request_success_total", finished_reason="abort", **labels) \
        - metric(before, "zen_node_request_success_total", finished_reason="abort", **labels) == 1
    assert metric(after, "zen_node_generation_tokens_total", **labels) < 4000
    assert post(node, {"model": "tiny-a", "prompt": "still here", "sampling": {"max_tokens": 2}}).status_code == 200


def test_disconnect_aborts_non_streaming_request(node):
    before = scrape(node)
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(node + "/v1/generate", headers=AUTH, timeout=(5, 0.3),
                      json={"model": "tiny-a", "org": "impatient", "prompt_token_ids": [9],
                            "sampling": {"max_tokens": 4000, "ignore_eos": True}})
    wait_for(lambda: (lambda s: s["queue"]["running"] == 0 and s["kv_cache_usage"] == 0.0)(state(node)),
             what="the abandoned request aborted")
    after = scrape(node)
    assert metric(after, "zen_node_request_success_total", finished_reason="abort") \
        - metric(before, "zen_node_request_success_total", finished_reason="abort") == 1
    assert metric(after, "zen_node_generation_tokens_total") - metric(before, "zen_node_generation_tokens_total") < 4000


def test_openmp_defaults_leave_the_operators_choice():
    from engine.node.serve import OPENMP_PROC_BIND, OPENMP_SPINCOUNT, openmp_defaults

    chosen = {"OMP_PROC_BIND": "false"}
    env: dict = dict(chosen)
    openmp_defaults(env)
    assert env == {**chosen, "GOMP_SPINCOUNT": OPENMP_SPINCOUNT}
    for chosen in ({"GOMP_SPINCOUNT": "7"}, {"OMP_WAIT_POLICY": "passive"}):   # libgomp would take a spin count over the policy
        env = dict(chosen)
        openmp_defaults(env)
        assert env == {**chosen, "OMP_PROC_BIND": OPENMP_PROC_BIND}
    for chosen in ({"OMP_PLACES": "cores"}, {"GOMP_CPU_AFFINITY": "0-3"}):
        env = {**chosen, "GOMP_SPINCOUNT": "7"}
        openmp_defaults(env)
        assert "OMP_PROC_BIND" not in env


def test_a_served_node_binds_one_kernel_thread_to_each_cpu(tiny_models, tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    n = launch_node([tiny_models["a"] + "=tiny-a"], SECRET, log_dir=str(tmp_path),
                    env={"NUMBA_NUM_THREADS": str(len(cpus))})
    try:
        r = generate(n.url, {"request_id": "bound", "model": "tiny-a", "org": "acme", "prompt": "the cat is",
                             "sampling": {"max_tokens": 4, "ignore_eos": True}}, SECRET)
        assert r.status_code == 200, r.text
        (worker,) = psutil.Process(n.proc.pid).children()
        bound = {tuple(os.sched_getaffinity(t.id)) for t in worker.threads()}
        assert {(cpu,) for cpu in cpus} <= bound   # one kernel thread on each CPU
        assert tuple(cpus) in bound                # the rest (HTTP threads) may run anywhere
    finally:
        n.stop()


def test_openmp_defaults_bind_threads_only_when_there_is_one_per_cpu():
    from engine.node.serve import OPENMP_PROC_BIND, openmp_defaults

    cpus = len(os.sched_getaffinity(0))
    env: dict = {}
    openmp_defaults(env)
    assert env["OMP_PROC_BIND"] == OPENMP_PROC_BIND
    env = {"NUMBA_NUM_THREADS": str(cpus)}
    openmp_defaults(env)
    assert env["OMP_PROC_BIND"] == OPENMP_PROC_BIND
    for threads in (cpus - 1, cpus + 1):   # fewer: several nodes may share the host's first CPUs
        env = {"NUMBA_NUM_THREADS": str(threads)}
        openmp_defaults(env)
        assert "OMP_PROC_BIND" not in env
