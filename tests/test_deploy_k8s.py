"""deploy/k8s/: every manifest valid against the Kubernetes schemas (kubernetes-validate), the
kustomizations complete, the Secret's placeholders not the development values, the gateway's TOML
loadable, and the cpu/ overlay a valid StatefulSet without a GPU."""
from __future__ import annotations

import re
import tomllib

import kubernetes_validate
import pytest
import yaml

from app.config import DEVELOPMENT_SECRETS, ConfigError, load_config
from tests.k8s_manifests import (BASE_DIR, K8S_DIR, container, cpu_node_statefulset, documents, find,
                                 manifest_files, pod_spec, resources)

# The oldest Kubernetes the manifests are meant for (autoscaling/v2, policy/v1 PDB, startupProbe) and the
# newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
# Custom resources: not in the Kubernetes schemas, so checked here by their own rules.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PodMonitor")}
SECRET_KEYS = {s.env for s in DEVELOPMENT_SECRETS}


def _resource_id(item) -> str:
    path, doc = item
    return f"{path.relative_to(K8S_DIR)}:{doc['kind']}/{doc['metadata']['name']}"


# the custom resources are checked by test_monitors_use_only_the_operators_fields (and the consistency tests)
RESOURCES = [item for item in resources() if (item[1]["apiVersion"], item[1]["kind"]) not in CUSTOM_KINDS]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("item", RESOURCES, ids=[_resource_id(i) for i in RESOURCES])
def test_every_manifest_is_valid_against_the_kubernetes_schemas(item, version):
    kubernetes_validate.validate(item[1], version, strict=True)


# The Prometheus Operator's fields (monitoring.coreos.com/v1) that the manifests may use.
MONITOR_SPEC_FIELDS = {"selector", "endpoints", "podMetricsEndpoints", "namespaceSelector", "jobLabel",
                       "targetLabels", "podTargetLabels", "sampleLimit"}
MONITOR_ENDPOINT_FIELDS = {"port", "path", "interval", "scrapeTimeout", "scheme", "authorization", "tlsConfig",
                           "honorLabels", "relabelings", "metricRelabelings", "params", "followRedirects"}


def test_monitors_use_only_the_operators_fields():
    monitors = [doc for _, doc in resources() if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS]
    assert monitors
    for monitor in monitors:
        assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
        assert set(monitor["spec"]) <= MONITOR_SPEC_FIELDS, monitor["metadata"]["name"]
        endpoints = monitor["spec"].get("endpoints") or monitor["spec"].get("podMetricsEndpoints")
        for endpoint in endpoints:
            assert set(endpoint) <= MONITOR_ENDPOINT_FIELDS, endpoint
            for duration in ("interval", "scrapeTimeout"):
                assert duration not in endpoint or re.fullmatch(r"([0-9]+(ms|s|m|h))+", endpoint[duration])
            auth = endpoint.get("authorization")
            assert auth is None or (auth["type"] == "Bearer" and set(auth["credentials"]) == {"name", "key"})


def test_cpu_overlay_gives_a_valid_node_statefulset_without_a_gpu():
    statefulset = cpu_node_statefulset()
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(statefulset, version, strict=True)
    node = container(statefulset, "node")
    command = node["command"]
    assert command[command.index("--backend") + 1] == "cpu"
    assert "nvidia.com/gpu" not in yaml.safe_dump(statefulset)
    assert all(c["image"].endswith(":cpu") for c in [node, *pod_spec(statefulset)["initContainers"]])
    threads = {e["name"]: e.get("value") for e in node["env"]}["NUMBA_NUM_THREADS"]
    assert threads == node["resources"]["limits"]["cpu"]


def test_kustomizations_name_every_manifest_but_the_secret():
    base = documents(BASE_DIR / "kustomization.yaml")[0]
    listed = base["resources"]
    on_disk = {p.name for p in BASE_DIR.glob("*.yaml")} - {"kustomization.yaml", "secret.yaml"}
    assert sorted(listed) == sorted(on_disk)
    # every other file of base/ is a generated ConfigMap's
    generated = [f for g in base["configMapGenerator"] for f in g["files"]]
    assert sorted(generated) == sorted(p.name for p in BASE_DIR.iterdir() if p.suffix != ".yaml")
    assert documents(K8S_DIR / "kustomization.yaml")[0]["resources"] == ["base"]
    assert documents(K8S_DIR / "cpu" / "kustomization.yaml")[0]["resources"] == ["../base"]
    assert {p.parent.name for p in manifest_files()} == {"k8s", "base", "cpu"}


def test_secret_has_the_three_secrets_with_placeholders_that_are_not_the_development_values():
    placeholders = {**find("Secret", "zen-secrets")["stringData"], **find("Secret", "zen-metrics")["stringData"]}
    assert set(placeholders) == SECRET_KEYS and set(find("Secret", "zen-metrics")["stringData"]) == {"METRICS_TOKEN"}
    development = {s.env: s.value for s in DEVELOPMENT_SECRETS}
    for key, value in placeholders.items():
        assert value and value != development[key], key


def test_the_gateway_config_map_is_generated_so_that_a_change_rolls_the_gateway():
    """kustomize names a generated ConfigMap with a hash of its content and puts that name wherever the
    kustomization's objects refer to it: the Deployment's pods change with the configuration."""
    (gen,) = documents(BASE_DIR / "kustomization.yaml")[0]["configMapGenerator"]
    volumes = pod_spec(find("Deployment", "zen-gateway"))["volumes"]
    assert [v["configMap"]["name"] for v in volumes if "configMap" in v] == [gen["name"]]
    assert not gen.get("options", {}).get("disableNameSuffixHash", False)
    assert [doc["metadata"]["name"] for _, doc in resources() if doc["kind"] == "ConfigMap"] == [gen["name"]]


def _gateway_toml() -> str:
    return find("ConfigMap", "zen-gateway-config")["data"]["gateway.toml"]


def test_gateway_config_loads_with_the_secrets_and_refuses_to_start_without_them(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(_gateway_toml())
    secrets = {key: f"{key.lower()}-a-real-secret-of-at-least-32-bytes" for key in SECRET_KEYS}
    cfg = load_config(path, env=secrets)
    assert cfg.server.host == "0.0.0.0"
    assert cfg.limits.storage_url == "redis://zen-redis:6379/0"
    assert cfg.nodes.urls == ("dns+http://zen-node.zen.svc.cluster.local:8001",)
    assert cfg.development_secrets_in_use() == []
    with pytest.raises(ConfigError):
        load_config(path, env={})


def test_gateway_config_keeps_every_section_of_the_shipped_default():
    with open(K8S_DIR.parents[1] / "config" / "default.toml", "rb") as fh:
        shipped = tomllib.load(fh)
    mine = tomllib.loads(_gateway_toml())
    assert set(mine) == set(shipped)
    for section in ("tiers", "orgs", "models", "routing"):
        assert mine[section] == shipped[section], section
