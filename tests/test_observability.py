"""The shipped observability bundle: deploy/prometheus/ (scrape config, alerting rules) and
deploy/grafana/zen-inference.json.

Fast: promtool accepts the rules and the scrape config (shipped, and as `make observe` rewrites it); the
dashboard loads and every panel queries the Prometheus of its `${datasource}` variable.
Slow: a real gateway and engine node, scraped by a real Prometheus started the way `make observe` starts
it (scripts/local_prometheus.py), serve some traffic; then Prometheus must hold every series that a
dashboard panel or a rule names, and when Redis (the limits store) stops, its alert must go pending.
"""
from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
import redis
import requests
import yaml

from app.limits import STORAGE_FAILURES, StorageHealth
from scripts.local_prometheus import (CONFIG_PATH, DASHBOARD_PATH, GATEWAY_JOB, NODE_JOB, RULES_PATH,
                                      LocalPrometheus, prometheus_binary, prometheus_config)
from tests.node_fixtures import free_port
from tests.serving_fixtures import read_sse, serving_stack, tiny_models, wait_until  # noqa: F401 (fixtures)

# Identifiers of PromQL that are not metric names (functions are told apart by their `(`).
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                   "bool", "offset", "inf", "nan"}
# Node gauges the platform may not expose (engine/node/telemetry.py: absent, never invented), by the key of
# the node's GET /state that says whether it does.
OPTIONAL_NODE_SERIES = {"zen_node_accelerator_power_watts": "power_w",
                        "zen_node_accelerator_temperature_celsius": "temperature_c"}
SCRAPE_INTERVAL = "1s"
# What Grafana puts in place of the dashboard's variables (all values of a multi-value one).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model": ".*", "$latency_class": ".*", "$org": ".*"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)                   # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)                              # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)                             # range durations
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)   # label lists
    names = set()
    for match in re.finditer(r"(?<![\w.$:])([a-zA-Z_:][\w:]*)(\s*\()?", expr):
        name, call = match.groups()
        if not call and name not in PROMQL_KEYWORDS:
            names.add(name)
    return names


def as_grafana_sends_it(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def dashboard() -> dict:
    return json.loads(DASHBOARD_PATH.read_text())


def query_panels(dash: dict) -> list[dict]:
    return [p for p in dash["panels"] if p["type"] != "row"]


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in query_panels(dashboard()) for t in p["targets"]]


def rule_exprs() -> list[str]:
    rules = yaml.safe_load(RULES_PATH.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([prometheus_binary("promtool"), *args], capture_output=True, text=True, timeout=60)


# ---------------------------------------------------------------------------------------------- fast

def test_promtool_accepts_the_rules():
    done = promtool("check", "rules", str(RULES_PATH))
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_accepts_the_shipped_and_the_generated_scrape_config(tmp_path):
    done = promtool("check", "config", str(CONFIG_PATH))
    assert done.returncode == 0, done.stdout + done.stderr
    generated = tmp_path / "prometheus.yml"
    generated.write_text(json.dumps(prometheus_config("127.0.0.1:18000", ["127.0.0.1:18001"], "a-token", "1s")))
    done = promtool("check", "config", str(generated))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_generated_config_scrapes_the_given_targets_with_the_token():
    config = prometheus_config("127.0.0.1:18000", ["127.0.0.1:18001", "127.0.0.1:18002"], "a-token", "1s")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs[GATEWAY_JOB]["static_configs"] == [{"targets": ["127.0.0.1:18000"]}]
    assert jobs[GATEWAY_JOB]["authorization"] == {"type": "Bearer", "credentials": "a-token"}
    assert jobs[NODE_JOB]["static_configs"] == [{"targets": ["127.0.0.1:18001", "127.0.0.1:18002"]}]
    assert config["global"]["scrape_interval"] == "1s" and config["rule_files"] == [str(RULES_PATH)]
    open_gateway = prometheus_config("127.0.0.1:18000", ["127.0.0.1:18001"], "", "1s")
    assert "authorization" not in {j["job_name"]: j for j in open_gateway["scrape_configs"]}[GATEWAY_JOB]


def test_the_dashboard_loads_and_every_panel_queries_the_datasource_variable():
    dash = dashboard()
    assert isinstance(dash["schemaVersion"], int) and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = query_panels(dash)
    assert len(panels) >= 15
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and metric_names(target["expr"]), (panel["title"], target)
            assert "$" not in as_grafana_sends_it(target["expr"]), (panel["title"], target)
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_metric_names_are_read_out_of_promql():
    expr = ('histogram_quantile(0.95, sum by (le, latency_class) (rate(zen_a_bucket{model=~"$model", x="y{z}"}'
            '[$__rate_interval]))) / on (org) group_left sum without (le) (zen_b_total offset 5m) > bool 0.5 '
            'and up{job="zen-node"} == 0')
    assert metric_names(expr) == {"zen_a_bucket", "zen_b_total", "up"}


def counter_value(counter) -> float:
    return next(s.value for s in counter.collect()[0].samples if s.name.endswith("_total"))


def test_a_failed_call_to_the_limits_store_is_counted():
    def down():
        raise redis.ConnectionError("connection refused")

    before = counter_value(STORAGE_FAILURES)
    assert StorageHealth("open", name="Redis").call(lambda backend: backend(), down, lambda: "local") == "local"
    assert counter_value(STORAGE_FAILURES) == before + 1


# ---------------------------------------------------------------------------------------------- slow

def send_traffic(stack) -> None:
    """Chat, completion, a stream, a 4xx and a rate-limited request through the gateway."""
    url, auth = stack.url, stack.auth("loadco")
    chat = {"model": "zen-tiny", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4}
    r = requests.post(url + "/v1/chat/completions", json=chat, headers=auth, timeout=120)
    assert r.status_code == 200, r.text
    r = requests.post(url + "/v1/completions", json={"model": "zen-tiny", "prompt": "Once upon", "max_tokens": 4},
                      headers={**auth, "X-Latency-Class": "realtime"}, timeout=120)
    assert r.status_code == 200, r.text
    with requests.post(url + "/v1/chat/completions", json={**chat, "stream": True}, headers=auth, stream=True,
                       timeout=120) as r:
        assert r.status_code == 200 and read_sse(r)[-1] == "[DONE]"
    r = requests.post(url + "/v1/chat/completions", json={**chat, "model": "no-such-model"}, headers=auth, timeout=30)
    assert r.status_code == 404, r.text
    # Org alpha's tier allows 3 requests a minute (counted in Redis, across the workers): the fourth and
    # fifth are refused before any model work.
    statuses = [requests.get(url + "/v1/models", headers=stack.auth("alpha"), timeout=30).status_code
                for _ in range(5)]
    assert statuses == [200, 200, 200, 429, 429], statuses


@pytest.mark.slow
def test_prometheus_holds_every_series_the_dashboard_and_the_rules_use(serving_stack, tiny_models, tmp_path):
    # A tiny model rather than the default one: the same series, without its load time on a busy CPU.
    stack = serving_stack(nodes=[[tiny_models["a"] + "=tiny-a"]], redis=True, threads=8)
    config = prometheus_config(stack.url.split("//")[1], [n.url.split("//")[1] for n in stack.nodes],
                               stack.gateway.config.server.metrics_token, SCRAPE_INTERVAL)
    prometheus = LocalPrometheus(tmp_path / "prometheus", free_port(), config).start()
    try:
        wait_until(lambda: prometheus.scrapes_done() == {GATEWAY_JOB: 1, NODE_JOB: 1}, 30,
                   "both targets up (the gateway scraped with its metrics token)")
        send_traffic(stack)
        state = stack.node_state()
        names = set().union(*map(metric_names, dashboard_exprs() + rule_exprs()))

        def unexplained() -> set[str]:
            missing = {name for name in names if not prometheus.series(name)}
            return {name for name in missing if state.get(OPTIONAL_NODE_SERIES.get(name, ""), 0) is not None}
        deadline = time.monotonic() + 30
        while unexplained() and time.monotonic() < deadline:    # the scrapes after the last request
            time.sleep(0.5)
        missing = unexplained()
        assert not missing, (f"Prometheus holds no series for {sorted(missing)}; "
                             f"it has {sorted(prometheus.api('label/__name__/values'))}")
        for expr in dashboard_exprs():   # each query is valid PromQL once Grafana fills in its variables
            prometheus.api("query", query=as_grafana_sends_it(expr))
        # The rules loaded, and none fires on a healthy stack.
        groups = prometheus.api("rules")["groups"]
        assert sum(len(g["rules"]) for g in groups) == len(rule_exprs())
        assert not [a for a in prometheus.api("alerts")["alerts"] if a["state"] == "firing"]
        # Redis goes away: the next request's failed call to it is counted, and its alert becomes pending.
        stack.redis.stop()
        requests.get(stack.url + "/v1/models", headers=stack.auth("loadco"), timeout=30)
        wait_until(lambda: any(a["labels"]["alertname"] == "ZenLimitsStoreDown"
                               for a in prometheus.api("alerts")["alerts"]), 30, "the limits-store alert")
    finally:
        prometheus.stop()
        print(prometheus.log()[-3000:])
