"""`make serve-cluster`: the service as it is deployed, on one machine's loopback.

redis-server (no persistence, a temporary directory), three engine nodes (`python -m engine serve`)
of the default model and two gateway replicas (`python -m app serve`, each with its gunicorn workers)
that share their per-org limits through that Redis (REDIS_URL) and route over the three nodes
(ZEN_NODES). Every process runs in its own session with its log in the cluster's directory; Ctrl-C
(or SIGTERM) stops them all.

    python -m scripts.cluster [--nodes 3] [--gateways 2] [--port 8000] [--model PATH]

Ports: gateways on --port, --port+10, ...; nodes on --node-port, +1, ...; Redis on --redis-port.
Each node gets NUMBA_NUM_THREADS = cores // nodes (at least 1): the nodes share the machine's cores
instead of each spreading over all of them. The gateways read their configuration as `make serve`'s
does (config/default.toml, or ZEN_CONFIG; JWT_SECRET, NODE_SECRET from the environment).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.protocol import DEV_NODE_SECRET
from scripts.local_processes import RedisProcess, Service, free_port, stop_all, wait_http
NODE_START_TIMEOUT_S = 300.0          # a model load, and on a fresh checkout numba compiling every kernel
GATEWAY_START_TIMEOUT_S = 120.0
# Variables of the launcher's own environment that would make the replicas share what must be theirs.
PER_PROCESS_ENV = ("PROMETHEUS_MULTIPROC_DIR", "ZEN_LIMITS_DIR", "PORT", "ZEN_NODES", "REDIS_URL")


def node_threads(nodes: int) -> int:
    """NUMBA_NUM_THREADS of each node: the cores split among the nodes, at least one each."""
    return max(1, (os.cpu_count() or 1) // nodes)


@dataclass
class Cluster:
    """What start_cluster started; stop() stops all of it."""

    directory: Path
    redis: RedisProcess | None = None
    nodes: list[Service] = field(default_factory=list)
    node_urls: list[str] = field(default_factory=list)
    gateways: list[Service] = field(default_factory=list)
    gateway_urls: list[str] = field(default_factory=list)

    def services(self) -> list[Service]:
        return [*self.nodes, *self.gateways]

    def exited(self) -> str | None:
        """The name of a process that has exited (None: all run)."""
        if self.redis is not None and not self.redis.alive():
            return "redis-server"
        return next((s.name for s in self.services() if s.proc.poll() is not None), None)

    def stop(self) -> None:
        """Nodes first (a gateway thread waiting on a node's answer would hold the gateway's exit), then
        the gateways, then Redis; each stop is attempted even when one fails."""
        stop_all([s.stop for s in self.services()] + ([self.redis.stop] if self.redis else []), "the cluster")


def launch_nodes(cluster: Cluster, model: str, ports: list[int], env: dict, node_args: list[str]) -> None:
    """Start one engine node per port: the first alone, then the others together."""
    for i, port in enumerate(ports, 1):
        argv = [sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--models", model, "--node-id", f"node-{i}", *node_args]
        cluster.nodes.append(Service(f"engine node {i}", argv, env, cluster.directory / f"node-{i}.log"))
        cluster.node_urls.append(f"http://127.0.0.1:{port}")
        if i == 1:   # it fills numba's on-disk cache of compiled kernels, which the others then load
            wait_http(cluster.node_urls[0] + "/ready", cluster.nodes[0], NODE_START_TIMEOUT_S)
    for node, url in zip(cluster.nodes[1:], cluster.node_urls[1:]):
        wait_http(url + "/ready", node, NODE_START_TIMEOUT_S)


def launch_gateways(cluster: Cluster, ports: list[int], env: dict) -> None:
    """Start one gateway replica per port, then wait until each sees every node up."""
    want = len(cluster.node_urls)
    for i, port in enumerate(ports, 1):
        gw_env = {**env, "PORT": str(port), "ZEN_NODES": ",".join(cluster.node_urls)}
        if cluster.redis is not None:
            gw_env["REDIS_URL"] = cluster.redis.url
        cluster.gateways.append(Service(f"gateway {i}", [sys.executable, "-m", "app", "serve"], gw_env,
                                        cluster.directory / f"gateway-{i}.log"))
        cluster.gateway_urls.append(f"http://127.0.0.1:{port}")
    def all_nodes_up(r) -> bool:
        return r.status_code == 200 and r.json().get("nodes_up", 0) >= want

    # Each gunicorn worker has its own view of the nodes: several answers in a row, so more than one.
    for gateway, url in zip(cluster.gateways, cluster.gateway_urls):
        for _ in range(5):
            wait_http(url + "/health", gateway, GATEWAY_START_TIMEOUT_S, ok=all_nodes_up)


def start_cluster(directory: str | Path, model: str, *, node_ports: list[int], gateway_ports: list[int],
                  redis: bool = True, redis_port: int | None = None, threads_per_node: int | None = None,
                  node_args: list[str] = (), env: dict | None = None, gateway_env: dict | None = None) -> Cluster:
    """Redis (unless `redis` is False: each gateway keeps its limits to itself), len(node_ports) nodes of
    `model` ("PATH[=ID]") and len(gateway_ports) gateway replicas, logs in `directory`; `env` is added to
    every process's environment, `gateway_env` to the gateways'. On failure whatever started is stopped,
    then it raises (RuntimeError: a process exited or never became ready)."""
    cluster = Cluster(Path(directory))
    base = {k: v for k, v in os.environ.items() if k not in PER_PROCESS_ENV}
    base.update({"NODE_SECRET": os.environ.get("NODE_SECRET") or DEV_NODE_SECRET, "PYTHONUNBUFFERED": "1",
                 **(env or {})})
    threads = threads_per_node or node_threads(len(node_ports))
    try:
        if redis:
            redis_dir = cluster.directory / "redis"
            redis_dir.mkdir(exist_ok=True)
            cluster.redis = RedisProcess(redis_port or free_port(), redis_dir).start()
        launch_nodes(cluster, model, node_ports, {**base, "NUMBA_NUM_THREADS": str(threads)}, list(node_args))
        launch_gateways(cluster, gateway_ports, {**base, **(gateway_env or {})})
        return cluster
    except BaseException:
        cluster.stop()
        raise


def usage_message(cluster: Cluster, token: str) -> str:
    """What `make serve-cluster` prints once everything answers."""
    gateways = "\n".join(f"    {url}" for url in cluster.gateway_urls)
    nodes = "  ".join(cluster.node_urls)
    return f"""
  Gateways (shared limits in {cluster.redis.url}):
{gateways}
  Engine nodes: {nodes}
  Logs: {cluster.directory}
  A development token for org "acme" (make token ORG=acme TIER=pro makes others):

  curl {cluster.gateway_urls[0]}/v1/chat/completions -H "Authorization: Bearer {token}" \\
    -H "Content-Type: application/json" \\
    -d '{{"model": "zen-small", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  Any gateway serves any request; Ctrl-C stops everything.
"""


def main(argv: list[str] | None = None) -> int:
    from app.config import ConfigError, load_config
    from app.devtoken import mint_token
    from models.loader import default_model_path

    parser = argparse.ArgumentParser(prog="python -m scripts.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--port", type=int, default=8000, help="the first gateway's port (then +10 each)")
    parser.add_argument("--node-port", type=int, default=8001, help="the first node's port (then +1 each)")
    parser.add_argument("--redis-port", type=int, default=6380)
    parser.add_argument("--model", default=default_model_path(), help="PATH[=ID] of the model every node serves")
    parser.add_argument("--threads-per-node", type=int, default=None, help="NUMBA_NUM_THREADS of each node "
                        "(default: the cores split among the nodes)")
    args = parser.parse_args(argv)
    node_ports = [args.node_port + i for i in range(args.nodes)]
    gateway_ports = [args.port + 10 * i for i in range(args.gateways)]
    taken = node_ports + gateway_ports + [args.redis_port]
    if len(set(taken)) < len(taken):   # 10 nodes from 8001 reach 8010, the second gateway's port
        print(f"error: the ports overlap: nodes {node_ports}, gateways {gateway_ports}, Redis {args.redis_port}; "
              f"move --node-port or --port", file=sys.stderr)
        return 2
    if not Path(args.model.split("=")[0]).exists():
        print(f"error: {args.model} is missing: run `make model` first", file=sys.stderr)
        return 2
    try:
        token = mint_token(load_config(), "acme", "pro")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # leave through `finally`: stop everything
    directory = Path(tempfile.mkdtemp(prefix="zen-cluster-"))
    print(f"starting Redis, {args.nodes} engine nodes and {args.gateways} gateways (logs in {directory}) ...",
          file=sys.stderr, flush=True)
    cluster = None
    try:
        cluster = start_cluster(directory, args.model,
                                node_ports=node_ports, gateway_ports=gateway_ports,
                                redis_port=args.redis_port, threads_per_node=args.threads_per_node)
        print(usage_message(cluster, token), flush=True)
        while (gone := cluster.exited()) is None:
            time.sleep(0.5)
        print(f"error: the {gone} exited; stopping the cluster (logs in {directory})", file=sys.stderr)
        return 1
    except RuntimeError as exc:   # redis-server missing, or a process that exited or never became ready
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C must not cut the stopping short
        if cluster is not None:
            print("stopping the cluster ...", file=sys.stderr, flush=True)
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
