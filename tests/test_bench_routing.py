"""The routing benchmark's pure parts: the trace is deterministic and mixes what the issue asks for, and the
figures are computed from the nodes' counters as they are exposed."""
from __future__ import annotations

from app.prefix_index import canonical_prompt
from benchmarks.bench_routing import counters_from_metrics, summarize, targets
from benchmarks.routing_trace import build_trace, models_of

METRICS = """# TYPE zen_node_model_loads counter
zen_node_model_loads_total{model="M",quantization="q4_1"} 2.0
zen_node_model_loads_total{model="M",quantization="f16"} 1.0
# TYPE zen_node_model_evictions counter
zen_node_model_evictions_total{model="M",quantization="q4_1"} 1.0
# TYPE zen_node_prefix_cache_queries counter
zen_node_prefix_cache_queries_total{model="M",quantization="q4_1"} 800.0
zen_node_prefix_cache_queries_total{model="M",quantization="f16"} 200.0
# TYPE zen_node_prefix_cache_hits counter
zen_node_prefix_cache_hits_total{model="M",quantization="q4_1"} 500.0
"""


def test_trace_is_deterministic_and_mixes_models_prefixes_and_classes():
    trace = build_trace(40, 0.25, seed=3)
    assert trace == build_trace(40, 0.25, seed=3) and trace != build_trace(40, 0.25, seed=4)
    assert len(models_of(trace)) >= 3
    assert {r.latency_class for r in trace} == {"realtime", "standard", "batch"}
    assert all(a.at_s < b.at_s for a, b in zip(trace, trace[1:]))
    by_app: dict[str, list] = {}
    for r in trace:
        by_app.setdefault(r.app, []).append(r)
    shared = [rs for app, rs in by_app.items() if not app.startswith("chat") and len(rs) > 1]
    assert shared and all(rs[0].messages[0] == rs[1].messages[0] for rs in shared)
    assert all(len(rs[0].messages[0][1]) > 1500 for rs in shared)          # ~400 tokens of system prompt
    turns = [rs for app, rs in by_app.items() if app.startswith("chat") and len(rs) > 1]
    assert turns
    for rs in turns:   # each turn's prompt starts with the one before it
        texts = [canonical_prompt(messages=[{"role": role, "content": c} for role, c in r.messages]) for r in rs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_figures_come_from_the_nodes_counters():
    node = counters_from_metrics(METRICS)
    assert node["loads"] == {"M/q4_1": 2, "M/f16": 1} and node["evictions"] == {"M/q4_1": 1}
    assert node["prefix_query_tokens"] == 1000 and node["prefix_hit_tokens"] == 500
    other = counters_from_metrics(METRICS.replace("2.0", "1.0"))
    records = [{"ok": True, "latency_class": "realtime", "ttft_s": 0.1 * i, "output_tokens": 8, "error": None}
               for i in range(1, 5)] + [{"ok": False, "latency_class": "batch", "ttft_s": None,
                                         "output_tokens": 0, "error": "HTTP 503"}]
    s = summarize(records, 10.0, [node, other])
    assert s["cold_loads"] == 5 and s["model_node_pairs_loaded"] == 4
    assert s["reloads_after_eviction"] == 1 and s["copies_beyond_first_node"] == 2
    assert s["prefix_cache_hit_rate"] == 0.5 and s["completed"] == 4 and s["failed"] == 1
    assert s["ttft_s"]["realtime"]["n"] == 4 and s["ttft_s"]["batch"]["n"] == 0
    rr = dict(s, prefix_cache_hit_rate=0.2, ttft_s={**s["ttft_s"], "realtime": {"p99": 9.0}})
    goals = targets([dict(s, policy="score"), dict(rr, policy="round_robin")])
    assert goals["hit_rate_at_least_2x"] and goals["realtime_ttft_p99_lower"]
    assert goals["score_no_reloads"] is False
