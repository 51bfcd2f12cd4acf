"""deploy/k8s/ against the code: ports, probe paths, environment variables, scrape paths, and shutdown
grace periods are the ones the gateway and the node actually use."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest

from app import close_app, create_app
from app.config import load_config
from engine.node.config import ModelSpec, NodeConfig
from engine.node.drain import END_WAIT_S
from engine.node.app import create_app as create_node_app
from tests.k8s_manifests import (REPO_ROOT, container, cpu_node_statefulset, find, pod_spec,
                                 resources)

GATEWAY = ("Deployment", "zen-gateway", "gateway")
NODE = ("StatefulSet", "zen-node", "node")
ROLES = {"gateway": GATEWAY, "node": NODE}
# Environment variables read by a library, not by the project's code.
LIBRARY_ENV = {"NUMBA_NUM_THREADS", "NUMBA_CACHE_DIR", "PROMETHEUS_MULTIPROC_DIR"}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


@pytest.fixture(scope="module")
def routes() -> dict[str, set[str]]:
    """The URL rules of the gateway's and the node's Flask apps."""
    gateway = create_app()
    node = create_node_app(NodeConfig(models=[ModelSpec("model.gguf", "model")]), start=False)
    try:
        return {"gateway": {r.rule for r in gateway.url_map.iter_rules()},
                "node": {r.rule for r in node.url_map.iter_rules()}}
    finally:
        close_app(gateway)
        node.extensions["zen_node"].close()


def _workload(role: str) -> dict:
    kind, name, _ = ROLES[role]
    return find(kind, name)


def _main_container(role: str) -> dict:
    return container(_workload(role), ROLES[role][2])


def _option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def _env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def _gateway_toml() -> dict:
    return tomllib.loads(find("ConfigMap", "zen-gateway-config")["data"]["gateway.toml"])


def _shipped_toml() -> dict:
    with open(REPO_ROOT / "config" / "default.toml", "rb") as fh:
        return tomllib.load(fh)


def _container_port(c: dict, name: str = "http") -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


# -- ports ---------------------------------------------------------------------------------------

def test_gateway_port_is_the_configured_server_port():
    port = _container_port(_main_container("gateway"))
    assert port == _gateway_toml()["server"]["port"] == _shipped_toml()["server"]["port"] == 8000
    service = find("Service", "zen-gateway")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


def test_node_port_is_the_one_the_gateway_dials_and_the_service_publishes():
    node = _main_container("node")
    port = _container_port(node)
    assert int(_option(node["command"], "--port")) == port == 8001
    assert urlparse(_shipped_toml()["nodes"]["urls"][0]).port == port
    dns_url = urlparse(_gateway_toml()["nodes"]["urls"][0])
    assert dns_url.scheme == "dns+http" and dns_url.port == port
    service = find("Service", "zen-node")
    assert dns_url.hostname == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is False
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(port, "http")]
    assert find("StatefulSet", "zen-node")["spec"]["serviceName"] == service["metadata"]["name"]


def test_redis_service_is_the_one_the_gateway_config_names():
    url = urlparse(_gateway_toml()["limits"]["storage_url"])
    service = find("Service", "zen-redis")
    assert (url.hostname, url.port) == (service["metadata"]["name"], service["spec"]["ports"][0]["port"])
    redis = container(find("Deployment", "zen-redis"), "redis")
    assert _container_port(redis, "redis") == url.port


def test_services_select_the_pods_of_their_workload():
    for service_name, (kind, name, _) in {"zen-gateway": GATEWAY, "zen-node": NODE,
                                          "zen-redis": ("Deployment", "zen-redis", "redis")}.items():
        selector = find("Service", service_name)["spec"]["selector"]
        labels = find(kind, name)["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), service_name


@pytest.mark.parametrize("policy, workload, peers", [
    ("zen-node", NODE, [{"app.kubernetes.io/name": "zen-gateway"}, {"app.kubernetes.io/name": "prometheus"}]),
    ("zen-redis", ("Deployment", "zen-redis", "redis"), [{"app.kubernetes.io/name": "zen-gateway"}]),
])
def test_network_policies_let_in_the_gateways_on_the_ports_their_pods_serve(policy, workload, peers):
    """Each policy selects its workload's pods and lets in exactly these peers (the gateway's pods, which
    its selector must match), on a port the pod's container names."""
    spec = find("NetworkPolicy", policy)["spec"]
    kind, name, container_name = workload
    pods = find(kind, name)
    assert spec["podSelector"]["matchLabels"].items() <= pods["spec"]["template"]["metadata"]["labels"].items()
    assert spec["policyTypes"] == ["Ingress"]
    named_ports = {p["name"] for p in container(pods, container_name)["ports"]}
    allowed = []
    for rule in spec["ingress"]:
        assert {p["port"] for p in rule["ports"]} <= named_ports, policy
        allowed += [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    assert allowed == peers
    gateway_labels = find(*GATEWAY[:2])["spec"]["template"]["metadata"]["labels"]
    assert peers[0].items() <= gateway_labels.items()


# -- probes and scraping -------------------------------------------------------------------------

def _probe_paths() -> list[tuple[str, str, str]]:
    out = []
    for role in ROLES:
        for probe in PROBES:
            spec = _main_container(role).get(probe)
            if spec is not None and "httpGet" in spec:
                out.append((role, probe, spec["httpGet"]["path"]))
    return out


def test_probes_are_health_for_liveness_and_ready_for_readiness():
    """The node keeps threads beyond its queue for /health; the gateway's threads all relay streams, so a
    busy gateway is alive by a TCP connect (gunicorn replaces a hung worker)."""
    paths = {(role, probe): path for role, probe, path in _probe_paths()}
    assert paths[("node", "livenessProbe")] == "/health"
    assert _main_container("gateway")["livenessProbe"]["tcpSocket"]["port"] == "http"
    for role in ROLES:
        assert paths[(role, "readinessProbe")] == "/ready"


@pytest.mark.parametrize("role,probe,path", _probe_paths())
def test_probe_path_is_a_route_of_the_app(routes, role, probe, path):
    assert path in routes[role], f"{role} {probe}: {path} is not a route of the {role} app"


def test_monitors_name_a_service_port_and_a_path(routes):
    monitors = [doc for _, doc in resources() if doc["kind"] in ("ServiceMonitor", "PodMonitor")]
    assert {m["metadata"]["name"] for m in monitors} == {"zen-gateway", "zen-node"}
    for monitor in monitors:
        role = monitor["metadata"]["name"].removeprefix("zen-")
        service = find("Service", monitor["metadata"]["name"])
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["path"] == "/metrics" and "/metrics" in routes[role]
            assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_gateway_is_scraped_with_the_metrics_token_from_the_secret():
    monitor = find("ServiceMonitor", "zen-gateway")
    auth = monitor["spec"]["endpoints"][0]["authorization"]
    assert auth["type"] == "Bearer"
    assert auth["credentials"] == {"name": "zen-metrics", "key": "METRICS_TOKEN"}   # that one alone
    gateway_env = _env(_main_container("gateway"))
    assert gateway_env["METRICS_TOKEN"]["valueFrom"]["secretKeyRef"] == auth["credentials"]


# -- environment ---------------------------------------------------------------------------------

def _env_names_read(paths: list[Path]) -> set[str]:
    """String constants the code looks up in an environment: env.get("X"), os.environ["X"], and the
    default of a `--...-env` option (the name of a variable the command line reads)."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("get", "pop", "setdefault") and node.args
                    and "env" in ast.unparse(node.func.value).lower()):
                key = node.args[0]
            elif isinstance(node, ast.Subscript) and "env" in ast.unparse(node.value).lower():
                key = node.slice
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and str(node.args[0].value).endswith("-env")):
                key = next((k.value for k in node.keywords if k.arg == "default"), None)
            else:
                continue
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                names.add(key.value)
    return names


def _code_of(role: str) -> list[Path]:
    if role == "gateway":
        return sorted((REPO_ROOT / "app").rglob("*.py")) + [REPO_ROOT / "config" / "gunicorn.conf.py"]
    return sorted((REPO_ROOT / "engine").rglob("*.py"))


@pytest.mark.parametrize("role", ROLES)
def test_every_environment_variable_set_is_read_by_the_code(role):
    read = _env_names_read(_code_of(role))
    workloads = [_workload(role)] + ([cpu_node_statefulset()] if role == "node" else [])
    for workload in workloads:
        c = container(workload, ROLES[role][2])
        expanded = {arg[2:-1] for arg in c["command"] if arg.startswith("$(")}   # Kubernetes fills these in
        unread = set(_env(c)) - read - LIBRARY_ENV - expanded
        assert not unread, f"{role}: set but never read: {sorted(unread)}"


def test_secrets_reach_the_gateway_and_the_node_from_the_secret():
    secret_of = {key: name for name in ("zen-secrets", "zen-metrics") for key in find("Secret", name)["stringData"]}
    for role, wanted in (("gateway", set(secret_of)), ("node", {"NODE_SECRET"})):
        env = _env(_main_container(role))
        for key in wanted:
            assert env[key]["valueFrom"]["secretKeyRef"] == {"name": secret_of[key], "key": key}
    gateway_env = _env(_main_container("gateway"))
    mount = next(m for m in _main_container("gateway")["volumeMounts"] if m["name"] == "config")
    assert gateway_env["ZEN_CONFIG"]["value"] == f"{mount['mountPath']}/gateway.toml"
    config_volume = next(v for v in pod_spec(_workload("gateway"))["volumes"] if v["name"] == "config")
    assert config_volume["configMap"]["name"] == "zen-gateway-config"


def test_manifest_config_builds_a_gateway_config_from_the_deployments_env(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(find("ConfigMap", "zen-gateway-config")["data"]["gateway.toml"])
    env = {name: f"{name}-from-the-secret-0123456789abcdef" for name in _env(_main_container("gateway"))
           if name != "ZEN_CONFIG"}
    cfg = load_config(path, env=env)
    assert (cfg.auth.hs256_secret, cfg.nodes.secret, cfg.server.metrics_token) == (
        env["JWT_SECRET"], env["NODE_SECRET"], env["METRICS_TOKEN"])


# -- shutdown ------------------------------------------------------------------------------------

def _gunicorn_graceful_timeout() -> int:
    """graceful_timeout as config/gunicorn.conf.py sets it (read, not run: running it loads the config)."""
    tree = ast.parse((REPO_ROOT / "config" / "gunicorn.conf.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["graceful_timeout"]:
            return ast.literal_eval(node.value)
    raise AssertionError("config/gunicorn.conf.py sets no graceful_timeout")


def _pre_stop_s(c: dict) -> int:
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return int(command[1])


def test_grace_periods_cover_the_pre_stop_wait_and_the_drain():
    gateway, node = _main_container("gateway"), _main_container("node")
    drains = {"gateway": _gunicorn_graceful_timeout(), "node": int(_env(node)["NODE_DRAIN_GRACE_S"]["value"])}
    assert drains == {"gateway": 30, "node": 30}
    for role, c in (("gateway", gateway), ("node", node)):
        grace = pod_spec(_workload(role))["terminationGracePeriodSeconds"]
        assert grace >= _pre_stop_s(c) + drains[role], role
        assert grace <= _pre_stop_s(c) + drains[role] + 15, f"{role}: a stuck pod would linger"


def test_node_grace_period_covers_the_end_wait_and_the_close():
    for statefulset in (_workload("node"), cpu_node_statefulset()):
        c = container(statefulset, "node")
        drain = int(_env(c)["NODE_DRAIN_GRACE_S"]["value"])
        grace = pod_spec(statefulset)["terminationGracePeriodSeconds"]
        assert grace >= _pre_stop_s(c) + drain + END_WAIT_S + 5


@pytest.mark.parametrize("variant", ["cuda", "cpu"])
def test_the_node_command_is_one_the_node_accepts(variant, tmp_path):
    """Every option of the StatefulSet's command parses and passes the node's checks: started as written
    (its model path aside, which is not on this machine), the node stops only for the missing model."""
    statefulset = _workload("node") if variant == "cuda" else cpu_node_statefulset()
    command = container(statefulset, "node")["command"]
    assert command[:3] == ["python", "-m", "engine"]
    args = [str(tmp_path / "absent.gguf") if a.endswith(".gguf") else a for a in command[3:]]
    env = {**os.environ, "NODE_SECRET": "a-secret-of-the-deployment", **{
        e["name"]: e["value"] for e in container(statefulset, "node").get("env", []) if "value" in e}}
    out = subprocess.run([sys.executable, "-m", "engine", *args], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "error: model not found" in out.stderr, out.stderr[-2000:]
