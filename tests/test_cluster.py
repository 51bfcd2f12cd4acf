"""`make serve-cluster`'s cluster (scripts/cluster.py: redis-server, three engine nodes, two gateway
replicas with two gunicorn workers each), started for real on loopback. The nodes serve the tests' tiny
model (three default models load too slowly for a test on a 2-core machine); the gateways run the
serving tests' configuration plus a tier of RPM requests per minute.

  * the per-org request limit holds across both replicas: they count in the same Redis;
  * concurrent requests land on more than one node (each node's request counter on /metrics): each node
    runs two at a time, so requests queued on one node show in the router's latency estimate;
  * a node killed with SIGKILL is skipped: every later request succeeds on the two left.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import requests

from app.config import load_config
from app.devtoken import mint_token
from scripts.cluster import start_cluster
from scripts.local_processes import free_port
from tests.node_fixtures import metric, scrape
from tests.serving_fixtures import (JWT_SECRET, NODE_SECRET, dump_toml, gateway_config, tiny_models,  # noqa: F401
                                    wait_until)

pytestmark = pytest.mark.fault
NODES, GATEWAYS = 3, 2
RPM = 5                        # the burst tier's requests per minute
MAX_NUM_SEQS = 2               # a node's batch: a third request there waits, which the router's estimate sees
OVERLAP_S = 1.5                # how long one of the concurrent requests lasts alone
MAX_TOKENS = 3500              # within the tiny model's 4096-token context
SERVED = "zen_node_request_success_total"
CLUSTER_CONFIG = {
    "tiers": {"burst": {"requests_per_minute": RPM, "tokens_per_second": 1_000_000.0, "models": ["zen-tiny"],
                        "max_latency_class": "standard", "default_latency_class": "standard"}},
    "orgs": {"burstco": {"tier": "burst"}},
}


class RunningCluster:
    """The started cluster and what the tests ask of it."""

    def __init__(self, cluster, config):
        self.cluster, self.config = cluster, config

    def auth(self, org: str) -> dict:
        return {"Authorization": "Bearer " + mint_token(self.config, org)}

    def completion(self, i: int, headers: dict, max_tokens: int, prompt: str = "hello") -> requests.Response:
        """A completion through gateway i % GATEWAYS."""
        url = self.cluster.gateway_urls[i % GATEWAYS]
        return requests.post(url + "/v1/completions", headers=headers, timeout=60,
                             json={"model": "zen-tiny", "prompt": prompt, "max_tokens": max_tokens,
                                   "ignore_eos": True, "temperature": 0})

    def served(self, nodes: list[int]) -> list[float]:
        """Requests each of `nodes` has finished (its /metrics)."""
        return [metric(scrape(self.cluster.node_urls[i]), SERVED) for i in nodes]

    def gateway_events(self) -> list[str]:
        events = []
        for gateway in self.cluster.gateways:
            for line in gateway.tail(10**7).splitlines():
                if line.startswith("{"):
                    events.append(json.loads(line).get("event", ""))
        return events

    def logs(self) -> str:
        return "\n".join(f"---- {s.name}\n{s.tail(3000)}" for s in self.cluster.services())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_models):  # noqa: F811
    directory = tmp_path_factory.mktemp("cluster")
    config_path = directory / "gateway.toml"
    config_path.write_text(dump_toml(gateway_config(CLUSTER_CONFIG)))
    env = {"ZEN_CONFIG": str(config_path), "JWT_SECRET": JWT_SECRET, "NODE_SECRET": NODE_SECRET}
    started = start_cluster(directory, tiny_models["a"] + "=tiny-a",
                            node_ports=[free_port() for _ in range(NODES)],
                            gateway_ports=[free_port() for _ in range(GATEWAYS)],
                            node_args=["--backend", "cpu", "--kv-cache-bytes", "8MiB",
                                       "--max-num-seqs", str(MAX_NUM_SEQS)], env=env)
    try:
        yield RunningCluster(started, load_config(config_path, env=env))
    finally:
        started.stop()


def test_request_limit_holds_across_replicas(cluster):
    headers = cluster.auth("burstco")
    responses = [cluster.completion(i, headers, max_tokens=2) for i in range(RPM + 4)]
    assert [r.status_code for r in responses] == [200] * RPM + [429] * 4, [r.text[:200] for r in responses]
    for i, r in enumerate(responses[:RPM]):
        assert r.headers["x-ratelimit-limit-requests"] == str(RPM)
        assert r.headers["x-ratelimit-remaining-requests"] == str(RPM - 1 - i)
    for r in responses[RPM:]:
        assert r.headers["x-ratelimit-limit-requests"] == str(RPM)
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        assert 1 <= int(r.headers["retry-after"]) <= 61
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_concurrent_requests_spread_over_the_nodes(cluster):
    headers = cluster.auth("loadco")
    started = time.monotonic()            # requests long enough to overlap many times over on any machine
    assert cluster.completion(0, headers, max_tokens=400, prompt="calibration").status_code == 200
    max_tokens = min(MAX_TOKENS, int(400 * OVERLAP_S / (time.monotonic() - started)))
    before = cluster.served(list(range(NODES)))
    spans: dict[int, tuple[int, float, float]] = {}

    def one(i: int) -> None:
        start = time.monotonic()
        status = cluster.completion(i, headers, max_tokens=max_tokens, prompt=f"request {i}").status_code
        spans[i] = (status, start, time.monotonic())

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(12)]
    for t in threads:     # staggered: the gateways poll the nodes' load between two arrivals
        t.start()
        time.sleep(0.3)
    for t in threads:
        t.join(120)
    assert {i: s[0] for i, s in spans.items()} == {i: 200 for i in range(12)}, spans
    overlapping = max(sum(1 for _, a, b in spans.values() if a <= start < b) for _, start, _ in spans.values())
    assert overlapping >= 4, f"the premise: requests of {max_tokens} tokens overlap ({spans})"
    delta = [a - b for a, b in zip(cluster.served(list(range(NODES))), before)]
    print(f"{max_tokens} tokens a request, requests per node: {delta}")
    assert sum(delta) == 12, delta
    assert sum(1 for d in delta if d > 0) >= 2, delta


def test_killed_node_is_skipped(cluster):
    headers = cluster.auth("loadco")
    victim = cluster.cluster.nodes[0]
    survivors = list(range(1, NODES))
    before = cluster.served(survivors)
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)
    responses = [cluster.completion(i, headers, max_tokens=4, prompt=f"after the kill {i}") for i in range(12)]
    assert [r.status_code for r in responses] == [200] * 12, ([r.text[:200] for r in responses], cluster.logs())
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in responses)
    delta = [a - b for a, b in zip(cluster.served(survivors), before)]
    assert sum(delta) == 12, delta
    for url in cluster.cluster.gateway_urls:
        wait_until(lambda: all(requests.get(url + "/health", timeout=5).json()["nodes_up"] == NODES - 1
                               for _ in range(4)), 30, f"{url} to see {NODES - 1} nodes up")
    events = cluster.gateway_events()
    assert "node_down" in events or "failover" in events


def test_ports_that_overlap_are_refused_before_anything_starts(capsys):
    from scripts.cluster import main
    assert main(["--nodes", "10"]) == 2                 # node 10 on 8010, the second gateway's port
    assert "ports overlap" in capsys.readouterr().err
