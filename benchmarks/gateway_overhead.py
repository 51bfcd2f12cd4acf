"""The gateway's overhead: the same requests straight to the node and through the gateway, paired, with
one raw HTTP client on both paths (how it is measured: the docstring of bench_serving.py)."""
from __future__ import annotations

import asyncio
import functools
import itertools
import json
import time
import uuid
from pathlib import Path

from benchmarks.http_client import httpx
from benchmarks.serving_stats import dist, median_interval


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


class Paths:
    """One request of a prompt straight to the node (`direct`) or through a gateway (`through`), on one
    raw client."""

    def __init__(self, client, args, token: str, node_url: str, node_secret: str, model: str, model_id: str,
                 quantization: str) -> None:
        self.client, self.args, self.node_url, self.model = client, args, node_url, model
        self.model_id, self.quantization = model_id, quantization
        self.gw_headers = {"Authorization": f"Bearer {token}", "X-Latency-Class": args.latency_class}
        self.node_headers = {"X-Node-Secret": node_secret}

    async def direct(self, p: dict) -> dict:
        body = node_body(p, self.model_id, self.quantization, self.args.latency_class, self.args.overhead_max_tokens)
        return {**await raw_stream(self.client, self.node_url + "/v1/generate", body, self.node_headers, False),
                "request_id": body["request_id"]}

    async def through(self, base_url: str, p: dict) -> dict:
        path, body = gateway_body(p, self.model, self.args.overhead_max_tokens)
        rid = "bench-gw-" + uuid.uuid4().hex   # the node sees it as <org>/<rid>
        return {**await raw_stream(self.client, base_url + path, body, {**self.gw_headers, "X-Request-Id": rid},
                                   True), "request_id": rid}


async def measure_overhead(args, base_url: str, token: str, node_url: str, node_secret: str, model: str,
                           model_id: str, quantization: str, prompts: list[dict], concurrency: int,
                           rounds: int, node_log: Path | None = None) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.request_timeout, connect=10.0)) as client:
        paths = Paths(client, args, token, node_url, node_secret, model, model_id, quantization)
        mt = args.overhead_max_tokens
        direct, through = paths.direct, functools.partial(paths.through, base_url)

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
    ttft_diffs = [g["ttft"] - d["ttft"] for d, g in good]
    node_side = node_side_diffs(good, node_log) if node_log is not None else None
    return {
        "concurrency": concurrency, "rounds": rounds, "max_tokens": mt,
        "pairs": len(pairs), "pairs_ok": len(good),
        "token_count_mismatches": sum(1 for d, g in good if d["tokens"] != g["tokens"]),
        "errors": [x["error"] for d, g in pairs for x in (d, g) if not x["ok"]][:10],
        "ttft_diff_ms": dist(ttft_diffs, 1e3),
        # each pair's difference spreads over tens of ms: its median is known to within this
        "ttft_diff_p50_ci95_ms": median_interval(ttft_diffs, 1e3),
        "e2e_diff_ms": dist([g["e2e"] - d["e2e"] for d, g in good], 1e3),
        "direct_ttft_ms": dist([d["ttft"] for d, _ in good], 1e3),
        "gateway_ttft_ms": dist([g["ttft"] for _, g in good], 1e3),
        "direct_e2e_ms": dist([d["e2e"] for d, _ in good], 1e3),
        "gateway_e2e_ms": dist([g["e2e"] for _, g in good], 1e3),
        **({"node_side_diff_ms": node_side} if node_side else {}),
    }


async def compare_gateways(args, this_url: str, other_url: str, token: str, node_url: str, node_secret: str,
                           model: str, model_id: str, quantization: str, prompts: list[dict]) -> dict:
    """Two gateways' overheads in one run, at concurrency 1, request by request: each prompt straight to
    the node and through both gateways, in each of the six orders in turn (so that each path follows
    each other path as often: what a gateway still does after its answer lands on the next request).
    Within a pass the machine drifts by more than a gateway change is worth; interleaved this way, the
    drift hits every path alike, and the per-prompt difference between the gateways measures the change."""
    urls = {"this": this_url, "other": other_url}
    orders = list(itertools.permutations(["direct", "this", "other"]))
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=10.0)) as client:
        paths = Paths(client, args, token, node_url, node_secret, model, model_id, quantization)

        async def request(path: str, p: dict) -> dict:
            return await (paths.direct(p) if path == "direct" else paths.through(urls[path], p))

        # unmeasured: every prompt into the node's prefix cache, and a few requests through each gateway
        for i, p in enumerate(prompts):
            for path in (("direct", "this", "other") if i < WARM_UP_THROUGH else ("direct",)):
                await request(path, p)
        rows, errors, mismatches = [], [], 0
        for i, p in enumerate(prompts):
            got = {path: await request(path, p) for path in orders[i % len(orders)]}
            if all(r["ok"] for r in got.values()):
                rows.append({path: r["ttft"] for path, r in got.items()})
                mismatches += len({r["tokens"] for r in got.values()}) > 1
            else:
                errors += [f"{path}: {r['error']}" for path, r in got.items() if not r["ok"]]
    return {"gateways": urls, "requests": len(prompts), "complete": len(rows), "errors": errors[:10],
            "token_count_mismatches": mismatches,
            "overhead_ms": {n: dist([r[n] - r["direct"] for r in rows], 1e3) for n in urls},
            "direct_ttft_ms": dist([r["direct"] for r in rows], 1e3),
            "this_minus_other_ms": dist([r["this"] - r["other"] for r in rows], 1e3)}


WARM_UP_THROUGH = 8   # prompts also sent, unmeasured, through each gateway before the comparison


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
