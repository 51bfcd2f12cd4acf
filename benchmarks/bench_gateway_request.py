"""One request's cost in the gateway process: Flask's test client posts chat completions against the
stand-in node of the gateway tests (scripts/stand_in_node.py, in this process, over loopback HTTP), and
the median wall time of a request and the median CPU time of the requesting thread (the gateway's own
work: the view runs in it; the stand-in's threads are not counted, so the figure holds on a busy
machine) are printed. No gunicorn, no client socket: what is left is the gateway's own Python (auth,
limits, validation, routing, forwarding, the answer) plus the stand-in's short reply.

    python benchmarks/bench_gateway_request.py [--requests 2000] [--stream] [--tracing off|memory]

`--tracing memory` turns tracing on with the SDK's in-memory exporter (an endpoint is configured, the
spans stay in memory), to see what tracing costs when it is on. docs/tracing.md has the figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app import close_app, create_app  # noqa: E402
from scripts.stand_in_node import StandInNode, bearer, make_config  # noqa: E402


def measure(requests: int, stream: bool, tracing: str) -> dict:
    node = StandInNode().start()
    sections = {"limits": {"storage_url": "memory://"},
                "tiers": {"pro": {"requests_per_minute": 10_000_000, "tokens_per_second": 1e9}}}
    if tracing == "memory":
        sections["tracing"] = {"endpoint": "http://127.0.0.1:9/v1/traces"}
    config = make_config([node.url], **sections)
    app = create_app(config)
    if tracing == "memory":
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        app.extensions["zen.tracing"].exporter = InMemorySpanExporter()
    client = app.test_client()
    headers = {**bearer(config), "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    body = {"model": "zen-small", "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 4, "stream": stream}
    try:
        for _ in range(50):   # warm: connections, caches, the first token verification
            client.post("/v1/chat/completions", json=body, headers=headers).close()
        times, cpu = [], []
        for _ in range(requests):
            t0, c0 = time.perf_counter(), time.thread_time()
            r = client.post("/v1/chat/completions", json=body, headers=headers)
            r.get_data()
            r.close()   # as the server does: the stream's bookkeeping, and its node connection back to the pool
            cpu.append(time.thread_time() - c0)
            times.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.get_data()
    finally:
        close_app(app)
        node.stop()
    times.sort()
    return {"requests": requests, "stream": stream, "tracing": tracing,
            "cpu_median_ms": round(statistics.median(cpu) * 1e3, 4),
            "wall_median_ms": round(statistics.median(times) * 1e3, 4),
            "wall_p90_ms": round(times[int(0.9 * len(times))] * 1e3, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--tracing", choices=("off", "memory"), default="off")
    args = ap.parse_args()
    print(json.dumps(measure(args.requests, args.stream, args.tracing)))


if __name__ == "__main__":
    main()
