"""The Kubernetes manifests of deploy/k8s/ as Python objects, for the deployment tests.

`resources()` is every Kubernetes object in the YAML files (kustomization files and the cpu/ overlay's
JSON patch are not objects) and every ConfigMap a kustomization generates (`configMapGenerator`, as
kustomize makes it but for the hash it adds to the name); `find(kind, name)` one of them; `container(obj, name)` a container of a
workload; `cpu_node_statefulset()` the node StatefulSet with the cpu/ overlay's patch applied.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterator

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = REPO_ROOT / "deploy" / "k8s"
BASE_DIR = K8S_DIR / "base"
CPU_PATCH = K8S_DIR / "cpu" / "node-statefulset-cpu.yaml"


def manifest_files() -> list[Path]:
    return sorted(K8S_DIR.rglob("*.yaml"))


def documents(path: Path) -> list[Any]:
    with open(path) as fh:
        return [d for d in yaml.safe_load_all(fh) if d is not None]


def is_resource(doc: Any) -> bool:
    """A Kubernetes object (not a kustomization, not a JSON patch)."""
    return (isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc
            and not doc["apiVersion"].startswith("kustomize.config.k8s.io/"))


def generated_config_maps(kustomization: Path) -> list[dict]:
    """The ConfigMaps of a kustomization's configMapGenerator: each file's content under its name."""
    out = []
    for gen in documents(kustomization)[0].get("configMapGenerator", []):
        meta = {"name": gen["name"], "labels": gen.get("options", {}).get("labels", {})}
        if "namespace" in gen:
            meta["namespace"] = gen["namespace"]
        data = {Path(f).name: (kustomization.parent / f).read_text() for f in gen.get("files", [])}
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    return out


def resources() -> Iterator[tuple[Path, dict]]:
    for path in manifest_files():
        for doc in documents(path):
            if is_resource(doc):
                yield path, doc
        if path.name == "kustomization.yaml":
            for doc in generated_config_maps(path):
                yield path, doc


def find(kind: str, name: str) -> dict:
    found = [doc for _, doc in resources() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} manifests"
    return found[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(workload: dict, name: str) -> dict:
    found = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    assert len(found) == 1, f"no container {name!r} in {workload['kind']}/{workload['metadata']['name']}"
    return found[0]


def _pointer(doc: Any, path: str) -> tuple[Any, str | int]:
    """The parent of an RFC 6901 pointer's target, and the target's key (an index in a list)."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]
    for part in parts[:-1]:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    last = parts[-1]
    return doc, (last if not isinstance(doc, list) else (len(doc) if last == "-" else int(last)))


def apply_json_patch(doc: dict, operations: list[dict]) -> dict:
    """RFC 6902 test/add/replace/remove on a copy of `doc`, as kustomize applies a JSON patch."""
    out = copy.deepcopy(doc)
    for op in operations:
        parent, key = _pointer(out, op["path"])
        if op["op"] == "test":
            assert parent[key] == op["value"], f"patch test failed at {op['path']}: {parent[key]!r}"
        elif op["op"] == "add" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(op["value"]))
        elif op["op"] in ("add", "replace"):
            if op["op"] == "replace":
                parent[key]      # noqa: B018 - replace needs the target to exist (KeyError otherwise)
            parent[key] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del parent[key]
        else:
            raise ValueError(f"unsupported JSON patch op {op['op']!r}")
    return out


def cpu_node_statefulset() -> dict:
    return apply_json_patch(find("StatefulSet", "zen-node"), documents(CPU_PATCH)[0])
