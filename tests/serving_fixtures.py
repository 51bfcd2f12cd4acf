"""Real serving processes for the fault, security and fuzz tests: a gateway under gunicorn, engine
nodes and redis-server, on free loopback ports, all stopped at the end (also when a test fails).

    from tests.serving_fixtures import serving_stack, tiny_models   # noqa: F401 (pytest fixtures)

    def test_something(serving_stack, tiny_models):
        stack = serving_stack(nodes=[[tiny_models["a"] + "=tiny-a"]], redis=True,
                              gateway={"limits": {"failure_policy": "closed"}})
        r = requests.post(stack.gateway.url + "/v1/completions", headers=stack.auth("acme"), json={...})

`serving_stack(...)` starts, in order, redis-server (redis=True), the engine nodes (one per entry of
`nodes`: the models of that node, "PATH[=ID]", plus `node_options` for tests.node_fixtures.launch_node)
and the gateway (gunicorn with config/gunicorn.conf.py, `workers` x `threads`; `gateway` is a dict of
config sections merged over TEST_CONFIG). It waits until the gateway sees every node up. The gateway's
catalog gets `zen-tiny` (tiny-a, f32) and `zen-tiny-b` (tiny-b, f32) besides the shipped aliases; the
test orgs are in TEST_CONFIG. Everything is stopped when the test ends: nodes, then the gateway, then Redis.

Process inspection for leak checks: `worker_pids(master_pid)`, `rss_bytes(pids)`, `thread_count(pid)`
(psutil: /proc/<pid>/status on Linux). An engine node's threads are counted in its gunicorn worker,
the process that owns the engine (NodeProcess.proc is the master): `node_worker_pid(node)`.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest
import requests

from app.config import load_config, merge_tables
from app.devtoken import mint_token
from scripts.local_processes import RedisProcess, Service, free_port, stop_all, wait_http
from tests.node_fixtures import NodeProcess, launch_node, node_state, tiny_models  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[1]
JWT_SECRET = "serving-tests-jwt-secret-0123456789abcdef"
NODE_SECRET = "serving-tests-node-secret"
GATEWAY_START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0

DEFAULT_CONFIG = REPO_ROOT / "config" / "default.toml"

# The gateway configuration of these tests (merged over config/default.toml, then over by the test).
TEST_CONFIG: dict[str, Any] = {
    "server": {"host": "127.0.0.1", "log_level": "INFO", "workers": 2, "threads": 16,
               "max_body_bytes": 1_048_576},
    "auth": {"algorithms": ["HS256"], "issuer": "zen-test", "audience": "zen-gateway",
             "allow_unconfigured_orgs": False},
    "limits": {"storage_url": "memory://", "failure_policy": "open", "retry_s": 1.0,
               "redis_timeout_s": 0.5},
    "nodes": {"urls": [], "poll_interval_s": 0.25, "state_ttl_s": 3.0, "connect_timeout_s": 1.0,
              "read_timeout_s": 60.0, "max_attempts": 3},
    "tiers": {
        # Generous limits: fault tests measure the engine and the gateway, not the limiter.
        "load": {"requests_per_minute": 1_000_000, "tokens_per_second": 10_000_000.0,
                 "models": ["zen-tiny", "zen-tiny-b", "zen-small"],
                 "max_latency_class": "realtime", "default_latency_class": "standard"},
        "tiny": {"requests_per_minute": 3, "tokens_per_second": 50.0, "burst_tokens": 600,
                 "models": ["zen-tiny"], "max_latency_class": "standard", "default_latency_class": "standard"},
        "roomy": {"requests_per_minute": 500, "tokens_per_second": 7_777.0, "burst_tokens": 99_999,
                  "models": ["zen-tiny", "zen-tiny-b"], "max_latency_class": "realtime",
                  "default_latency_class": "standard"},
    },
    "orgs": {"loadco": {"tier": "load"}, "alpha": {"tier": "tiny"}, "bravo": {"tier": "roomy"}},
    "models": {
        "zen-tiny": {"model": "tiny-a", "quantization": "f32", "max_context": 4096, "default_max_tokens": 32,
                     "cold_load_s": 0.5},
        "zen-tiny-b": {"model": "tiny-b", "quantization": "f32", "max_context": 4096, "default_max_tokens": 32,
                       "cold_load_s": 0.5},
    },
}


# ------------------------------------------------------------------------------------------ TOML

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)          # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def dump_toml(data: dict, prefix: str = "") -> str:
    """Nested dicts of scalars and lists as TOML tables (enough for the gateway config)."""
    lines, tables = [], []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    out = ""
    if lines:
        out += (f"[{prefix}]\n" if prefix else "") + "\n".join(lines) + "\n\n"
    for key, value in tables:
        name = f"{prefix}.{_toml_key(key)}" if prefix else _toml_key(key)
        out += dump_toml(value, name) if value else f"[{name}]\n\n"
    return out


def gateway_config(overrides: dict | None = None) -> dict:
    """config/default.toml, then TEST_CONFIG, then `overrides` (the file the test gateway runs)."""
    with open(DEFAULT_CONFIG, "rb") as fh:
        base = tomllib.load(fh)
    return merge_tables(merge_tables(base, TEST_CONFIG), overrides or {})


# ------------------------------------------------------------------------------- process inspection

def worker_pids(master_pid: int) -> list[int]:
    """The worker processes (children) of a gunicorn master."""
    try:
        return [c.pid for c in psutil.Process(master_pid).children(recursive=False)]
    except psutil.Error:
        return []


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total


def thread_count(pid: int) -> int:
    """Threads of one process (psutil, i.e. /proc/<pid>/status `Threads:` on Linux)."""
    return psutil.Process(pid).num_threads()


def node_worker_pid(node: NodeProcess) -> int:
    """The gunicorn worker of an engine node: the process that owns the engine and its threads."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = worker_pids(node.proc.pid)
        if len(pids) == 1:
            return pids[0]
        time.sleep(0.1)
    raise AssertionError(f"engine node {node.url} has no single worker: {worker_pids(node.proc.pid)}")


# ---------------------------------------------------------------------------------------- gateway

class GatewayProcess(Service):
    """The gateway under gunicorn: `url`, `config` (the GatewayConfig it runs), `log()`, `alive()`,
    `stop()`: SIGINT (gunicorn's quick shutdown: the tests do not wait for requests in flight), then
    SIGKILL to the process group if it lingers."""

    def __init__(self, argv: list[str], env: dict, log_path: Path, url: str, config_path: Path):
        super().__init__("gateway", argv, env, log_path, stop_signal=signal.SIGINT, signal_group=False,
                         stop_timeout_s=STOP_TIMEOUT_S)
        self.url, self.config_path = url, config_path
        self.config = load_config(config_path, env=env)

    def log_events(self) -> list[dict]:
        """The JSON log lines written so far (other lines skipped)."""
        out = []
        for line in self.log().splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def worker_pids(self) -> list[int]:
        return worker_pids(self.proc.pid)

    def health(self) -> dict:
        return requests.get(self.url + "/health", timeout=5).json()


def launch_gateway(config: dict, *, node_urls: list[str], redis_url: str | None = None, workers: int = 2,
                   threads: int = 16, log_dir: str | None = None, wait_nodes: int | None = None,
                   node_secret: str = NODE_SECRET, jwt_secret: str = JWT_SECRET) -> GatewayProcess:
    """Start the gateway under gunicorn on a free loopback port with `config` (a full config dict,
    see TEST_CONFIG) and wait for /ready (and for `wait_nodes` nodes ready, default all)."""
    directory = Path(log_dir or tempfile.mkdtemp(prefix="zen-gateway-"))
    port = free_port()
    config_path = directory / f"gateway-{port}.toml"
    config_path.write_text(dump_toml(config))
    metrics_dir = directory / f"prometheus-{port}"
    metrics_dir.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("ZEN_NODES", "REDIS_URL", "PORT", "JWT_SECRET", "NODE_SECRET", "ZEN_CONFIG",
                        "GATEWAY_WORKERS", "GATEWAY_THREADS", "METRICS_TOKEN")}
    env.update({"ZEN_CONFIG": str(config_path), "PORT": str(port), "JWT_SECRET": jwt_secret,
                "NODE_SECRET": node_secret, "GATEWAY_WORKERS": str(workers), "GATEWAY_THREADS": str(threads),
                "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "PYTHONUNBUFFERED": "1"})
    if node_urls:
        env["ZEN_NODES"] = ",".join(node_urls)
    if redis_url:
        env["REDIS_URL"] = redis_url
    gw = GatewayProcess([sys.executable, "-m", "gunicorn", "-c", "config/gunicorn.conf.py", "wsgi:app"], env,
                        directory / f"gateway-{port}.log", f"http://127.0.0.1:{port}", config_path)
    want_nodes = len(node_urls) if wait_nodes is None else wait_nodes

    def every_worker_sees_the_nodes(r) -> bool:
        # Each worker has its own node view: ask a few times so that more than one worker answered.
        try:
            return r.json().get("nodes_up", 0) >= want_nodes and all(
                requests.get(gw.url + "/ready", timeout=2).json().get("nodes_up", 0) >= want_nodes
                for _ in range(2 * workers))
        except ValueError:
            return False

    try:
        wait_http(gw.url + "/ready", gw, GATEWAY_START_TIMEOUT_S, ok=every_worker_sees_the_nodes)
    except BaseException:
        gw.stop()
        raise
    return gw


# ------------------------------------------------------------------------------------------ stack

class ServingStack:
    """What serving_stack started: `gateway`, `nodes` (NodeProcess), `redis` (RedisProcess or None)."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.gateway: GatewayProcess | None = None
        self.nodes: list[NodeProcess] = []
        self.redis: RedisProcess | None = None

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return self.gateway.url

    def token(self, org: str = "loadco", **claims) -> str:
        assert self.gateway is not None
        return mint_token(self.gateway.config, org, **claims)

    def auth(self, org: str = "loadco", **claims) -> dict:
        return {"Authorization": "Bearer " + self.token(org, **claims)}

    def node_state(self, i: int = 0) -> dict:
        return node_state(self.nodes[i].url, NODE_SECRET)

    def logs(self) -> str:
        out = []
        if self.gateway is not None:
            out.append("---- gateway log (tail)\n" + self.gateway.log()[-6000:])
        for node in self.nodes:
            out.append(f"---- node {node.url} log (tail)\n" + node.log()[-3000:])
        return "\n".join(out)

    def stop(self) -> None:
        """Stop everything: the nodes first (a gateway thread waiting on a node's answer would hold the
        gateway's exit), then the gateway, then Redis. Never raises: each stop is attempted."""
        stop_all([n.stop for n in reversed(self.nodes)] + ([self.gateway.stop] if self.gateway else []) +
                 ([self.redis.stop] if self.redis else []), "the serving stack")


def start_stack(log_dir: str, *, nodes: list[list[str]] = (), node_options: dict | list[dict] | None = None,
                redis: bool = False, gateway: dict | None = None, workers: int = 2, threads: int = 16,
                stack: ServingStack | None = None) -> ServingStack:
    """Start redis, nodes and the gateway; on failure whatever started is stopped, then it raises.
    node_options: launch_node's options for every node, or a list of them, one per node."""
    stack = stack or ServingStack(log_dir)
    per_node = node_options if isinstance(node_options, list) else [node_options or {}] * len(nodes)
    try:
        if redis:
            stack.redis = RedisProcess().start()
        for models, options in zip(nodes, per_node, strict=True):
            opts = {"threads": 48, "kv_cache_bytes": "8MiB", **options}
            stack.nodes.append(launch_node(list(models), NODE_SECRET, log_dir=log_dir, **opts))
        config = gateway_config(gateway)
        stack.gateway = launch_gateway(config, node_urls=[n.url for n in stack.nodes],
                                       redis_url=stack.redis.url if stack.redis else None, workers=workers,
                                       threads=threads, log_dir=log_dir)
        return stack
    except BaseException:
        stack.stop()
        raise


@pytest.fixture
def serving_stack(tmp_path, request) -> Iterator:
    """Factory: serving_stack(nodes=[[models...], ...], node_options={}, redis=False, gateway={},
    workers=2, threads=16) -> ServingStack. Everything is stopped after the test; the logs are printed
    when it failed."""
    started: list[ServingStack] = []

    def start(**kwargs) -> ServingStack:
        stack = ServingStack(str(tmp_path))
        started.append(stack)
        return start_stack(str(tmp_path), stack=stack, **kwargs)

    failures_before = request.session.testsfailed
    yield start
    failed = request.session.testsfailed > failures_before
    for stack in reversed(started):
        if failed:
            print(stack.logs(), file=sys.stderr)
        stack.stop()


# ------------------------------------------------------------------------------------ SSE helpers

def read_sse(resp: requests.Response, deadline_s: float = 60.0) -> list[Any]:
    """The `data:` payloads of a gateway stream (JSON objects, and the string "[DONE]"), until [DONE]
    or the end of the stream; AssertionError past deadline_s (nothing may hang)."""
    out: list[Any] = []
    stop_at = time.monotonic() + deadline_s
    for line in resp.iter_lines():
        if time.monotonic() > stop_at:
            raise AssertionError(f"stream still open after {deadline_s} s")
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            out.append("[DONE]")
            break
        out.append(json.loads(data))
    return out


def wait_until(pred, timeout: float, what: str, interval: float = 0.1):
    """Poll pred() until it returns a truthy value; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except Exception as exc:  # noqa: BLE001 - the condition may not be checkable yet
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")
