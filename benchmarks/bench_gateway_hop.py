"""The gateway's own cost on the way to the first token, against a stand-in node without noise.

bench_serving measures the gateway overhead against the real node, whose time to first token moves
by tens of milliseconds between requests (the prompt's uncached tail, the machine's load): its median
needs hundreds of pairs and still moves by a millisecond between runs. This benchmark swaps the node
for a stand-in that speaks the node protocol and, for each request, computes for a fixed time on every
core the way a prefill does (a numba parallel loop that holds the GIL, launched from one compute thread
as the node's step thread launches its kernels, libgomp set as the node's), then streams a
few tokens. The first token carries the stand-in's clock readings, which splits
the gateway's cost in three:
  - before the node: from the client's send to the request's arrival at the node (gunicorn, Flask,
    auth, rate limits, validation, routing; for the direct path, the node's own reception);
  - at the node: how much longer the stand-in's computation took (the gateway's work while the node
    computes takes its cores: reading the node's headers, the response's set-up, the client's wake-up);
  - after the node: from the token's write at the node to its arrival at the client (the relay).
What is left over (printed as "the rest") is spent at the node outside the compute: its reception's
end, the hand-off to its compute thread and back, and its header write.

Requests alternate between the stand-in straight and through the gateway, in pairs whose order
alternates; medians and p90 of the per-pair differences are printed and written as JSON, with the
gateway's CPU time per request (all its processes, over the timed pairs)
(bench-results/gateway-hop.json). `make bench-gateway-hop`. Everything runs on this machine's cores,
as in bench_serving.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.process_cpu import cpu_seconds  # noqa: E402
from benchmarks.serving_report import log, machine_info  # noqa: E402
from benchmarks.serving_stats import dist  # noqa: E402
from scripts.local_processes import Service, free_port, wait_http  # noqa: E402

MODEL_ID, QUANTIZATION, ALIAS = "SmolLM2-135M-Instruct", "q4_1", "zen-small"


# ------------------------------------------------------------------------- the stand-in node (gunicorn)

def create_standin() -> "flask.Flask":  # noqa: F821
    """The stand-in node's app (gunicorn `benchmarks.bench_gateway_hop:create_standin()`); its compute time
    per request comes from $HOP_COMPUTE_MS, its secret from $NODE_SECRET."""
    from engine.node.serve import openmp_defaults
    openmp_defaults(os.environ)   # as the node: before libgomp is loaded
    import numpy as np
    from flask import Flask, Response, abort, request
    from numba import njit, prange

    @njit(parallel=True)
    def compute(n, out):
        for t in prange(out.shape[0]):   # static: one share per thread, as the node's kernels
            s = 0.0
            for i in range(n):
                s = s * 0.999999 + i
            out[t] = s

    out = np.zeros(max(1, os.cpu_count() or 1))
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    seconds_per_iteration: queue.SimpleQueue = queue.SimpleQueue()

    def compute_thread() -> None:
        # Every parallel loop is launched from this one thread, as the node's step thread launches its
        # kernels: libgomp gives each launching thread a team of its own, and with more teams' threads
        # than cores it stops spinning between regions (engine/node/loop.py, StepThread).
        compute(1000, out)
        t0 = time.perf_counter()
        compute(2_000_000, out)
        seconds_per_iteration.put((time.perf_counter() - t0) / 2_000_000)
        while True:
            n, reply = jobs.get()
            c0 = time.perf_counter()
            compute(n, out)
            reply.put(time.perf_counter() - c0)

    threading.Thread(target=compute_thread, name="stand-in-compute", daemon=True).start()
    iterations = int(float(os.environ.get("HOP_COMPUTE_MS", "8")) / 1e3 / seconds_per_iteration.get())
    secret = os.environ.get("NODE_SECRET", "")
    state = {"node_id": "stand-in", "healthy": True, "ready": True, "available_models": [MODEL_ID],
             "utilization": 0.0, "kv_cache_usage": 0.0, "queue": {"max_waiting": 256, "running": 0, "waiting": 0},
             "models": [{"id": MODEL_ID, "quantization": QUANTIZATION, "formats": [QUANTIZATION], "version": "x",
                         "bytes": 1, "load_time_s": 1.0, "max_model_len": 8192, "prefill_tokens_per_s": 500.0,
                         "decode_tokens_per_s": 200.0, "running": 0, "waiting": 0}]}
    app = Flask("stand-in-node")

    @app.before_request
    def _secret():
        if request.path not in ("/health", "/ready") and request.headers.get("X-Node-Secret") != secret:
            abort(401)

    @app.get("/health")
    @app.get("/ready")
    def health():
        return {"status": "ok"}

    @app.get("/state")
    def node_state():
        return state

    @app.post("/v1/generate")
    def generate():
        arrived = time.time()
        body = request.get_json()
        n = int(body["sampling"]["max_tokens"])

        def events():
            yield ": ping\n\n"          # the headers go out now, as the node's do
            reply: queue.SimpleQueue = queue.SimpleQueue()
            jobs.put((iterations, reply))
            computed = reply.get()
            for i in range(n):
                text = f"{arrived:.6f} {computed:.6f} {time.time():.6f}" if i == 0 else " x"
                yield "data: " + json.dumps({"type": "token", "index": 0, "token_id": 1, "text": text,
                                             "logprobs": None}) + "\n\n"
            yield "data: " + json.dumps({"type": "done", "choices": [{"index": 0, "finish_reason": "length"}],
                                         "usage": {"prompt_tokens": 3, "completion_tokens": n,
                                                   "total_tokens": n + 3}, "timings": {}}) + "\n\n"
        return Response(events(), mimetype="text/event-stream")

    return app


# ------------------------------------------------------------------------------------------ the client

class Endpoint:
    """One keep-alive connection and the request it sends: straight to the stand-in or through the gateway."""

    def __init__(self, port: int, path: str, headers: dict, body: Callable[[int], dict]) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.path, self.body = path, body
        self.headers = {"Content-Type": "application/json", **headers}

    def first_token(self, i: int) -> dict:
        """Request i's first token: its TTFT, the three parts of it and the rest, in seconds."""
        t0 = time.time()
        self.conn.request("POST", self.path, body=json.dumps(self.body(i)), headers=self.headers)
        resp = self.conn.getresponse()
        if resp.status != 200:
            raise SystemExit(f"error: HTTP {resp.status}: {resp.read()[:300]!r}")
        sample = None
        for line in resp:   # read to the end: the connection is reused
            if sample is None and line.startswith(b"data: {"):
                got = time.time()
                event = json.loads(line[6:])
                text = event["text"] if "type" in event else event["choices"][0]["text"]
                arrived, computed, sent = (float(x) for x in text.split())
                before, after = arrived - t0, got - sent
                sample = {"ttft": got - t0, "before": before, "compute": computed, "after": after,
                          "rest": got - t0 - before - computed - after}
        if sample is None:
            raise SystemExit("error: the stream carried no token")
        return sample


def _head_commit(checkout: str) -> str | None:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True).stdout.strip() or None


def run(args) -> dict:
    node_port, gw_port = free_port(), free_port()
    secret = "bench-gateway-hop"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update({"NODE_SECRET": secret, "PYTHONUNBUFFERED": "1", "HOP_COMPUTE_MS": str(args.compute_ms)})
    out_dir = Path(args.output).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    services: list[Service] = []
    try:
        node = Service("stand-in node", [sys.executable, "-m", "gunicorn", "-k", "gthread", "--threads", "8",
                                         "--keep-alive", "30", "-b", f"127.0.0.1:{node_port}",
                                         "benchmarks.bench_gateway_hop:create_standin()"],
                       env, out_dir / "gateway-hop-node.log")
        services.append(node)
        wait_http(f"http://127.0.0.1:{node_port}/ready", node, 120)
        gw_env = {**env, "PORT": str(gw_port), "ZEN_NODES": f"http://127.0.0.1:{node_port}"}
        if args.limits_url:
            gw_env["REDIS_URL"] = args.limits_url
        gateway = Service("gateway", [sys.executable, "-m", "app", "serve"], gw_env, out_dir / "gateway-hop-gateway.log",
                          cwd=args.gateway_from)
        services.append(gateway)
        # another checkout may predate /ready: then /health, and the warm-up pairs make the first node poll
        wait_http(f"http://127.0.0.1:{gw_port}/{'health' if args.gateway_from else 'ready'}", gateway, 120)
        token = subprocess.run([sys.executable, "-m", "app.devtoken", "--org", "initech"], cwd=ROOT, env=env,
                               capture_output=True, text=True, check=True).stdout.split()[-1]
        mt = args.max_tokens
        direct = Endpoint(node_port, "/v1/generate", {"X-Node-Secret": secret}, lambda i: {
            "request_id": f"hop-{i}", "model": MODEL_ID, "quantization": QUANTIZATION, "org": "bench",
            "prompt": "Hello", "stream": True, "sampling": {"max_tokens": mt, "temperature": 0.0}})
        through = Endpoint(gw_port, "/v1/completions", {"Authorization": f"Bearer {token}"}, lambda i: {
            "model": ALIAS, "prompt": "Hello", "max_tokens": mt, "temperature": 0.0, "stream": True})
        pairs = []
        for i in range(args.warmup + args.pairs):   # which path goes first alternates
            if i == args.warmup:
                cpu_before = cpu_seconds(gateway.proc.pid)
            if i % 2 == 0:
                d, g = direct.first_token(i), through.first_token(i)
            else:
                g, d = through.first_token(i), direct.first_token(i)
            if i >= args.warmup:
                pairs.append((d, g))
        gateway_cpu_ms = (cpu_seconds(gateway.proc.pid) - cpu_before) / args.pairs * 1e3
    finally:
        for s in reversed(services):
            s.stop()
    result = {"config": {"pairs": args.pairs, "warmup": args.warmup, "compute_ms": args.compute_ms,
                         "max_tokens": args.max_tokens, "gateway_from": args.gateway_from,
                         "gateway_commit": _head_commit(args.gateway_from) if args.gateway_from else None,
                         "limits_url": args.limits_url},
              "meta": machine_info(), "gateway_cpu_ms_per_request": round(gateway_cpu_ms, 3), "parts": {}}
    for part in ("ttft", "before", "compute", "after", "rest"):
        result["parts"][part] = {"direct_ms": dist([d[part] for d, _ in pairs], 1e3),
                                 "gateway_ms": dist([g[part] for _, g in pairs], 1e3),
                                 "diff_ms": dist([g[part] - d[part] for d, g in pairs], 1e3)}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--compute-ms", type=float, default=8.0, help="the stand-in's compute per request, on every core")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--output", default=str(ROOT / "bench-results" / "gateway-hop.json"))
    ap.add_argument("--gateway-from", default=None, metavar="DIR",
                    help="run the gateway from this checkout (another commit; same Python), to compare commits")
    ap.add_argument("--limits-url", default=None, help="the gateway's limits storage (as REDIS_URL), e.g. memory://")
    args = ap.parse_args(argv)
    if args.gateway_from:
        args.gateway_from = str(Path(args.gateway_from).resolve())
    try:
        result = run(args)
    except RuntimeError as exc:   # the stand-in or the gateway exited or never became ready
        log(f"error: {exc}")
        return 1
    names = {"ttft": "time to first token", "before": "  before the node", "compute": "  at the node (compute)",
             "after": "  after the node (relay)", "rest": "  rest: at the node, not computing"}
    print(f"{'(medians; the difference per pair)':34s} {'direct':>9s} {'gateway':>9s} {'diff p50':>9s} "
          f"{'diff p90':>9s}  (ms, {args.pairs} pairs)")
    for part, r in result["parts"].items():
        print(f"{names[part]:34s} {r['direct_ms']['p50']:9.3f} {r['gateway_ms']['p50']:9.3f} "
              f"{r['diff_ms']['p50']:9.3f} {r['diff_ms']['p90']:9.3f}")
    print(f"the gateway's CPU time per request: {result['gateway_cpu_ms_per_request']:.3f} ms")
    sys.stdout.flush()
    Path(args.output).write_text(json.dumps(result, indent=2))
    log(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
