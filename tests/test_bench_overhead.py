"""The overhead comparison of two gateways (benchmarks/gateway_overhead.py, `bench_serving.py
--compare-base-url`) against the stand-in node and two gateways served over HTTP in threads."""
from __future__ import annotations

import asyncio
import threading
import time
from argparse import Namespace

import numpy as np
import pytest
from werkzeug.serving import make_server

from app import close_app, create_app
from app.devtoken import mint_token
from benchmarks.gateway_overhead import compare_gateways
from benchmarks.serving_stats import median_interval
from tests.test_gateway_support import MODEL_ID, NODE_SECRET, free_port, make_config, node  # noqa: F401


def slow(app, seconds: float):
    """The app, answering `seconds` later."""
    def wsgi(environ, start_response):
        time.sleep(seconds)
        return app(environ, start_response)
    return wsgi


@pytest.fixture
def two_gateways(node):  # noqa: F811
    """(config, the gateway answering 50 ms late, the other one)."""
    cfg = make_config([node.url])
    served = []
    for delay in (0.05, 0.0):
        app = create_app(cfg)
        server = make_server("127.0.0.1", free_port(), slow(app, delay) if delay else app, threaded=True)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        served.append((app, server))
    yield cfg, [f"http://127.0.0.1:{server.server_port}" for _, server in served]
    for app, server in served:
        server.shutdown()
        server.server_close()
        close_app(app)


def test_every_prompt_goes_every_way_in_every_order(node, two_gateways):  # noqa: F811
    cfg, (slow_url, other_url) = two_gateways
    prompts = [{"kind": "chat", "messages": [{"role": "user", "content": f"hello {i}"}]} if i % 2 else
               {"kind": "completion", "prompt": f"once {i}"} for i in range(6)]
    args = Namespace(request_timeout=20.0, latency_class="standard", overhead_max_tokens=3)
    out = asyncio.run(compare_gateways(args, slow_url, other_url, mint_token(cfg, "acme"), node.url,
                                       NODE_SECRET, "zen-small", MODEL_ID, "q4_1", prompts))
    assert out["complete"] == 6 and out["errors"] == [] and out["token_count_mismatches"] == 0
    assert out["overhead_ms"]["this"]["n"] == out["overhead_ms"]["other"]["n"] == 6
    assert out["this_minus_other_ms"]["p50"] > 40          # "this" is the gateway that answers 50 ms late
    assert out["overhead_ms"]["this"]["p50"] > 40
    # unmeasured first: each prompt through every path (fewer prompts than WARM_UP_THROUGH); then each
    # prompt every way, the direct request first, second or third as the six orders come round
    received = node.received
    assert len(received) == 2 * 3 * 6
    measured = received[18:]
    direct_at = [[r["org"] for r in measured[3 * i:3 * i + 3]].index("bench") for i in range(6)]
    assert direct_at == [0, 0, 1, 2, 1, 2]


def test_the_median_interval_holds_the_median_and_narrows_with_more_samples():
    rng = np.random.default_rng(1)
    few, many = rng.normal(2.0, 6.0, 128), rng.normal(2.0, 6.0, 2048)
    lo, hi = median_interval(list(few))
    assert lo < float(np.median(few)) < hi
    # the median's standard error is 1.2533 sigma / sqrt(n) for a normal spread: 95% is about +-1.96 of it
    assert hi - lo == pytest.approx(2 * 1.96 * 1.2533 * 6.0 / np.sqrt(few.size), rel=0.35)
    lo2, hi2 = median_interval(list(many), scale=1e3)
    assert lo2 < 1e3 * float(np.median(many)) < hi2 and (hi2 - lo2) < 1e3 * (hi - lo) / 2.5
    assert median_interval([]) is None
