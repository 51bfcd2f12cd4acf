"""What one admission costs in the limiters, per store: the org's requests-per-minute hit, the read of its
window for the response headers, and the token bucket's reserve and settle, as the gateway does them for
every generation (app/limits.py's RequestLimiter and TokenLimiter, called straight, no HTTP).

Stores: `memory://` (each process alone) and `embedded://` (the LMDB file shared by a gateway's
workers, in /dev/shm where it exists). Cases: an empty window; a window that already holds most of an
enterprise tier's 3000 requests a minute; and the embedded store hit by several processes at once (the
gateway's workers), each timing its own admissions. Prints a table of medians and p99 in microseconds and
writes the JSON (bench-results/limits.json).

    python benchmarks/bench_limits.py [--admissions 3000] [--processes 2]
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.config import LimitsConfig, TierConfig  # noqa: E402
from app.limit_store import LimitStore, new_limits_dir  # noqa: E402
from app.limits import RequestLimiter, StorageHealth, TokenLimiter  # noqa: E402
from benchmarks.serving_report import machine_info  # noqa: E402
from benchmarks.serving_stats import dist  # noqa: E402

WARMUP = 200
STORES = ("memory://", "embedded://")


def time_admissions(storage_url: str, directory: str | None, admissions: int, rpm: int, prefill: int,
                    org: str = "acme") -> list[float]:
    """Seconds per admission (hit + window read + reserve + settle) for `admissions` admissions after
    `prefill` hits already in the org's window."""
    config = LimitsConfig(storage_url=storage_url)
    health = StorageHealth("closed", name="embedded" if config.uses_embedded else "Redis")
    store = LimitStore(directory) if config.uses_embedded else None
    requests, tokens = RequestLimiter(config, health, store), TokenLimiter(config, health, store)
    tier = TierConfig("bench", rpm, 1e9, 10**12, ("zen-small",))
    for _ in range(prefill):
        requests.hit(org, tier)
    out = []
    for i in range(WARMUP + admissions):
        start = time.perf_counter()
        requests.hit(org, tier).headers()
        reservation = tokens.reserve(org, tier, 600)
        tokens.settle(reservation, 200)
        if i >= WARMUP:
            out.append(time.perf_counter() - start)
    if store is not None:
        store.close()
    return out


def _worker(args, results) -> None:
    results.put(time_admissions(*args))


def time_in_processes(storage_url: str, directory: str | None, admissions: int, processes: int) -> list[float]:
    """Every process's admissions on one org at once (as a gateway's workers under load)."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    rpm = 10 * processes * (WARMUP + admissions)          # all admitted: the window is not the subject
    procs = [ctx.Process(target=_worker, args=((storage_url, directory, admissions, rpm, 0), results))
             for _ in range(processes)]
    for p in procs:
        p.start()
    out = [t for _ in procs for t in results.get(timeout=600)]
    for p in procs:
        p.join(60)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--admissions", type=int, default=3000, help="timed admissions per case (and process)")
    ap.add_argument("--processes", type=int, default=2, help="processes at once in the contended case")
    ap.add_argument("--output", default=str(ROOT / "bench-results" / "limits.json"))
    args = ap.parse_args(argv)
    cases = []
    for storage_url in STORES:
        plans = [("empty window", lambda d: time_admissions(storage_url, d, args.admissions, 10**9, 0)),
                 ("window of 2900 / 3000", lambda d: time_admissions(storage_url, d, args.admissions,
                                                                    2900 + WARMUP + args.admissions, 2900)),
                 (f"{args.processes} processes at once",
                  lambda d: time_in_processes(storage_url, d, args.admissions, args.processes))]
        for name, run in plans:
            directory = new_limits_dir() if storage_url == "embedded://" else None
            try:
                stats = dist(run(directory), scale=1e6)
            finally:
                if directory:
                    shutil.rmtree(directory, ignore_errors=True)
            cases.append({"store": storage_url, "case": name, "admission_us": stats})
    print(f"{'store':<13} {'case':<24} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8}")
    for c in cases:
        s = c["admission_us"]
        print(f"{c['store']:<13} {c['case']:<24} {s['p50']:8.1f} {s['p90']:8.1f} {s['p99']:8.1f}")
    result = {"benchmark": "limits admission (hit + window read + reserve + settle)",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "argv": sys.argv[1:], "machine": machine_info(), "cases": cases}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"written: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
