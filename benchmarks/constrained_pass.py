"""The constrained pass of `make bench`: JSON-schema-constrained decoding against the same requests
unconstrained, through the gateway.

  * throughput: the same prompts at --constrained-concurrency (16) streams, in alternating
    unconstrained and constrained passes (--constrained-rounds pairs, which goes first alternates), each
    request generating exactly its max_tokens (ignore_eos, and a schema whose shortest document is
    longer than that: the grammar never completes first); reported: output tokens/s of each, their
    ratio, and each round's own ratio (its passes ran back to back) with their median (target >= 0.85);
  * time to first token of a schema seen before: one request at a time, the same prompt unconstrained
    then constrained, --constrained-ttft-pairs pairs after a request that compiled the schema;
    reported: p50/p90 of the per-pair difference (target <= 20 ms).
"""
from __future__ import annotations

from statistics import mean, median

from benchmarks.serving_report import log
from benchmarks.serving_stats import dist, summarize
from benchmarks.serving_workload import OpenAIDriver, run_concurrency

TARGET_RATIO = 0.85
TARGET_TTFT_DIFF_MS = 20.0
# A list of orders: nested objects, arrays, enums, bounded strings; at least 50 items, so no max_tokens
# of a benchmark lets the grammar complete before the request's length.
ORDERS_SCHEMA = {
    "type": "array", "minItems": 50,
    "items": {"type": "object", "additionalProperties": False, "required": ["id", "customer", "status", "lines"],
              "properties": {
                  "id": {"type": "integer", "minimum": 0},
                  "customer": {"type": "object", "additionalProperties": False, "required": ["name", "vip"],
                               "properties": {"name": {"type": "string", "maxLength": 16},
                                              "vip": {"type": "boolean"}}},
                  "status": {"enum": ["new", "paid", "shipped", "returned"]},
                  "lines": {"type": "array", "maxItems": 4,
                            "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                                      "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                                     "qty": {"type": "integer", "minimum": 1, "maximum": 99}}}}}},
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "orders", "schema": ORDERS_SCHEMA, "strict": True}}


def _drivers(args, base_url: str, token: str, concurrency: int) -> tuple[OpenAIDriver, OpenAIDriver]:
    max_tokens = args.max_tokens or 64
    make = lambda extra: OpenAIDriver(base_url, token, args.model, args.latency_class, concurrency + 4,  # noqa: E731
                                      args.request_timeout, max_tokens, extra)
    return make(None), make({"response_format": RESPONSE_FORMAT})


async def measure_constrained(args, base_url: str, token: str, prompts: list[dict]) -> dict:
    c = args.constrained_concurrency
    plain, constrained = _drivers(args, base_url, token, c)
    short = [p for p in prompts if p["length"] == "short"] or prompts
    reqs = [short[i % len(short)] for i in range(args.constrained_requests)]
    out: dict = {"concurrency": c, "requests_per_pass": len(reqs), "max_tokens": args.max_tokens or 64,
                 "schema": "benchmarks/constrained_pass.py ORDERS_SCHEMA", "passes": []}
    try:
        warm = await constrained.run(reqs[0])          # compiles the schema: cached from now on
        if not warm.ok:
            raise SystemExit(f"error: the constrained warm-up request failed: {warm.error}")
        await run_concurrency(plain, reqs[:c], c, args.level_timeout)   # unmeasured: batches of c, warm
        rates: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
        for r in range(args.constrained_rounds):
            order = [("unconstrained", plain), ("constrained", constrained)]
            for name, driver in (order if r % 2 == 0 else order[::-1]):
                records, t0, t1 = await run_concurrency(driver, reqs, c, args.level_timeout)
                s = summarize(records, t0, t1)
                rates[name].append(s["output_tokens_per_s"])
                out["passes"].append({"kind": name, "round": r, **s})
                log(f"constrained pass c={c} {name:<13s} | {s['completed']}/{s['requests']} ok | "
                    f"{s['output_tokens_per_s']:.1f} output tokens/s | TTFT p50 {s['ttft_s']['p50']:.3f} s")
        diffs = []
        for i in range(args.constrained_ttft_pairs):
            p = short[i % len(short)]
            a, b = await plain.run(p), await constrained.run(p)
            if a.ok and b.ok:
                diffs.append((b.ttft - a.ttft) * 1e3)
    finally:
        await plain.close()
        await constrained.close()
    tps_plain, tps_cons = mean(rates["unconstrained"]), mean(rates["constrained"])
    # each round's own ratio: its two passes ran back to back, under much the same load
    rounds = [c_ / u for u, c_ in zip(rates["unconstrained"], rates["constrained"]) if u]
    out.update(unconstrained_tokens_per_s=tps_plain, constrained_tokens_per_s=tps_cons,
               ratio=tps_cons / tps_plain if tps_plain else 0.0, round_ratios=rounds,
               round_ratio_median=median(rounds) if rounds else 0.0, target_ratio=TARGET_RATIO,
               ttft_diff_ms=dist(diffs), target_ttft_diff_ms=TARGET_TTFT_DIFF_MS)
    d = out["ttft_diff_ms"]
    if not d["n"]:
        log("constrained pass: no successful TTFT pairs")
        return out
    log(f"constrained / unconstrained tokens/s at {c} streams: {out['ratio']:.3f} (per round: "
        f"{', '.join(f'{x:.3f}' for x in rounds)}; target >= {TARGET_RATIO}); "
        f"TTFT of a cached schema - unconstrained: p50 {d['p50']:.2f} ms, p90 {d['p90']:.2f} ms over "
        f"{d['n']} pairs (target <= {TARGET_TTFT_DIFF_MS:g} ms)")
    return out
