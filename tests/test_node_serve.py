"""`python -m engine serve` and the shipped development node secret: off loopback, a node without
NODE_SECRET or with the development one exits with a message naming NODE_SECRET before it binds or
loads a model; it starts with a secret of its own, and on loopback with the development default."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import requests

from engine.node.config import ModelSpec, NodeConfig
from engine.protocol import DEV_NODE_SECRET, SECRET_HEADER
from tests.node_fixtures import REPO_ROOT, free_port, launch_node, tiny_models  # noqa: F401 (tiny_models: fixture)

START_TIMEOUT_S = 60.0
OWN_SECRET = "operator-node-secret-5d1c"


def _serve_off_loopback(model: str, secret: str | None) -> subprocess.CompletedProcess:
    """`python -m engine serve --host 0.0.0.0` with NODE_SECRET set to `secret` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_SECRET", "PROMETHEUS_MULTIPROC_DIR")}
    if secret is not None:
        env["NODE_SECRET"] = secret
    args = [sys.executable, "-m", "engine", "serve", "--host", "0.0.0.0", "--port", str(free_port()),
            "--models", model + "=tiny-a", "--backend", "cpu", "--kv-cache-bytes", "4MiB"]
    return subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S)


@pytest.mark.parametrize("secret", [None, "", DEV_NODE_SECRET], ids=["unset", "empty", "development"])
def test_public_host_without_a_secret_of_its_own_exits_before_binding(tiny_models, secret):
    out = _serve_off_loopback(tiny_models["a"], secret)
    assert out.returncode != 0
    assert "not a loopback address" in out.stderr and "set NODE_SECRET" in out.stderr, out.stderr
    assert DEV_NODE_SECRET not in out.stderr + out.stdout
    assert "Listening at" not in out.stderr + out.stdout       # gunicorn never started
    assert "model_load_start" not in out.stderr + out.stdout


def test_public_host_with_a_secret_of_its_own_starts(tiny_models, tmp_path):
    node = launch_node([tiny_models["a"] + "=tiny-a"], OWN_SECRET, host="0.0.0.0", log_dir=str(tmp_path))
    try:
        assert requests.get(node.url + "/state", headers={SECRET_HEADER: OWN_SECRET}, timeout=10).status_code == 200
        assert requests.get(node.url + "/state", headers={SECRET_HEADER: DEV_NODE_SECRET},
                            timeout=10).status_code == 401
    finally:
        node.stop()


def test_loopback_without_node_secret_starts_with_the_development_one(tiny_models, tmp_path):
    node = launch_node([tiny_models["a"] + "=tiny-a"], "", log_dir=str(tmp_path))
    try:
        r = requests.get(node.url + "/state", headers={SECRET_HEADER: DEV_NODE_SECRET}, timeout=10)
        assert r.status_code == 200
        assert "NODE_SECRET is not set" in node.log()
    finally:
        node.stop()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.7", "node-1.example.com", ""])
def test_node_config_refuses_the_development_secret_off_loopback(host):
    with pytest.raises(ValueError, match="not a loopback address.*set NODE_SECRET"):
        NodeConfig(models=[ModelSpec("m.gguf", "m")], host=host)
    NodeConfig(models=[ModelSpec("m.gguf", "m")], host=host, secret=OWN_SECRET)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"])
def test_node_config_takes_the_development_secret_on_loopback(host):
    assert NodeConfig(models=[ModelSpec("m.gguf", "m")], host=host).secret == DEV_NODE_SECRET


def test_node_config_refuses_an_empty_secret():
    with pytest.raises(ValueError, match="must not be empty"):
        NodeConfig(models=[ModelSpec("m.gguf", "m")], secret="")


def test_secret_from_env(monkeypatch):
    monkeypatch.setenv("OTHER_SECRET", "from-the-environment")
    assert NodeConfig.secret_from_env("OTHER_SECRET", host="0.0.0.0") == "from-the-environment"
    monkeypatch.delenv("OTHER_SECRET")
    assert NodeConfig.secret_from_env("OTHER_SECRET", host="127.0.0.1") == DEV_NODE_SECRET
    with pytest.raises(ValueError, match="OTHER_SECRET is not set, and --host '0.0.0.0' is not a loopback"):
        NodeConfig.secret_from_env("OTHER_SECRET", host="0.0.0.0")


@pytest.mark.parametrize("path", ["Makefile", "scripts/serve.sh"])
def test_shell_defaults_are_the_development_node_secret(path):
    """The shell scripts cannot import DEV_NODE_SECRET: the default each gives NODE_SECRET is checked here."""
    defaults = re.findall(r"NODE_SECRET:-([^}]*)\}", (REPO_ROOT / path).read_text())
    assert defaults and set(defaults) == {DEV_NODE_SECRET}, defaults


def test_the_development_node_secret_is_written_once_in_python():
    holders = [str(p.relative_to(REPO_ROOT)) for top in ("app", "engine", "benchmarks", "scripts", "tests")
               for p in (REPO_ROOT / top).rglob("*.py") if DEV_NODE_SECRET in p.read_text()]
    assert holders == ["engine/protocol.py"]


def test_the_default_threads_hold_a_full_batch_and_a_full_queue():
    # each request holds a thread while it waits: fewer, and queue_full is never answered
    config = NodeConfig(models=[ModelSpec("m.gguf", "m")], max_num_seqs=8, max_waiting=100)
    assert config.threads > 8 + 100
    assert NodeConfig(models=[ModelSpec("m.gguf", "m")], threads=4).threads == 4
