"""`--start`: an engine node and a gateway on free loopback ports, each its own process group, logs
beside the results; stopped after the run."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.http_client import httpx
from benchmarks.serving_report import log

ROOT = Path(__file__).resolve().parents[1]
DEV_NODE_SECRET = "zen-development-node-secret"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """A server process started by --start (its own process group, log in bench-results/)."""

    def __init__(self, name: str, argv: list[str], env: dict, log_path: Path):
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        self._log.close()

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def wait_http(url: str, service: Service, timeout: float, ok=lambda r: r.status_code == 200) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise SystemExit(f"error: the {service.name} exited with {service.proc.returncode}:\n{service.tail()}")
        try:
            r = httpx.get(url, timeout=2.0)
            if ok(r):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"error: the {service.name} did not become ready in {timeout:.0f} s:\n{service.tail()}")


def start_stack(args, out_dir: Path) -> tuple[list[Service], str, str, str]:
    """Start one engine node and the gateway on free loopback ports; (services, gateway URL, node URL,
    node secret)."""
    model_path = Path(args.model_path)
    if not model_path.exists():
        raise SystemExit(f"error: {model_path} is missing: run `make model` first")
    node_port, gw_port = free_port(), free_port()
    node_url, gw_url = f"http://127.0.0.1:{node_port}", f"http://127.0.0.1:{gw_port}"
    secret = os.environ.get("NODE_SECRET") or DEV_NODE_SECRET
    env = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR",)}
    env.update({"NODE_SECRET": secret, "PYTHONUNBUFFERED": "1"})
    services: list[Service] = []
    try:
        node = Service("engine node", [sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1",
                                       "--port", str(node_port), "--models", str(model_path),
                                       "--kv-cache-bytes", args.kv_cache_bytes, "--threads", str(args.node_threads),
                                       "--max-num-seqs", str(args.max_num_seqs),
                                       "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                                       "--log-level", args.node_log_level],
                       env, out_dir / "node.log")
        services.append(node)
        log(f"starting engine node on {node_url} ({model_path.name}) ...")
        wait_http(node_url + "/ready", node, 300)
        gw_env = {**env, "PORT": str(gw_port), "ZEN_NODES": node_url,
                  "GATEWAY_THREADS": str(args.gateway_threads)}
        if args.gateway_workers:
            gw_env["GATEWAY_WORKERS"] = str(args.gateway_workers)
        gateway = Service("gateway", [sys.executable, "-m", "app", "serve"], gw_env, out_dir / "gateway.log")
        services.append(gateway)
        log(f"starting gateway on {gw_url} ...")
        wait_http(gw_url + "/ready", gateway, 120)
        return services, gw_url, node_url, secret
    except BaseException:
        for s in reversed(services):
            s.stop()
        raise


def stop_stack(services: list[Service]) -> None:
    for s in reversed(services):
        s.stop()
