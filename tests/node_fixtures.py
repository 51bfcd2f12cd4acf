"""Engine nodes for tests: a real `python -m engine serve` (gunicorn) on a free loopback port.

    from tests.node_fixtures import start_node, tiny_models   # noqa: F401  (pytest fixtures)

    def test_something(start_node, tiny_models):
        url = start_node([tiny_models["a"]], secret="s")            # waits for /ready 200
        requests.post(url + "/v1/generate", json={...}, headers={"X-Node-Secret": "s"})

`start_node(models, secret, **options)` returns the node's base URL and stops the node when the test
ends. Options map to the serve flags (memory_budget, kv_cache_bytes, max_waiting, max_num_seqs,
load_wait, preload, extra_args). `launch_node(...)` is the same without pytest: it returns a
NodeProcess to stop() yourself. `make_tiny_model(directory, name, seed, **shape)` writes a small
random Llama GGUF; `tiny_models` holds two different ones, "a" (smaller) and "b".
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from engine.protocol import SECRET_HEADER
from scripts.local_processes import Service, free_port, wait_http
from tests.tiny_model import make_tiny_tokenizer, make_tiny_weights, write_tiny_gguf

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


def make_tiny_model(directory, name: str, seed: int, **shape) -> str:
    """A tiny random Llama (byte-level BPE tokenizer, chat template) as `directory/name.gguf`."""
    path = Path(directory) / f"{name}.gguf"
    if not path.exists():
        write_tiny_gguf(path, make_tiny_weights(seed=seed, **shape), make_tiny_tokenizer())
    return str(path)


class NodeProcess(Service):
    """A running node: `url`, `log()` (its output so far), `alive()`, `stop()`: SIGINT to the gunicorn
    master (a quick shutdown: it stops its worker, which stops its engine loops), then SIGKILL to the
    process group it leads if it lingers."""

    def __init__(self, argv: list[str], env: dict, log_path: str, url: str):
        super().__init__("node", argv, env, Path(log_path), stop_signal=signal.SIGINT, signal_group=False,
                         stop_timeout_s=STOP_TIMEOUT_S)
        self.url = url


def launch_node(models: list[str], secret: str, *, memory_budget: int | str | None = None,
                kv_cache_bytes: int | str = "4MiB", max_waiting: int | None = None,
                max_num_seqs: int | None = None, load_wait: float | None = None,
                preload: list[str] | None = None, threads: int = 8, extra_args: tuple = (),
                log_dir: str | None = None, env: dict | None = None, host: str = "127.0.0.1") -> NodeProcess:
    """Start `python -m engine serve` on a free port of `host` and wait for /ready 200 on loopback.
    models: "PATH" or "PATH=ID" strings; an empty `secret` is NODE_SECRET unset, as the node reads it."""
    port = free_port()
    args = [sys.executable, "-m", "engine", "serve", "--host", host, "--port", str(port),
            "--models", *models, "--backend", "cpu", "--kv-cache-bytes", str(kv_cache_bytes),
            "--threads", str(threads), "--log-level", "info"]
    if memory_budget is not None:
        args += ["--memory-budget", str(memory_budget)]
    if max_waiting is not None:
        args += ["--max-waiting", str(max_waiting)]
    if max_num_seqs is not None:
        args += ["--max-num-seqs", str(max_num_seqs)]
    if load_wait is not None:
        args += ["--load-wait", str(load_wait)]
    if preload is not None:
        args += ["--preload", *preload]
    args += list(extra_args)
    run_env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    run_env.update({"NODE_SECRET": secret, "NUMBA_NUM_THREADS": run_env.get("NUMBA_NUM_THREADS", "1"),
                    "PYTHONUNBUFFERED": "1"})
    run_env.update(env or {})
    log_path = os.path.join(log_dir or tempfile.mkdtemp(prefix="zen-node-"), f"node-{port}.log")
    node = NodeProcess(args, run_env, log_path, f"http://127.0.0.1:{port}")
    try:
        wait_http(node.url + "/ready", node, START_TIMEOUT_S)
    except BaseException:
        node.stop()
        raise
    return node


@pytest.fixture
def start_node(tmp_path):
    """Factory: start_node(models, secret, **options) -> base URL; every node started is stopped after
    the test (its log is printed if the test failed)."""
    nodes: list[NodeProcess] = []

    def start(models: list[str], secret: str = "test-node-secret", **options) -> str:
        options.setdefault("log_dir", str(tmp_path))
        node = launch_node(models, secret, **options)
        nodes.append(node)
        return node.url

    start.nodes = nodes
    yield start
    for node in nodes:
        node.stop()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Two different tiny models: "a" (hidden 64) and "b" (hidden 128), both with a 4096-token context."""
    d = tmp_path_factory.mktemp("node-models")
    return {"a": make_tiny_model(d, "tiny-a", seed=11, max_position=4096),
            "b": make_tiny_model(d, "tiny-b", seed=12, hidden=128, ffn=256, max_position=4096)}


# ---- HTTP helpers for node tests

def generate(url: str, body: dict, secret: str, **kw) -> requests.Response:
    """POST {url}/v1/generate with the node secret (pass stream=True to read an SSE body)."""
    return requests.post(url + "/v1/generate", json=body, headers={SECRET_HEADER: secret}, timeout=120, **kw)


def node_state(url: str, secret: str) -> dict:
    r = requests.get(url + "/state", headers={SECRET_HEADER: secret}, timeout=10)
    r.raise_for_status()
    return r.json()


def sse_events(resp) -> list[dict]:
    """The events of a streaming /v1/generate response, up to and including done or error."""
    out = []
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            out.append(json.loads(line[6:]))
            if out[-1]["type"] in ("done", "error"):
                break
    return out


def scrape(url: str) -> dict:
    """{(sample name, frozenset(labels)): value} of the node's /metrics."""
    text = requests.get(url + "/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(samples: dict, name: str, **labels) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def wait_for(pred, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def assert_openai_error(resp, status: int, code: str | None = None, param: str | None = None) -> dict:
    """The response is `status` with an OpenAI error body (and the given code and param)."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def open_stream(url: str, body: dict, secret: str):
    """A raw streaming /v1/generate on its own connection: (connection, response). Read events with
    next_event(response); conn.close() is a client going away."""
    import http.client
    from urllib.parse import urlparse
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", "/v1/generate", body=json.dumps({**body, "stream": True}),
                 headers={SECRET_HEADER: secret, "Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        body = resp.read()
        conn.close()
        raise AssertionError(f"stream refused: {resp.status} {body[:500]!r}")
    return conn, resp


def next_event(resp) -> dict:
    """The next SSE event of an open_stream response."""
    while True:
        line = resp.readline()
        if not line:
            raise AssertionError("the stream ended")
        if line.startswith(b"data: "):
            return json.loads(line[6:])
