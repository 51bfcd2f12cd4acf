"""`--start`: one engine node and one gateway (no Redis) on free loopback ports, started as
scripts/cluster.py starts a cluster, logs beside the results; stopped after the run."""
from __future__ import annotations

import os
from pathlib import Path

from benchmarks.serving_report import log
from engine.protocol import DEV_NODE_SECRET
from scripts.cluster import Cluster, start_cluster
from scripts.local_processes import free_port

NODE_LOG = "node-1.log"   # the log start_cluster gives the first node, in the results' directory


def start_stack(args, out_dir: Path) -> tuple[Cluster, str, str, str]:
    """Start one engine node and the gateway on free loopback ports; (cluster, gateway URL, node URL,
    node secret). SystemExit with the reason when the model is missing or a process does not start."""
    model_path = Path(args.model_path)
    if not model_path.exists():
        raise SystemExit(f"error: {model_path} is missing: run `make model` first")
    node_args = ["--kv-cache-bytes", args.kv_cache_bytes, "--threads", str(args.node_threads),
                 "--max-num-seqs", str(args.max_num_seqs),
                 "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--log-level", args.node_log_level]
    gateway_env = {"GATEWAY_THREADS": str(args.gateway_threads)}
    if args.gateway_workers:
        gateway_env["GATEWAY_WORKERS"] = str(args.gateway_workers)
    log(f"starting an engine node ({model_path.name}) and a gateway, logs in {out_dir} ...")
    try:
        cluster = start_cluster(out_dir, str(model_path), node_ports=[free_port()], gateway_ports=[free_port()],
                                redis=False, node_args=node_args, gateway_env=gateway_env)
    except RuntimeError as exc:
        raise SystemExit(f"error: {exc}") from None
    secret = os.environ.get("NODE_SECRET") or DEV_NODE_SECRET
    return cluster, cluster.gateway_urls[0], cluster.node_urls[0], secret
