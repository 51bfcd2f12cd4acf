"""`--start`: an engine node and a gateway on free loopback ports, each its own process group, logs
beside the results; stopped after the run."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from benchmarks.serving_report import log
from engine.protocol import DEV_NODE_SECRET
from scripts.local_processes import Service, free_port, wait_http


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
