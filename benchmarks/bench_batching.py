"""Engine-level benchmark: continuous batching and prefix caching on the default model.

    python benchmarks/bench_batching.py [--model PATH] [--concurrency 1,4,16,64] [--tokens 64]
                                        [--out bench-results/batching.json]

For each concurrency C, C requests (a short chat prompt each, ignore_eos, the same number of output
tokens) are added at once and the engine is stepped until all finish: aggregate decode tokens/s
(generated tokens / time from the first to the last token), TTFT and inter-token latency
percentiles over all requests. Then the prefix cache: requests that share a ~400-token system prompt,
one after another, TTFT with prefix caching on and off (a fresh engine each).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_engine import machine_info  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.request import EngineRequest  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.scheduler import SchedulerConfig  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "weights" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TOPICS = ["the ocean", "a city at night", "bread", "the moon", "trains", "autumn", "a library", "rivers"]


def make_engine(model: str, prefix_caching: bool = True, max_num_seqs: int = 64) -> Engine:
    return Engine(EngineConfig(model=model, backend="cpu", kv_cache_bytes=2 << 30,
                               enable_prefix_caching=prefix_caching,
                               scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512)))


def run_requests(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list:
    """Add all, step to completion; returns the finished sequences' timestamps."""
    ids = []
    for i, p in enumerate(prompts):
        rid = f"bench-{time.monotonic_ns()}-{i}"
        engine.add_request(EngineRequest(rid, engine.model_id, p, SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
        ids.append(rid)
    seqs = [s for rid in ids for s in engine._requests[rid]]
    while engine.has_unfinished():
        engine.step()
    return [s.times for s in seqs]


def pct(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def bench_concurrency(engine: Engine, concurrency: int, max_tokens: int) -> dict:
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"Write a short poem about {TOPICS[i % len(TOPICS)]} (#{i})."}]),
        add_special_tokens=False) for i in range(concurrency)]
    times = run_requests(engine, prompts, max_tokens)
    first = min(t.first_token for t in times)
    last = max(t.token_times[-1] for t in times)
    generated = sum(len(t.token_times) for t in times)
    ttft = [t.first_token - t.arrival for t in times]
    itl = [b - a for t in times for a, b in zip(t.token_times, t.token_times[1:])]
    return {
        "concurrency": concurrency, "requests": concurrency, "prompt_tokens_mean": float(np.mean([len(p) for p in prompts])),
        "output_tokens_per_request": max_tokens,
        "decode_tokens_per_s": (generated - concurrency) / (last - first) if last > first else float("nan"),
        "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50), "itl_p90_s": pct(itl, 90), "itl_p99_s": pct(itl, 99),
    }


def bench_prefix_cache(model: str, requests: int = 6) -> dict:
    system = ("You are a meticulous assistant for a railway company. " * 40).strip()
    out = {}
    for caching in (False, True):
        engine = make_engine(model, prefix_caching=caching)
        tok = engine.tokenizer
        ttfts = []
        for i in range(requests):
            ids = tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                                      {"role": "user", "content": f"Question {i}: when is the next train?"}]),
                             add_special_tokens=False)
            t = run_requests(engine, [ids], 1)[0]
            ttfts.append(t.first_token - t.arrival)
        out["prompt_tokens"] = len(ids)
        # the first request fills the cache; the rest can hit it
        out["ttft_on" if caching else "ttft_off"] = float(np.median(ttfts[1:]))
        if caching:
            out["prefix_hit_tokens"] = engine.pool.prefix_hit_tokens
    out["speedup"] = out["ttft_off"] / out["ttft_on"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "batching.json"))
    args = ap.parse_args(argv)
    engine = make_engine(args.model)
    run_requests(engine, [[1, 2, 3, 4]] * 4, 4)  # warm-up
    rows = [bench_concurrency(engine, int(c), args.tokens) for c in args.concurrency.split(",")]
    prefix = bench_prefix_cache(args.model)

    print(f"{'concurrency':>11} {'decode tok/s':>13} {'TTFT p50':>9} {'TTFT p90':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p90':>8} {'ITL p99':>8}")
    for r in rows:
        print(f"{r['concurrency']:>11} {r['decode_tokens_per_s']:>13.1f} {r['ttft_p50_s']:>8.3f}s {r['ttft_p90_s']:>8.3f}s "
              f"{r['ttft_p99_s']:>8.3f}s {r['itl_p50_s'] * 1e3:>6.1f}ms {r['itl_p90_s'] * 1e3:>6.1f}ms "
              f"{r['itl_p99_s'] * 1e3:>6.1f}ms")
    print(f"prefix cache, {prefix['prompt_tokens']}-token prompts sharing a system prompt: TTFT "
          f"{prefix['ttft_off'] * 1e3:.0f} ms without, {prefix['ttft_on'] * 1e3:.0f} ms with "
          f"({prefix['speedup']:.1f}x)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "model": args.model, "concurrency": rows,
                               "prefix_cache": prefix}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
