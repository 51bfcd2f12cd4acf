"""Serving benchmark: what the gateway sustains, in the manner of vLLM's benchmark_serving.

    python benchmarks/bench_serving.py                 # drive a running gateway (make serve)
    python benchmarks/bench_serving.py --start         # start a node and a gateway, run, stop them
    python benchmarks/bench_serving.py --start --quick # a small run, about a minute

It drives the gateway's OpenAI-compatible API with the `openai` client (streaming, usage in the last
chunk) over the shipped prompt set (benchmarks/prompts.jsonl, from make_prompts.py: short and long
prompts, chat and completion; `ignore_eos` so every request generates exactly its max_tokens):

  * at fixed concurrency (default 1, 4, 16, 64): that many requests in flight, each client starting
    the next request as soon as its last one ended;
  * at Poisson request rates (default "auto": 50% and 90% of the best requests/s measured at fixed
    concurrency): exponential inter-arrival times from a seeded generator, no concurrency cap;

and reports, per level: completed and failed requests (the error rate), requests/s, output tokens/s,
time to first token (TTFT), inter-token latency (ITL: every gap between two token chunks of a
stream, pooled), time per output token (TPOT: (e2e - TTFT) / (tokens - 1) per request) and end-to-end
latency, each as mean, p50, p90, p99 with the sample count. A warm-up (JIT compilation, caches) runs
first and is excluded from every figure; its count is reported.

Constrained decoding (benchmarks/constrained_pass.py): at 16 streams, JSON-schema-constrained passes
against unconstrained ones on the same prompts, the ratio of their output tokens/s, and the TTFT
difference of a schema seen before (--no-constrained skips it, --constrained-only runs only it).

Gateway overhead: the same requests are sent straight to the engine node (POST /v1/generate with the
node secret) and through the gateway, with the same raw HTTP client (httpx, so the client's own cost
is the same on both paths), at the same concurrency, in alternating direct and gateway passes (which
path goes first alternates too); requests are paired by position, and p50/p90/p99 of the per-pair
difference of TTFT and of end-to-end latency are reported (greedy decoding with ignore_eos: both paths
generate the same number of tokens, which is checked). An unmeasured pass first puts the prompts in
the node's prefix cache, so that prefill, whose time varies far more than the gateway's own cost, is
the same short recomputation of the prompt's last block on both paths. --compare-base-url URL measures
another gateway in front of the same node (another commit's checkout) against this one instead: at
concurrency 1, each prompt straight, through one and through the other, in each of the six orders of
the three in turn, and the median per-prompt difference between the two gateways.

Output: bench-results/serving.json (every figure, the settings, the machine, the load average before
and after, the client's own CPU time) and bench-results/serving.png (latency against throughput;
needs matplotlib, the `bench` extra; --no-plot skips it). The client runs on the same machine as
the servers and shares its cores: its CPU time is in the JSON.

The token: --token, else $ZEN_TOKEN, else `python -m app.devtoken --org ORG` (the development secret;
ORG defaults to initech, the enterprise tier, whose limits do not throttle a benchmark). With the
shipped gateway settings (2 workers x 16 threads) at most 32 streams are served at once; --start
runs the gateway with --gateway-threads (64) per worker and the node with --node-threads (96), so
that concurrency 64 is real.

Peer (--peer): llama.cpp's `llama-server` (built once from PyPI's llama.cpp source by
benchmarks/llama_cpp_build.py, or --peer-server PATH) is started with `-np N` (continuous batching, N slots)
on the same GGUF (--model-path) with --peer-threads threads, for each N of --peer-concurrency, and driven by
the same client with the same prompts and max_tokens (ignore_eos, which llama-server honours) as our stack,
in --peer-rounds pairs of passes that alternate which side goes first; the JSON's "peer" holds each pass, the
pooled figures of each side and the ratios (output tokens/s, TTFT p50), and "targets" sets them beside
issue 21's. `make bench-peers` runs it (with --start).

The parts: serving_workload (prompts, the openai driver, the load shapes), gateway_overhead (the paired
direct/gateway passes), serving_peer (llama-server and the alternating passes), serving_stats (per-request
records, per-level figures), local_stack (--start), serving_report (the printed lines, the targets, the
plot); this script runs them and writes the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: benchmarks/ is a package of the repository

from benchmarks.constrained_pass import measure_constrained  # noqa: E402
from benchmarks.gateway_overhead import compare_gateways, measure_overhead  # noqa: E402
from benchmarks.http_client import httpx  # noqa: E402
from benchmarks.llama_cpp_build import build as build_llama_cpp  # noqa: E402
from benchmarks.local_stack import NODE_LOG, start_stack  # noqa: E402
from benchmarks.serving_report import (fmt_ratio, log, machine_info, print_level, settings_of, targets,  # noqa: E402
                                       write_plot)
from benchmarks.serving_peer import PeerSettings, compare_with_peer  # noqa: E402
from benchmarks.serving_stats import summarize  # noqa: E402
from benchmarks.serving_workload import OpenAIDriver, PromptOrder, load_prompts, run_concurrency, run_poisson  # noqa: E402,E501
from engine.protocol import DEV_NODE_SECRET  # noqa: E402

DEFAULT_PROMPTS = ROOT / "benchmarks" / "prompts.jsonl"
DEFAULT_MODEL_PATH = ROOT / "models" / "weights" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = ROOT / "bench-results" / "serving.json"


def get_token(args, env: dict) -> str:
    if args.token:
        return args.token
    if os.environ.get("ZEN_TOKEN"):
        return os.environ["ZEN_TOKEN"]
    proc = subprocess.run([sys.executable, "-m", "app.devtoken", "--org", args.org], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise SystemExit(f"error: python -m app.devtoken failed: {proc.stderr.strip()}")
    return proc.stdout.strip().splitlines()[-1]


def parse_list(text: str, cast) -> list:
    return [cast(x) for x in text.split(",") if x.strip()]


def build_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="the gateway (default http://127.0.0.1:8000, or the "
                                                        "one --start starts)")
    ap.add_argument("--token", default=None, help="bearer token (default: $ZEN_TOKEN or python -m app.devtoken)")
    ap.add_argument("--org", default="initech", help="org of the development token (default initech: "
                                                    "enterprise tier)")
    ap.add_argument("--model", default="zen-small", help="model alias to request")
    ap.add_argument("--latency-class", default="standard", choices=["realtime", "standard", "batch"])
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--seed", type=int, default=0, help="order of the prompts and Poisson arrivals")
    ap.add_argument("--lengths", default="short,long", help="prompt lengths to use (short, long)")
    ap.add_argument("--concurrency", default="1,4,16,64", help="fixed-concurrency levels")
    ap.add_argument("--requests-per-level", type=int, default=None,
                    help="requests per fixed-concurrency level (default max(12, 4 x concurrency))")
    ap.add_argument("--request-rate", default="auto",
                    help="Poisson rates in requests/s, comma-separated; 'auto' = 50%%,90%% of the best "
                         "requests/s at fixed concurrency; 'none' skips")
    ap.add_argument("--poisson-requests", type=int, default=64, help="requests per Poisson rate")
    ap.add_argument("--max-tokens", type=int, default=None, help="override every prompt's max_tokens")
    ap.add_argument("--warmup", type=int, default=8, help="warm-up requests (excluded from every figure)")
    ap.add_argument("--level-timeout", type=float, default=600.0, help="no new request after this many "
                                                                       "seconds of a level")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--node-url", default=None, help="engine node for the overhead measurement (default: "
                                                     "the first of $ZEN_NODES or http://127.0.0.1:8001)")
    ap.add_argument("--node-secret", default=None, help="default $NODE_SECRET or the development secret")
    ap.add_argument("--no-overhead", action="store_true", help="skip the gateway-overhead measurement")
    ap.add_argument("--overhead-concurrency", default="1,16")
    ap.add_argument("--overhead-requests", type=int, default=128, help="requests per overhead pass")
    ap.add_argument("--overhead-rounds", type=int, default=4,
                    help="direct/gateway pass pairs per level (the default gives 512 pairs: the median of a "
                         "small difference between two noisy TTFTs needs hundreds)")
    ap.add_argument("--overhead-max-tokens", type=int, default=16)
    ap.add_argument("--compare-base-url", default=None, metavar="URL",
                    help="instead of the overhead passes, compare this gateway with another one (e.g. a "
                         "checkout of another commit, in front of the same node): request by request, in "
                         "each of the six orders in turn, --overhead-requests x --overhead-rounds prompts at concurrency 1")
    ap.add_argument("--no-constrained", action="store_true", help="skip the constrained (JSON schema) pass")
    ap.add_argument("--constrained-only", action="store_true", help="only the constrained pass (after the warm-up)")
    ap.add_argument("--constrained-concurrency", type=int, default=16)
    ap.add_argument("--constrained-requests", type=int, default=64, help="requests per constrained pass")
    ap.add_argument("--constrained-rounds", type=int, default=2, help="unconstrained/constrained pass pairs")
    ap.add_argument("--constrained-ttft-pairs", type=int, default=16,
                    help="one-at-a-time unconstrained/constrained pairs for the TTFT difference")
    ap.add_argument("--start", action="store_true", help="start an engine node and a gateway, stop them after")
    ap.add_argument("--model-path", default=str(DEFAULT_MODEL_PATH), help="model of the node --start starts")
    ap.add_argument("--kv-cache-bytes", default="1GiB", help="KV cache of the node --start starts")
    ap.add_argument("--node-log-level", default="warning",
                    help="log level of the node --start starts (info: a line per request with its queue_s, "
                         "prefill_s and ttft_s in node.log beside --output, which split the overhead: the "
                         "node sees the gateway's requests as <org>/bench-gw-..., the direct ones as bench-...)")
    ap.add_argument("--node-threads", type=int, default=96)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256,
                    help="tokens per engine step of the node --start starts (prefill chunk + decodes)")
    ap.add_argument("--gateway-threads", type=int, default=64)
    ap.add_argument("--gateway-workers", type=int, default=None)
    ap.add_argument("--peer", action="store_true",
                    help="also drive llama.cpp's llama-server -np N with the same workload, passes alternating "
                         "with ours (builds it into .peers/ on first use: about ten minutes)")
    ap.add_argument("--peer-server", default=None, help="a llama-server binary to use instead of the built one")
    ap.add_argument("--peer-concurrency", default="1,16", help="streams at which ours and the peer are compared")
    ap.add_argument("--peer-rounds", type=int, default=3, help="pairs of passes (ours, peer) per level")
    ap.add_argument("--peer-requests", type=int, default=None,
                    help="requests per pass (default max(8, 2 x concurrency))")
    ap.add_argument("--peer-threads", type=int, default=os.cpu_count() or 1,
                    help="llama-server's compute threads (default: the cores, as our engine's numba threads)")
    ap.add_argument("--peer-ctx", type=int, default=2048, help="llama-server's context per stream (slot)")
    ap.add_argument("--quick", action="store_true", help="a small run (few requests), about a minute")
    ap.add_argument("--output", default=str(DEFAULT_OUT))
    ap.add_argument("--plot", default=None, help="PNG path (default: next to --output)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:                    # about a minute on a 2-core machine, start-up included
        if args.concurrency == "1,4,16,64":
            args.concurrency = "1,4,16"
        args.requests_per_level = args.requests_per_level or -1      # -1: the quick sizes below
        if args.request_rate == "auto":
            args.request_rate = "auto-one"
        if args.lengths == "short,long":
            args.lengths = "short"
        args.poisson_requests = min(args.poisson_requests, 8)
        args.max_tokens = args.max_tokens or 16
        args.warmup = min(args.warmup, 2)
        args.overhead_concurrency = "1,4" if args.overhead_concurrency == "1,16" else args.overhead_concurrency
        args.overhead_requests = min(args.overhead_requests, 4)
        args.overhead_rounds = 2
        args.overhead_max_tokens = min(args.overhead_max_tokens, 8)
        args.level_timeout = min(args.level_timeout, 60.0)
        args.constrained_requests = min(args.constrained_requests, 16)
        args.constrained_rounds = 1
        args.constrained_ttft_pairs = min(args.constrained_ttft_pairs, 4)
    if args.compare_base_url and (args.no_overhead or args.constrained_only):
        ap.error("--compare-base-url is an overhead measurement: not with --no-overhead or --constrained-only")
    return args


def level_requests(args, c: int) -> int:
    if args.requests_per_level == -1:                 # --quick
        return {1: 2, 4: 4}.get(c, c)
    return args.requests_per_level or max(12, 4 * c)


async def warm_up(driver: OpenAIDriver, prompts: list[dict], args) -> dict:
    """Every kind and length, excluded from all figures; what it did, for the JSON."""
    warm: list[dict] = []
    by_class: dict[tuple, list] = {}
    for p in prompts:
        by_class.setdefault((p["kind"], p["length"]), []).append(p)
    i = 0
    while len(warm) < args.warmup:
        for cls in sorted(by_class):
            if len(warm) < args.warmup:
                warm.append(by_class[cls][i % len(by_class[cls])])
        i += 1
    t = time.perf_counter()
    recs, _, _ = await run_concurrency(driver, warm, min(4, max(1, len(warm))), args.level_timeout)
    warmup = {"requests": len(recs), "failed": sum(1 for r in recs if not r.ok),
              "seconds": time.perf_counter() - t,
              "errors": [r.error for r in recs if not r.ok][:5]}
    log(f"warm-up: {len(recs)} requests in {warmup['seconds']:.1f} s "
        f"({warmup['failed']} failed) -- excluded from the figures")
    if recs and all(not r.ok for r in recs):
        raise SystemExit(f"error: every warm-up request failed: {recs[0].error}")
    return warmup


async def run_levels(driver: OpenAIDriver, order: PromptOrder, args, concurrency: list[int]) -> list[dict]:
    """The fixed-concurrency levels, then the Poisson rates (auto: fractions of the best requests/s)."""
    levels: list[dict] = []
    for c in concurrency:
        reqs = order.take(level_requests(args, c))
        records, t0, t1 = await run_concurrency(driver, reqs, c, args.level_timeout)
        s = {"mode": "concurrency", "concurrency": c, "request_rate": None, **summarize(records, t0, t1)}
        levels.append(s)
        print_level(f"concurrency {c}", s)

    rates: list[float] = []
    if args.request_rate.startswith("auto"):
        best = max((lv["requests_per_s"] for lv in levels if lv["completed"]), default=0.0)
        if best > 0:
            fractions = (0.9,) if args.request_rate == "auto-one" else (0.5, 0.9)
            rates = [round(best * f, 3) for f in fractions]
    elif args.request_rate != "none":
        rates = parse_list(args.request_rate, float)
    for j, rate in enumerate(rates):
        reqs = order.take(args.poisson_requests)
        records, t0, t1 = await run_poisson(driver, reqs, rate, args.seed + j, args.level_timeout)
        s = {"mode": "poisson", "concurrency": None, "request_rate": rate, **summarize(records, t0, t1)}
        levels.append(s)
        print_level(f"poisson {rate:g}/s", s)
    return levels


def overhead_samples(args, prompts: list[dict]) -> Callable[[int], list[dict]]:
    """The overhead measurements' workload: n short prompts at each call, drawn with --seed."""
    short = [p for p in prompts if p["length"] == "short"]
    rng = random.Random(args.seed + 1000)
    return lambda n: [short[rng.randrange(len(short))] for _ in range(n)]


async def run_overhead(args, base_url: str, token: str, node_url: str, node_secret: str, model_id: str,
                       quant: str | None, prompts: list[dict]) -> list[dict]:
    """The gateway overhead at each of --overhead-concurrency, on the short prompts."""
    overhead: list[dict] = []
    # The node --start started logs each request at level info: then its own timings split the overhead.
    node_log = (Path(args.output).parent / NODE_LOG
                if args.start and args.node_log_level.lower() in ("info", "debug") else None)
    draw = overhead_samples(args, prompts)
    for c in parse_list(args.overhead_concurrency, int):
        sample = draw(args.overhead_requests)
        o = await measure_overhead(args, base_url, token, node_url, node_secret, args.model, model_id,
                                   quant, sample, c, args.overhead_rounds, node_log)
        overhead.append(o)
        d, e = o["ttft_diff_ms"], o["e2e_diff_ms"]
        if d["n"]:
            lo, hi = o["ttft_diff_p50_ci95_ms"]
            log(f"overhead c={c:<3d} | {o['pairs_ok']}/{o['pairs']} pairs | gateway - direct: TTFT "
                f"p50 {d['p50']:.2f} ms (95% interval {lo:.2f}-{hi:.2f}) p99 {d['p99']:.2f} ms | "
                f"E2E p50 {e['p50']:.2f} ms p99 {e['p99']:.2f} ms")
            if o.get("node_side_diff_ms"):
                n = o["node_side_diff_ms"]
                log(f"               | of which at the node (its own timings, p50): queue "
                    f"{n['queue_s']['p50']:.2f} ms, prefill {n['prefill_s']['p50']:.2f} ms, "
                    f"TTFT {n['ttft_s']['p50']:.2f} ms; inter-token {n['mean_itl_s']['p50']:.2f} ms")
        else:
            log(f"overhead c={c}: no successful pairs: {o['errors'][:2]}")
    return overhead


async def run_compare(args, base_url: str, token: str, node_url: str, node_secret: str, model_id: str,
                      quant: str | None, prompts: list[dict]) -> dict:
    """This gateway's overhead against --compare-base-url's, interleaved request by request."""
    sample = overhead_samples(args, prompts)(args.overhead_requests * args.overhead_rounds)
    o = await compare_gateways(args, base_url, args.compare_base_url.rstrip("/"), token, node_url, node_secret,
                               args.model, model_id, quant, sample)
    if o["complete"]:
        t, b, d = o["overhead_ms"]["this"], o["overhead_ms"]["other"], o["this_minus_other_ms"]
        log(f"overhead c=1 | {o['complete']}/{o['requests']} prompts | TTFT p50, gateway - direct: this "
            f"{t['p50']:.2f} ms, other {b['p50']:.2f} ms | this - other: p50 {d['p50']:.2f} ms")
    else:
        log(f"overhead comparison: no prompt completed on every path: {o['errors'][:2]}")
    return o


def peer_settings(args) -> PeerSettings | None:
    """None without --peer; else the llama-server to run (built now if it is not yet) and the passes' sizes."""
    if not (args.peer or args.peer_server):
        return None
    if args.peer_server:
        server = Path(args.peer_server)
        proc = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"error: {server} --version failed: {proc.stderr.strip()[-300:]}")
        version = next((ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("version")), "")
    else:
        built = build_llama_cpp()
        server, version = built.server, f"{built.version}, from {built.package}"
    if not Path(args.model_path).exists():
        raise SystemExit(f"error: {args.model_path} is missing: run `make model` first")
    return PeerSettings(server=server, version=version, model_path=Path(args.model_path),
                        threads=args.peer_threads, ctx_per_stream=args.peer_ctx,
                        concurrency=parse_list(args.peer_concurrency, int), rounds=args.peer_rounds,
                        requests_per_pass=args.peer_requests)


async def bench(args, base_url: str, token: str, node_url: str | None, node_secret: str,
                peer: PeerSettings | None = None, stack_pids: list[int] | None = None) -> dict:
    concurrency = parse_list(args.concurrency, int)
    lengths = set(parse_list(args.lengths, str))
    prompts = [p for p in load_prompts(Path(args.prompts)) if p["length"] in lengths]
    if not prompts:
        raise SystemExit(f"error: no prompts of length {args.lengths}")
    order = PromptOrder(prompts, args.seed)
    max_conn = max(concurrency + [16]) + 16
    driver = OpenAIDriver(base_url, token, args.model, args.latency_class, max_conn, args.request_timeout,
                          args.max_tokens)
    result: dict[str, Any] = {"levels": [], "overhead": []}
    try:
        # The model behind the alias (for the direct-to-node requests) and a reachability check.
        models = await driver.client.models.list()
        entry = next((m for m in models.data if m.id == args.model), None)
        if entry is None:
            raise SystemExit(f"error: the gateway does not offer {args.model!r} to this token")
        extra = entry.model_extra or {}
        model_id, quant = extra.get("root") or args.model, extra.get("quantization") or None

        result["warmup"] = await warm_up(driver, prompts, args)
        if not args.constrained_only:
            result["levels"] = await run_levels(driver, order, args, concurrency)
        if not args.no_constrained:
            result["constrained"] = await measure_constrained(args, base_url, token, prompts)
        if node_url and args.compare_base_url:
            result["overhead_compare"] = await run_compare(args, base_url, token, node_url, node_secret, model_id,
                                                           quant, prompts)
        elif node_url and not args.no_overhead and not args.constrained_only:
            result["overhead"] = await run_overhead(args, base_url, token, node_url, node_secret, model_id, quant,
                                                    prompts)
        if peer is not None:
            result["peer"] = await compare_with_peer(driver, peer, order, args, Path(args.output).parent, stack_pids)
        result["model"] = {"alias": args.model, "id": model_id, "quantization": quant}
    finally:
        await driver.close()
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_args(argv)
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    plot_path = Path(args.plot) if args.plot else out_path.with_suffix(".png")
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            log("error: the plot needs matplotlib (pip install -e '.[bench]' or pip install matplotlib); "
                "or pass --no-plot")
            return 2
    cluster = None
    env = dict(os.environ)
    load_before = os.getloadavg()
    wall0 = time.time()
    peer = peer_settings(args)       # before our stack starts: a first build takes the cores for minutes
    try:
        if args.start:
            cluster, base_url, node_url, node_secret = start_stack(args, out_path.parent)
        else:
            base_url = (args.base_url or "http://127.0.0.1:8000").rstrip("/")
            nodes = [u for u in os.environ.get("ZEN_NODES", "").split(",") if u.strip()]
            node_url = (args.node_url or (nodes[0] if nodes else "http://127.0.0.1:8001")).rstrip("/")
            node_secret = args.node_secret or os.environ.get("NODE_SECRET") or DEV_NODE_SECRET
            try:
                httpx.get(base_url + "/ready", timeout=5.0).raise_for_status()
            except httpx.HTTPError as exc:
                log(f"error: no gateway at {base_url} ({exc.__class__.__name__}); start one (make serve) or "
                    f"run with --start")
                return 2
            if not args.no_overhead:
                try:
                    httpx.get(node_url + "/ready", timeout=5.0).raise_for_status()
                except httpx.HTTPError:
                    log(f"note: no engine node at {node_url}: the overhead measurement is skipped "
                        f"(--node-url, --node-secret)")
                    node_url = None
        token = get_token(args, env)
        log(f"benchmarking {base_url} (model {args.model}, latency class {args.latency_class})")
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        stack_pids = [s.proc.pid for s in cluster.services()] if cluster is not None else None
        result = asyncio.run(bench(args, base_url, token, node_url, node_secret, peer, stack_pids))
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        if cluster is not None:
            cluster.stop()
    result["meta"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "machine": machine_info(),
        "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
        "wall_s": time.time() - wall0,
        "client_cpu_s": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
        "note": "the client shares the machine's cores with the gateway and the node",
    }
    result["config"] = settings_of(args, leave_out=("token",))
    if args.start:
        result["config"]["stack"] = {"started": True, "gateway_threads_per_worker": args.gateway_threads,
                                     "node_threads": args.node_threads, "kv_cache_bytes": args.kv_cache_bytes}
    result["targets"] = targets(result)
    if result.get("constrained"):
        k = result["constrained"]
        result["targets"].update(constrained_ratio=k["ratio"], target_constrained_ratio=k["target_ratio"],
                                 constrained_ttft_diff_p50_ms=k["ttft_diff_ms"]["p50"],
                                 target_constrained_ttft_diff_ms=k["target_ttft_diff_ms"])
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out_path}")
    if not args.no_plot:
        write_plot(result, plot_path)
        log(f"wrote {plot_path}")
    t = result["targets"]
    if "c16_output_tokens_per_s" in t:
        log(f"16 concurrent streams: {t['c16_output_tokens_per_s']:.1f} output tokens/s, "
            f"median TTFT {t['c16_ttft_p50_s']:.3f} s")
    for lv in result.get("peer", {}).get("levels", []):
        c = lv["concurrency"]
        checks = (("tokens/s target", f"c{c}_vs_peer_output_tokens_per_s_met"),
                  ("TTFT target", f"c{c}_vs_peer_ttft_p50_met"))
        met = [f"{what} {'met' if t[key] else 'NOT met'}" for what, key in checks if key in t]
        log(f"against llama-server -np {c}: {fmt_ratio(lv['output_tokens_per_s_ratio'])} its output tokens/s, "
            f"{fmt_ratio(lv['ttft_p50_ratio'])} its TTFT p50" + (f" ({', '.join(met)})" if met else ""))
    if "overhead_ttft_p50_ms" in t:
        ci = t.get("overhead_ttft_p50_ci95_ms")
        log(f"gateway overhead at concurrency {t['overhead_concurrency']}: TTFT p50 "
            f"{t['overhead_ttft_p50_ms']:.2f} ms" + (f" (95% interval {ci[0]:.2f}-{ci[1]:.2f})" if ci else "")
            + f", end-to-end p50 {t['overhead_e2e_p50_ms']:.2f} ms")
    if "constrained_ratio" in t:
        log(f"constrained decoding at {result['constrained']['concurrency']} streams: {t['constrained_ratio']:.3f} "
            f"of the unconstrained tokens/s (target >= {t['target_constrained_ratio']}); TTFT of a cached "
            f"schema +{t['constrained_ttft_diff_p50_ms']:.2f} ms p50 (target <= "
            f"{t['target_constrained_ttft_diff_ms']:g} ms)")
    failed = sum(lv["failed"] for lv in result["levels"])
    return 1 if failed and failed == sum(lv["requests"] for lv in result["levels"]) else 0


if __name__ == "__main__":
    sys.exit(main())
