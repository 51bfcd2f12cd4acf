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

Gateway overhead: the same requests are sent straight to the engine node (POST /v1/generate with the
node secret) and through the gateway, with the same raw HTTP client (httpx, so the client's own cost
is the same on both paths), at the same concurrency, in alternating direct and gateway passes (which
path goes first alternates too); requests are paired by position, and p50/p90/p99 of the per-pair
difference of TTFT and of end-to-end latency are reported (greedy decoding with ignore_eos: both paths
generate the same number of tokens, which is checked). An unmeasured pass first puts the prompts in
the node's prefix cache, so that prefill, whose time varies far more than the gateway's own cost, is
the same short recomputation of the prompt's last block on both paths.

Output: bench-results/serving.json (every figure, the settings, the machine, the load average before
and after, the client's own CPU time) and bench-results/serving.png (latency against throughput;
needs matplotlib, the `bench` extra; --no-plot skips it). The client runs on the same machine as
the servers and shares its cores: its CPU time is in the JSON.

The token: --token, else $ZEN_TOKEN, else `python -m app.devtoken --org ORG` (the development secret;
ORG defaults to initech, the enterprise tier, whose limits do not throttle a benchmark). With the
shipped gateway settings (2 workers x 16 threads) at most 32 streams are served at once; --start
runs the gateway with --gateway-threads (64) per worker and the node with --node-threads (96), so
that concurrency 64 is real.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import resource
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = ROOT / "benchmarks" / "prompts.jsonl"
DEFAULT_MODEL_PATH = ROOT / "models" / "weights" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = ROOT / "bench-results" / "serving.json"
DEV_NODE_SECRET = "zen-development-node-secret"
PEER_C16_TOKENS_PER_S = 80.0       # llama.cpp's server, 16 concurrent streams, same machine and model

try:                                # the openai client brings httpx (or its successor httpx2)
    import httpx
except ImportError:                 # pragma: no cover - depends on the openai release
    import httpx2 as httpx          # type: ignore[no-redef]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ prompt set

def load_prompts(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"error: no prompts in {path}")
    return rows


class PromptOrder:
    """The prompt set in one seeded order, handed out in turn (cycling), so every run sends the same
    requests in the same order and each level sees the same mix."""

    def __init__(self, prompts: list[dict], seed: int):
        self.prompts = prompts
        self.order = list(range(len(prompts)))
        random.Random(seed).shuffle(self.order)
        self.pos = 0

    def take(self, n: int) -> list[dict]:
        out = [self.prompts[self.order[(self.pos + i) % len(self.order)]] for i in range(n)]
        self.pos += n
        return out


# ------------------------------------------------------------------------------------ statistics

def dist(values: list[float], scale: float = 1.0) -> dict:
    """mean/p50/p90/p99/min/max of `values` (times `scale`), with the count; None fields if empty."""
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "min": None, "max": None}
    a = np.asarray(values, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "min": float(a.min()), "max": float(a.max())}


@dataclass
class RequestRecord:
    prompt_id: str
    kind: str
    length: str
    max_tokens: int
    ok: bool = False
    error: str | None = None
    start: float = 0.0              # perf_counter at send
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    token_chunks: int = 0


def summarize(records: list[RequestRecord], started: float, ended: float) -> dict:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    duration = max(1e-9, ended - started)
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
            if r.ttft is not None and r.e2e is not None and r.output_tokens > 1]
    errors: dict[str, int] = {}
    for r in failed:
        key = (r.error or "unknown")[:160]
        errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(records), "completed": len(ok), "failed": len(failed),
        "error_rate": len(failed) / len(records) if records else 0.0,
        "duration_s": duration,
        "requests_per_s": len(ok) / duration,
        "output_tokens_per_s": out_tokens / duration,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "short_long": {"short": sum(1 for r in ok if r.length == "short"),
                       "long": sum(1 for r in ok if r.length == "long")},
        "ttft_s": dist([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": dist([g for r in ok for g in r.itl]),
        "tpot_s": dist(tpot),
        "e2e_s": dist([r.e2e for r in ok if r.e2e is not None]),
        "errors": errors,
    }


# ------------------------------------------------------------------------------ one request (openai)

class OpenAIDriver:
    """Streams requests through the gateway with the openai client and times them."""

    def __init__(self, base_url: str, token: str, model: str, latency_class: str, max_connections: int,
                 request_timeout: float, max_tokens_override: int | None):
        import openai
        self.model = model
        self.headers = {"X-Latency-Class": latency_class}
        self.max_tokens_override = max_tokens_override
        self.http = openai.DefaultAsyncHttpxClient(
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            timeout=httpx.Timeout(request_timeout, connect=10.0))
        self.client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=token, max_retries=0,
                                         timeout=request_timeout, http_client=self.http)

    async def close(self) -> None:
        await self.client.close()

    def max_tokens(self, p: dict) -> int:
        return self.max_tokens_override or int(p["max_tokens"])

    async def run(self, p: dict) -> RequestRecord:
        rec = RequestRecord(p["id"], p["kind"], p["length"], self.max_tokens(p))
        common = dict(model=self.model, max_tokens=rec.max_tokens, temperature=0.0, stream=True,
                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                      extra_headers=self.headers)
        rec.start = time.perf_counter()
        last = None
        usage = None
        try:
            if p["kind"] == "chat":
                stream = await self.client.chat.completions.create(messages=p["messages"], **common)
            else:
                stream = await self.client.completions.create(prompt=p["prompt"], **common)
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    usage = chunk.usage
                if not chunk.choices:
                    continue
                c = chunk.choices[0]
                if c.finish_reason is not None:
                    continue
                if p["kind"] == "chat":
                    if c.delta.role is not None or c.delta.content is None:   # the opening role chunk
                        continue
                rec.token_chunks += 1
                if last is None:
                    rec.ttft = now - rec.start
                else:
                    rec.itl.append(now - last)
                last = now
            rec.e2e = time.perf_counter() - rec.start
            if usage is None:
                rec.error = "stream ended without usage"
            else:
                rec.output_tokens = int(usage.completion_tokens)
                rec.prompt_tokens = int(usage.prompt_tokens)
                rec.ok = rec.token_chunks > 0
                if not rec.ok:
                    rec.error = "no tokens"
        except Exception as exc:  # noqa: BLE001 - every failure is counted, with its kind
            rec.e2e = time.perf_counter() - rec.start
            rec.error = f"{exc.__class__.__name__}: {str(exc)[:200]}"
        return rec


# ------------------------------------------------------------------------------------ load shapes

async def run_concurrency(driver: OpenAIDriver, prompts: list[dict], concurrency: int,
                          deadline_s: float) -> tuple[list[RequestRecord], float, float]:
    """`concurrency` clients, each sending its next request when the last one ended; no new request
    after deadline_s (those not sent are not counted)."""
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    records: list[RequestRecord] = []
    started = time.perf_counter()
    stop_at = started + deadline_s

    async def client() -> None:
        while time.perf_counter() < stop_at:
            try:
                p = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            records.append(await driver.run(p))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return records, started, time.perf_counter()


async def run_poisson(driver: OpenAIDriver, prompts: list[dict], rate: float, seed: int,
                      deadline_s: float) -> tuple[list[RequestRecord], float, float]:
    """Requests at exponential inter-arrival times (mean 1/rate), no cap on requests in flight."""
    rng = random.Random(seed)
    tasks = []
    started = time.perf_counter()
    t = 0.0
    for p in prompts:
        if t > deadline_s:
            break
        delay = started + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(driver.run(p)))
        t += rng.expovariate(rate)
    records = list(await asyncio.gather(*tasks))
    return records, started, time.perf_counter()


# ------------------------------------------------------------------------------ gateway overhead

def gateway_body(p: dict, model: str, max_tokens: int) -> tuple[str, dict]:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if p["kind"] == "chat":
        return "/v1/chat/completions", {**body, "messages": p["messages"]}
    return "/v1/completions", {**body, "prompt": p["prompt"]}


def node_body(p: dict, model_id: str, quantization: str, latency_class: str, max_tokens: int) -> dict:
    body = {"request_id": "bench-" + uuid.uuid4().hex, "model": model_id, "quantization": quantization,
            "org": "bench", "latency_class": latency_class, "stream": True,
            "sampling": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
    if p["kind"] == "chat":
        body["messages"] = p["messages"]
    else:
        body["prompt"] = p["prompt"]
    return body


async def raw_stream(client, url: str, body: dict, headers: dict, gateway: bool) -> dict:
    """One streaming request with the raw client: {ok, ttft, e2e, tokens, error}."""
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread())[:200]
                return {"ok": False, "error": f"HTTP {resp.status_code}: {text!r}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if gateway:
                    if event.get("error"):
                        return {"ok": False, "error": str(event["error"].get("message"))[:200]}
                    choices = event.get("choices") or []
                    if not choices or choices[0].get("finish_reason") is not None:
                        continue
                    c = choices[0]
                    if "delta" in c and (c["delta"].get("role") is not None or c["delta"].get("content") is None):
                        continue
                else:
                    kind = event.get("type")
                    if kind == "error":
                        return {"ok": False, "error": str(event.get("error", {}).get("message"))[:200]}
                    if kind == "done":
                        break
                    if kind != "token":
                        continue
                tokens += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
        return {"ok": ttft is not None, "ttft": ttft, "e2e": time.perf_counter() - t0, "tokens": tokens,
                "error": None if ttft is not None else "no tokens"}
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": f"{exc.__class__.__name__}: {str(exc)[:200]}"}


async def overhead_pass(client, prompts: list[dict], concurrency: int, make) -> list[dict]:
    """Run make(p) -> coroutine for every prompt, `concurrency` at a time, results in prompt order."""
    results: list[dict | None] = [None] * len(prompts)
    nxt = 0

    async def worker() -> None:
        nonlocal nxt
        while nxt < len(prompts):
            i = nxt
            nxt += 1
            results[i] = await make(prompts[i])

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results  # type: ignore[return-value]


async def measure_overhead(args, base_url: str, token: str, node_url: str, node_secret: str, model: str,
                           model_id: str, quantization: str, prompts: list[dict], concurrency: int,
                           rounds: int, node_log: Path | None = None) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.request_timeout, connect=10.0)) as client:
        gw_headers = {"Authorization": f"Bearer {token}", "X-Latency-Class": args.latency_class}
        node_headers = {"X-Node-Secret": node_secret}
        mt = args.overhead_max_tokens

        async def direct(p):
            body = node_body(p, model_id, quantization, args.latency_class, mt)
            return {**await raw_stream(client, node_url + "/v1/generate", body, node_headers, False),
                    "request_id": body["request_id"]}

        async def through(p):
            path, body = gateway_body(p, model, mt)
            rid = "bench-gw-" + uuid.uuid4().hex   # the node sees it as <org>/<rid>
            return {**await raw_stream(client, base_url + path, body, {**gw_headers, "X-Request-Id": rid}, True),
                    "request_id": rid}

        # One unmeasured pass puts every prompt in the node's prefix cache: then both paths find it
        # there alike, and the prefill (whose time varies far more than the gateway's cost) shrinks to
        # the prompt's last partial block on both.
        await overhead_pass(client, prompts, concurrency, direct)
        pairs = []
        for r in range(rounds):          # alternate which path goes first, so drift hits both alike
            if r % 2 == 0:
                d = await overhead_pass(client, prompts, concurrency, direct)
                g = await overhead_pass(client, prompts, concurrency, through)
            else:
                g = await overhead_pass(client, prompts, concurrency, through)
                d = await overhead_pass(client, prompts, concurrency, direct)
            pairs += list(zip(d, g))
    good = [(d, g) for d, g in pairs if d["ok"] and g["ok"]]
    node_side = node_side_diffs(good, node_log) if node_log is not None else None
    return {
        "concurrency": concurrency, "rounds": rounds, "max_tokens": mt,
        "pairs": len(pairs), "pairs_ok": len(good),
        "token_count_mismatches": sum(1 for d, g in good if d["tokens"] != g["tokens"]),
        "errors": [x["error"] for d, g in pairs for x in (d, g) if not x["ok"]][:10],
        "ttft_diff_ms": dist([g["ttft"] - d["ttft"] for d, g in good], 1e3),
        "e2e_diff_ms": dist([g["e2e"] - d["e2e"] for d, g in good], 1e3),
        "direct_ttft_ms": dist([d["ttft"] for d, _ in good], 1e3),
        "gateway_ttft_ms": dist([g["ttft"] for _, g in good], 1e3),
        "direct_e2e_ms": dist([d["e2e"] for d, _ in good], 1e3),
        "gateway_e2e_ms": dist([g["e2e"] for _, g in good], 1e3),
        **({"node_side_diff_ms": node_side} if node_side else {}),
    }


def node_side_diffs(pairs: list[tuple[dict, dict]], node_log: Path) -> dict | None:
    """The node's own timings of each pair (its log at level info: a line per request), gateway minus
    direct: how much of the overhead is the node itself taking longer for the gateway's request."""
    timings: dict[str, dict] = {}
    try:
        with open(node_log, encoding="utf-8", errors="replace") as f:
            for line in f:
                if '"generation"' not in line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                rid = str(rec.get("request_id", ""))
                timings[rid.rpartition("/")[2]] = rec   # the gateway's reach the node as <org>/<id>
    except OSError:
        return None
    both = [(timings[d["request_id"]], timings[g["request_id"]]) for d, g in pairs
            if d["request_id"] in timings and g["request_id"] in timings]
    if not both:
        return None
    return {key: dist([g[key] - d[key] for d, g in both if isinstance(d.get(key), (int, float))
                       and isinstance(g.get(key), (int, float))], 1e3)
            for key in ("queue_s", "prefill_s", "ttft_s", "mean_itl_s")}


# -------------------------------------------------------------------------------- --start: processes

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
        wait_http(node_url + "/health", node, 300)
        gw_env = {**env, "PORT": str(gw_port), "ZEN_NODES": node_url,
                  "GATEWAY_THREADS": str(args.gateway_threads)}
        if args.gateway_workers:
            gw_env["GATEWAY_WORKERS"] = str(args.gateway_workers)
        gateway = Service("gateway", [sys.executable, "-m", "app", "serve"], gw_env, out_dir / "gateway.log")
        services.append(gateway)
        log(f"starting gateway on {gw_url} ...")
        wait_http(gw_url + "/health", gateway, 120, ok=lambda r: r.status_code == 200 and r.json().get("nodes_up", 0) >= 1)
        return services, gw_url, node_url, secret
    except BaseException:
        for s in reversed(services):
            s.stop()
        raise


def stop_stack(services: list[Service]) -> None:
    for s in reversed(services):
        s.stop()


# -------------------------------------------------------------------------------------- reporting

def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "processor": platform.processor()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                            text=True, timeout=10).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=10).stdout.split("\n")
        info["git_uncommitted_changes"] = [line[3:] for line in changed if line.strip()][:50]
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def fmt_ms(d: dict, key: str = "p50") -> str:
    v = d.get(key)
    return "-" if v is None else f"{v * 1e3:8.1f}"


def print_level(name: str, s: dict) -> None:
    log(f"{name:>14} | {s['completed']:4d}/{s['requests']:<4d} err {s['error_rate']:5.1%} | "
        f"{s['requests_per_s']:6.2f} req/s {s['output_tokens_per_s']:8.1f} tok/s | "
        f"TTFT p50/p99 {fmt_ms(s['ttft_s'])}/{fmt_ms(s['ttft_s'], 'p99')} ms | "
        f"ITL p50/p99 {fmt_ms(s['itl_s'])}/{fmt_ms(s['itl_s'], 'p99')} ms | "
        f"E2E p50/p99 {fmt_ms(s['e2e_s'])}/{fmt_ms(s['e2e_s'], 'p99')} ms")


def write_plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, metric, title in ((axes[0], "ttft_s", "time to first token"), (axes[1], "e2e_s", "end-to-end latency")):
        for mode, marker in (("concurrency", "o"), ("poisson", "s")):
            levels = [lv for lv in result["levels"] if lv["mode"] == mode and lv[metric]["n"]]
            if not levels:
                continue
            x = [lv["output_tokens_per_s"] for lv in levels]
            for pct, style in (("p50", "-"), ("p99", "--")):
                ax.plot(x, [lv[metric][pct] for lv in levels], style, marker=marker,
                        label=f"{pct}, {'fixed concurrency' if mode == 'concurrency' else 'Poisson rate'}")
            for lv, xi in zip(levels, x):
                label = f"c={lv['concurrency']}" if mode == "concurrency" else f"{lv['request_rate']:.2g}/s"
                ax.annotate(label, (xi, lv[metric]["p50"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens/s (aggregate)")
        ax.set_ylabel(f"{title} (s)")
        ax.set_title(f"{title} vs throughput")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    meta = result["meta"]
    fig.suptitle(f"zen gateway, {result['config']['model']} on {meta['machine'].get('cpu_count')} CPUs "
                 f"({meta['date'][:10]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------------------------- main

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
                    help="direct/gateway pass pairs per level: the median of a ~2 ms difference between two "
                         "TTFTs that each vary by ~10 ms needs hundreds of pairs (with 256 it still moved by "
                         "about 0.5 ms between runs; the default gives 512)")
    ap.add_argument("--overhead-max-tokens", type=int, default=16)
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
    return args


def level_requests(args, c: int) -> int:
    if args.requests_per_level == -1:                 # --quick
        return {1: 2, 4: 4}.get(c, c)
    return args.requests_per_level or max(12, 4 * c)


async def bench(args, base_url: str, token: str, node_url: str | None, node_secret: str) -> dict:
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

        # Warm-up: every kind and length, excluded from all figures.
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
        result["warmup"] = {"requests": len(recs), "failed": sum(1 for r in recs if not r.ok),
                            "seconds": time.perf_counter() - t,
                            "errors": [r.error for r in recs if not r.ok][:5]}
        log(f"warm-up: {len(recs)} requests in {result['warmup']['seconds']:.1f} s "
            f"({result['warmup']['failed']} failed) -- excluded from the figures")
        if recs and all(not r.ok for r in recs):
            raise SystemExit(f"error: every warm-up request failed: {recs[0].error}")

        for c in concurrency:
            reqs = order.take(level_requests(args, c))
            records, t0, t1 = await run_concurrency(driver, reqs, c, args.level_timeout)
            s = {"mode": "concurrency", "concurrency": c, "request_rate": None, **summarize(records, t0, t1)}
            result["levels"].append(s)
            print_level(f"concurrency {c}", s)

        rates: list[float] = []
        if args.request_rate.startswith("auto"):
            best = max((lv["requests_per_s"] for lv in result["levels"] if lv["completed"]), default=0.0)
            if best > 0:
                fractions = (0.9,) if args.request_rate == "auto-one" else (0.5, 0.9)
                rates = [round(best * f, 3) for f in fractions]
        elif args.request_rate != "none":
            rates = parse_list(args.request_rate, float)
        for j, rate in enumerate(rates):
            reqs = order.take(args.poisson_requests)
            records, t0, t1 = await run_poisson(driver, reqs, rate, args.seed + j, args.level_timeout)
            s = {"mode": "poisson", "concurrency": None, "request_rate": rate, **summarize(records, t0, t1)}
            result["levels"].append(s)
            print_level(f"poisson {rate:g}/s", s)

        if node_url and not args.no_overhead:
            # The node --start started logs each request at level info: then its own timings split the overhead.
            node_log = (Path(args.output).parent / "node.log"
                        if args.start and args.node_log_level.lower() in ("info", "debug") else None)
            over_prompts = [p for p in prompts if p["length"] == "short"]
            rng = random.Random(args.seed + 1000)
            for c in parse_list(args.overhead_concurrency, int):
                sample = [over_prompts[rng.randrange(len(over_prompts))] for _ in range(args.overhead_requests)]
                o = await measure_overhead(args, base_url, token, node_url, node_secret, args.model, model_id,
                                           quant, sample, c, args.overhead_rounds, node_log)
                result["overhead"].append(o)
                d, e = o["ttft_diff_ms"], o["e2e_diff_ms"]
                if d["n"]:
                    log(f"overhead c={c:<3d} | {o['pairs_ok']}/{o['pairs']} pairs | gateway - direct: TTFT "
                        f"p50 {d['p50']:.2f} ms p99 {d['p99']:.2f} ms | E2E p50 {e['p50']:.2f} ms "
                        f"p99 {e['p99']:.2f} ms")
                    if o.get("node_side_diff_ms"):
                        n = o["node_side_diff_ms"]
                        log(f"               | of which at the node (its own timings, p50): queue "
                            f"{n['queue_s']['p50']:.2f} ms, prefill {n['prefill_s']['p50']:.2f} ms, "
                            f"TTFT {n['ttft_s']['p50']:.2f} ms; inter-token {n['mean_itl_s']['p50']:.2f} ms")
                else:
                    log(f"overhead c={c}: no successful pairs: {o['errors'][:2]}")
        result["model"] = {"alias": args.model, "id": model_id, "quantization": quant}
    finally:
        await driver.close()
    return result


def targets(result: dict) -> dict:
    c16 = next((lv for lv in result["levels"] if lv["mode"] == "concurrency" and lv["concurrency"] == 16), None)
    o = next((x for x in result["overhead"] if x["ttft_diff_ms"]["n"]), None)
    out: dict[str, Any] = {"peer_llamacpp_server_c16_tokens_per_s": PEER_C16_TOKENS_PER_S,
                           "target_c16_tokens_per_s": 5 * PEER_C16_TOKENS_PER_S, "target_c16_ttft_p50_s": 1.0,
                           "target_overhead_p50_ms": 2.0}
    if c16:
        out["c16_output_tokens_per_s"] = c16["output_tokens_per_s"]
        out["c16_ttft_p50_s"] = c16["ttft_s"]["p50"]
        out["c16_vs_peer"] = c16["output_tokens_per_s"] / PEER_C16_TOKENS_PER_S
    if o:
        out["overhead_ttft_p50_ms"] = o["ttft_diff_ms"]["p50"]
        out["overhead_e2e_p50_ms"] = o["e2e_diff_ms"]["p50"]
        out["overhead_concurrency"] = o["concurrency"]
    return out


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
    services: list[Service] = []
    env = dict(os.environ)
    load_before = os.getloadavg()
    wall0 = time.time()
    try:
        if args.start:
            services, base_url, node_url, node_secret = start_stack(args, out_path.parent)
        else:
            base_url = (args.base_url or "http://127.0.0.1:8000").rstrip("/")
            nodes = [u for u in os.environ.get("ZEN_NODES", "").split(",") if u.strip()]
            node_url = (args.node_url or (nodes[0] if nodes else "http://127.0.0.1:8001")).rstrip("/")
            node_secret = args.node_secret or os.environ.get("NODE_SECRET") or DEV_NODE_SECRET
            try:
                httpx.get(base_url + "/health", timeout=5.0).raise_for_status()
            except httpx.HTTPError as exc:
                log(f"error: no gateway at {base_url} ({exc.__class__.__name__}); start one (make serve) or "
                    f"run with --start")
                return 2
            if not args.no_overhead:
                try:
                    httpx.get(node_url + "/health", timeout=5.0).raise_for_status()
                except httpx.HTTPError:
                    log(f"note: no engine node at {node_url}: the overhead measurement is skipped "
                        f"(--node-url, --node-secret)")
                    node_url = None
        token = get_token(args, env)
        log(f"benchmarking {base_url} (model {args.model}, latency class {args.latency_class})")
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        result = asyncio.run(bench(args, base_url, token, node_url, node_secret))
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        stop_stack(services)
    result["meta"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "machine": machine_info(),
        "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
        "wall_s": time.time() - wall0,
        "client_cpu_s": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
        "note": "the client shares the machine's cores with the gateway and the node",
    }
    result["config"] = {k: v for k, v in vars(args).items() if k != "token"}
    if args.start:
        result["config"]["stack"] = {"started": True, "gateway_threads_per_worker": args.gateway_threads,
                                     "node_threads": args.node_threads, "kv_cache_bytes": args.kv_cache_bytes}
    result["targets"] = targets(result)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out_path}")
    if not args.no_plot:
        write_plot(result, plot_path)
        log(f"wrote {plot_path}")
    t = result["targets"]
    if "c16_output_tokens_per_s" in t:
        log(f"16 concurrent streams: {t['c16_output_tokens_per_s']:.1f} output tokens/s "
            f"({t['c16_vs_peer']:.1f}x llama.cpp's server), median TTFT {t['c16_ttft_p50_s']:.3f} s")
    if "overhead_ttft_p50_ms" in t:
        log(f"gateway overhead at concurrency {t['overhead_concurrency']}: TTFT p50 "
            f"{t['overhead_ttft_p50_ms']:.2f} ms, end-to-end p50 {t['overhead_e2e_p50_ms']:.2f} ms")
    failed = sum(lv["failed"] for lv in result["levels"])
    return 1 if failed and failed == sum(lv["requests"] for lv in result["levels"]) else 0


if __name__ == "__main__":
    sys.exit(main())
