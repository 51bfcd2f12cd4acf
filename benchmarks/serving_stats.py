"""What one benchmark request measured, and the statistics of a level (vLLM benchmark_serving's figures)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def dist(values: list[float], scale: float = 1.0) -> dict:
    """mean/p50/p90/p99/min/max of `values` (times `scale`), with the count; None fields if empty."""
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "min": None, "max": None}
    a = np.asarray(values, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "min": float(a.min()), "max": float(a.max())}


def median_interval(values: list[float], scale: float = 1.0, level: float = 0.95, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float] | None:
    """A bootstrap confidence interval of the median of `values` (times `scale`): how far another run's
    median of as many samples from the same spread may land; None if empty."""
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64) * scale
    draws = np.random.default_rng(seed).integers(0, a.size, size=(resamples, a.size))
    medians = np.median(a[draws], axis=1)
    lo, hi = np.percentile(medians, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


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
