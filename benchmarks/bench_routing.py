"""Routing benchmark (`make bench-routing`): the router's score against round-robin and least-outstanding.

    python benchmarks/bench_routing.py [--requests 40] [--rate 0.25] [--policies score,round_robin,least_outstanding]

For each policy, on this machine's loopback: three engine nodes of the default model that start with no
model resident (`--preload` with none), small KV caches (--kv-cache-bytes) and a memory budget that holds two
of the three catalog models at once (--memory-budget), so that loads, evictions and prefix-cache evictions are
real; one gateway (the shipped configuration, its [routing] policy set to the policy measured, the shipped
number of workers). The same deterministic trace (benchmarks/routing_trace.py: three catalog models, six
applications with ~400-token system prompts, growing conversations, three latency classes, Poisson arrivals)
is sent through the gateway, streaming, open loop.

Reported per policy: cold loads (the nodes' zen_node_model_loads_total), reloads of a model on a node that had
loaded it before (after an eviction) and copies of a model beyond its first node, the prefix-cache hit rate
(the nodes' zen_node_prefix_cache_hits_total / zen_node_prefix_cache_queries_total, in tokens), TTFT p50/p99
per latency class as the client sees it, and throughput (completed requests/s, output tokens/s). Nodes are
started afresh for each policy. JSON to --out; the table to stdout.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.config import DEFAULT_CONFIG_PATH, load_config
from app.devtoken import mint_token
from app.routing_policy import POLICIES
from benchmarks.routing_trace import TraceRequest, build_trace, models_of
from benchmarks.serving_report import log, machine_info, settings_of
from benchmarks.serving_stats import dist
from scripts.cluster import start_cluster
from scripts.local_processes import free_port

NODES = 3
CLASSES = ("realtime", "standard", "batch")
POLICY_LINE = re.compile(r'^policy = "[a-z_]+"', re.MULTILINE)   # config/default.toml's, in [routing]
ORG = "initech"              # the enterprise tier: every catalog model, realtime allowed, limits that do not bind


def build_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=0.25, help="Poisson arrivals per second")
    ap.add_argument("--seed", type=int, default=25)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--model", default=str(ROOT / "models" / "weights" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--kv-cache-bytes", default="96MiB", help="each resident model's KV cache")
    ap.add_argument("--memory-budget", default="640MiB", help="each node's: two of the three models fit")
    ap.add_argument("--gateway-workers", type=int, default=0, help="0: the shipped configuration's")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "routing.json"))
    args = ap.parse_args(argv)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    return args


def gateway_config(policy: str, directory: Path) -> Path:
    """The shipped configuration with [routing] policy set: the file the gateway is started with."""
    text, found = POLICY_LINE.subn(f'policy = "{policy}"', DEFAULT_CONFIG_PATH.read_text())
    if found != 1:
        raise SystemExit(f"error: {DEFAULT_CONFIG_PATH} has no single `policy = ...` line in [routing]")
    path = directory / f"gateway-{policy}.toml"
    path.write_text(text)
    return path


# -- the client ------------------------------------------------------------------------------------------

def send(session: requests.Session, url: str, token: str, req: TraceRequest, t0: float) -> dict:
    """One streamed chat completion at its arrival time: TTFT (first content chunk), end-to-end, tokens."""
    rec = {"index": req.index, "app": req.app, "model": req.model, "latency_class": req.latency_class,
           "ok": False, "ttft_s": None, "e2e_s": None, "output_tokens": 0, "prompt_tokens": 0, "error": None}
    time.sleep(max(0.0, t0 + req.at_s - time.perf_counter()))
    start = time.perf_counter()
    headers = {"Authorization": f"Bearer {token}", "X-Latency-Class": req.latency_class}
    try:
        with session.post(url + "/v1/chat/completions", json=req.body(), headers=headers, stream=True,
                          timeout=(10, 600)) as resp:
            if resp.status_code != 200:
                rec["error"] = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return rec
            for line in resp.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    rec["output_tokens"] = chunk["usage"]["completion_tokens"]
                    rec["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
                if delta.get("content") and rec["ttft_s"] is None:
                    rec["ttft_s"] = time.perf_counter() - start
        rec["e2e_s"] = time.perf_counter() - start
        rec["ok"] = rec["ttft_s"] is not None and rec["output_tokens"] > 0
        if not rec["ok"]:
            rec["error"] = "no tokens"
    except (requests.RequestException, ValueError) as exc:
        rec["error"] = f"{exc.__class__.__name__}: {str(exc)[:200]}"
    return rec


def run_trace(url: str, token: str, trace: list[TraceRequest]) -> tuple[list[dict], float]:
    """Every request at its time on a thread of its own (open loop); (records, seconds to the last answer)."""
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=len(trace)))
    with ThreadPoolExecutor(max_workers=len(trace)) as pool:
        t0 = time.perf_counter()
        records = list(pool.map(lambda r: send(session, url, token, r, t0), trace))
    return records, time.perf_counter() - t0


# -- the nodes' counters ---------------------------------------------------------------------------------

def node_counters(url: str) -> dict:
    return counters_from_metrics(requests.get(url + "/metrics", timeout=10).text)


def counters_from_metrics(text: str) -> dict:
    """From a node's /metrics: loads and evictions per model (id/quantization), prefix-cache tokens."""
    out = {"loads": {}, "evictions": {}, "prefix_query_tokens": 0.0, "prefix_hit_tokens": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = f"{s.labels.get('model')}/{s.labels.get('quantization')}"
            if s.name == "zen_node_model_loads_total":
                out["loads"][key] = out["loads"].get(key, 0) + int(s.value)
            elif s.name == "zen_node_model_evictions_total":
                out["evictions"][key] = out["evictions"].get(key, 0) + int(s.value)
            elif s.name == "zen_node_prefix_cache_queries_total":
                out["prefix_query_tokens"] += s.value
            elif s.name == "zen_node_prefix_cache_hits_total":
                out["prefix_hit_tokens"] += s.value
    return out


def summarize(records: list[dict], duration: float, nodes: list[dict]) -> dict:
    ok = [r for r in records if r["ok"]]
    loads = [(model, i, n) for i, node in enumerate(nodes) for model, n in node["loads"].items() if n]
    queries = sum(n["prefix_query_tokens"] for n in nodes)
    hits = sum(n["prefix_hit_tokens"] for n in nodes)
    per_model_nodes: dict[str, int] = {}
    for model, _, _ in loads:
        per_model_nodes[model] = per_model_nodes.get(model, 0) + 1
    return {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r["error"] for r in records if r["error"]})[:10],
        "duration_s": duration, "requests_per_s": len(ok) / duration,
        "output_tokens_per_s": sum(r["output_tokens"] for r in ok) / duration,
        "cold_loads": sum(n for _, _, n in loads),
        "model_node_pairs_loaded": len(loads),
        "reloads_after_eviction": sum(n - 1 for _, _, n in loads),
        "copies_beyond_first_node": sum(c - 1 for c in per_model_nodes.values()),
        "evictions": sum(sum(n["evictions"].values()) for n in nodes),
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prefix_query_tokens": queries, "prefix_hit_tokens": hits,
        "ttft_s": {c: dist([r["ttft_s"] for r in ok if r["latency_class"] == c]) for c in CLASSES},
        "nodes": nodes,
    }


def run_policy(args, policy: str, trace: list[TraceRequest], directory: Path) -> dict:
    """Start three nodes and a gateway routing by `policy`, send the trace, read the nodes, stop everything."""
    config_path = gateway_config(policy, directory)
    node_args = ["--kv-cache-bytes", args.kv_cache_bytes, "--memory-budget", args.memory_budget, "--preload"]
    gateway_env = {"GATEWAY_WORKERS": str(args.gateway_workers)} if args.gateway_workers else {}
    log(f"[{policy}] starting {NODES} nodes and a gateway, logs in {directory} ...")
    (directory / policy).mkdir(parents=True, exist_ok=True)
    cluster = start_cluster(directory / policy, args.model, node_ports=[free_port() for _ in range(NODES)],
                            gateway_ports=[free_port()], redis=False, node_args=node_args,
                            env={"ZEN_CONFIG": str(config_path)}, gateway_env=gateway_env)
    try:
        token = mint_token(load_config(config_path, env={}), ORG)
        log(f"[{policy}] sending {len(trace)} requests over {trace[-1].at_s:.0f} s ...")
        records, duration = run_trace(cluster.gateway_urls[0], token, trace)
        nodes = [node_counters(url) for url in cluster.node_urls]
    finally:
        cluster.stop()
    return {"policy": policy, **summarize(records, duration, nodes), "records": records}


def fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def print_table(results: list[dict]) -> None:
    head = (f"{'policy':<18} {'ok':>5} {'loads':>5} {'reload':>6} {'copies':>6} {'hit rate':>8} "
            + " ".join(f"{c[:4] + ' p50/p99 ms':>17}" for c in CLASSES) + f" {'req/s':>6} {'tok/s':>6}")
    print(head)
    for r in results:
        ttft = " ".join(f"{fmt(r['ttft_s'][c]['p50']) + '/' + fmt(r['ttft_s'][c]['p99']):>17}" for c in CLASSES)
        print(f"{r['policy']:<18} {r['completed']:>2}/{r['requests']:<2} {r['cold_loads']:>5} "
              f"{r['reloads_after_eviction']:>6} {r['copies_beyond_first_node']:>6} "
              f"{r['prefix_cache_hit_rate']:>8.1%} {ttft} {r['requests_per_s']:>6.2f} {r['output_tokens_per_s']:>6.1f}")


def targets(results: list[dict]) -> dict:
    """The issue's targets, against round-robin where both ran."""
    by = {r["policy"]: r for r in results}
    out = {}
    if "score" in by:
        out["score_no_reloads"] = by["score"]["reloads_after_eviction"] == 0
    if "score" in by and "round_robin" in by:
        s, rr = by["score"], by["round_robin"]
        out["hit_rate_ratio_vs_round_robin"] = (s["prefix_cache_hit_rate"] / rr["prefix_cache_hit_rate"]
                                                if rr["prefix_cache_hit_rate"] else None)
        out["hit_rate_at_least_2x"] = (out["hit_rate_ratio_vs_round_robin"] or float("inf")) >= 2.0
        p99 = [x["ttft_s"]["realtime"]["p99"] for x in (s, rr)]
        out["realtime_ttft_p99_lower"] = None not in p99 and p99[0] < p99[1]
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_args(argv)
    if not Path(args.model).exists():
        raise SystemExit(f"error: {args.model} is missing: run `make model` first")
    trace = build_trace(args.requests, args.rate, args.seed)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    results = []
    logs = Path(tempfile.mkdtemp(prefix="zen-bench-routing-"))   # kept: the processes' logs of the run
    machine = machine_info()
    for policy in args.policies:
        results.append(run_policy(args, policy, trace, logs))
        print_table(results[-1:])
        write_json(args, {"benchmark": "routing", "started": started, "machine": machine,
                          "settings": settings_of(args, leave_out=("out",)),
                          "trace": {"requests": len(trace), "models": models_of(trace), "span_s": trace[-1].at_s,
                                    "apps": sorted({r.app for r in trace})},
                          "targets": targets(results), "results": results})
    print()
    print_table(results)
    print("targets:", json.dumps(targets(results)))
    return 0


def write_json(args, out: dict) -> None:
    """After each policy: a run cut short keeps what it measured."""
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
