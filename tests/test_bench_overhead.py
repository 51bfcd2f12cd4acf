"""The overhead comparison of two gateways (benchmarks/gateway_overhead.py, `bench_serving.py
--compare-base-url`) against the stand-in node and two gateways served over HTTP in threads."""
from __future__ import annotations

import asyncio
import threading
from argparse import Namespace

import pytest
from werkzeug.serving import make_server

from app import close_app, create_app
from app.devtoken import mint_token
from benchmarks.gateway_overhead import compare_gateways
from tests.test_gateway_support import MODEL_ID, NODE_SECRET, free_port, make_config, node  # noqa: F401


@pytest.fixture
def two_gateways(node):  # noqa: F811
    cfg = make_config([node.url])
    served = []
    for _ in range(2):
        app = create_app(cfg)
        server = make_server("127.0.0.1", free_port(), app, threaded=True)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        served.append((app, server))
    yield cfg, [f"http://127.0.0.1:{server.server_port}" for _, server in served]
    for app, server in served:
        server.shutdown()
        close_app(app)


def test_every_prompt_goes_every_way_in_a_rotating_order(node, two_gateways):  # noqa: F811
    cfg, (a, b) = two_gateways
    prompts = [{"kind": "chat", "messages": [{"role": "user", "content": f"hello {i}"}]} if i % 2 else
               {"kind": "completion", "prompt": f"once {i}"} for i in range(6)]
    args = Namespace(request_timeout=20.0, latency_class="standard", overhead_max_tokens=3)
    out = asyncio.run(compare_gateways(args, {"other": a, "this": b}, mint_token(cfg, "acme"), node.url,
                                       NODE_SECRET, "zen-small", MODEL_ID, "q4_1", prompts))
    assert out["complete"] == 6 and out["errors"] == []
    assert out["overhead_ms"]["this"]["n"] == out["overhead_ms"]["other"]["n"] == 6
    assert out["this_minus_other_ms"]["n"] == 6 and out["direct_ttft_ms"]["n"] == 6
    # a warm-up request per prompt, then each prompt straight, through `other` and through `this`
    received = node.received
    assert len(received) == 4 * 6
    measured = received[6:]
    firsts = [measured[3 * i]["org"] for i in range(6)]
    assert firsts == ["bench", "acme", "acme"] * 2          # direct first, then each gateway in turn
    assert all(r["org"] == "bench" for r in received[:6])
    assert sorted(r["org"] for r in measured[:3]) == ["acme", "acme", "bench"]
