"""`python -m app serve` and the shipped development secrets: refused off loopback before anything
binds, named with the environment variable that replaces each; started with real secrets, or on
loopback with the shipped ones."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import requests

from app.config import DEFAULT_CONFIG_PATH, DEVELOPMENT_SECRETS
from app.limit_store import LIMITS_DIR_ENV
from tests.node_fixtures import wait_for
from tests.serving_fixtures import REPO_ROOT, GatewayProcess
from tests.test_gateway_support import free_port

START_TIMEOUT_S = 60.0
OWN_SECRETS = {"JWT_SECRET": "operator-jwt-secret-0123456789abcdef-0123",
               "NODE_SECRET": "operator-node-secret", "METRICS_TOKEN": "operator-metrics-token"}


def _config_on(tmp_path, host: str):
    """config/default.toml with [server] host replaced."""
    text = DEFAULT_CONFIG_PATH.read_text()
    assert text.count('\nhost = "127.0.0.1"') == 1
    path = tmp_path / "gateway.toml"
    path.write_text(text.replace('\nhost = "127.0.0.1"', f'\nhost = "{host}"'))
    return path


def _env(tmp_path, config_path, port: int, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("JWT_SECRET", "NODE_SECRET", "METRICS_TOKEN", "ZEN_NODES", "REDIS_URL")}
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir(exist_ok=True)
    env.update({"ZEN_CONFIG": str(config_path), "PORT": str(port), "GATEWAY_WORKERS": "1",
                "GATEWAY_THREADS": "4", "ZEN_NODES": "http://127.0.0.1:9",
                "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "PYTHONUNBUFFERED": "1", **extra})
    return env


def _serve(tmp_path, host: str, **secrets: str) -> GatewayProcess:
    """`python -m app serve` on `host`, answering /health on 127.0.0.1."""
    port = free_port()
    config_path = _config_on(tmp_path, host)
    env = _env(tmp_path, config_path, port, **secrets)
    gateway = GatewayProcess([sys.executable, "-m", "app", "serve"], env, tmp_path / "gateway.log",
                             f"http://127.0.0.1:{port}", config_path)

    def healthy() -> bool:
        assert gateway.alive(), gateway.log()[-3000:]
        try:
            return requests.get(gateway.url + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    try:
        wait_for(healthy, timeout=START_TIMEOUT_S, what="the gateway's /health")
    except BaseException:
        gateway.stop()
        raise
    return gateway


@pytest.mark.parametrize("command", [["app", "serve"],
                                     ["gunicorn", "-c", "config/gunicorn.conf.py", "wsgi:app"]],
                         ids=["app-serve", "gunicorn"])
def test_public_host_with_development_secrets_exits_before_binding(tmp_path, command):
    port = free_port()
    env = _env(tmp_path, _config_on(tmp_path, "0.0.0.0"), port)
    out = subprocess.run([sys.executable, "-m", *command], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=START_TIMEOUT_S)
    assert out.returncode != 0
    assert "not a loopback address" in out.stderr, out.stderr
    for secret in DEVELOPMENT_SECRETS:
        assert f"{secret.key} (set {secret.env})" in out.stderr, out.stderr
        assert secret.value not in out.stderr
    assert "Listening at" not in out.stderr + out.stdout     # gunicorn never started


@pytest.mark.parametrize("how", ["argument", "GUNICORN_CMD_ARGS"])
def test_a_public_bind_given_to_gunicorn_is_refused_too(tmp_path, how):
    # server.host is loopback here; the bind gunicorn is given on its command line or in its environment wins
    port = free_port()
    bind = f"0.0.0.0:{port}"
    env = _env(tmp_path, _config_on(tmp_path, "127.0.0.1"), port,
               **({"GUNICORN_CMD_ARGS": f"--bind={bind}"} if how == "GUNICORN_CMD_ARGS" else {}))
    argv = [sys.executable, "-m", "app", "serve"] + (["--bind", bind] if how == "argument" else [])
    out = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert out.returncode != 0
    assert f"gunicorn bind {bind} is not a loopback address" in out.stderr, out.stderr
    assert "Listening at" not in out.stderr + out.stdout


def test_an_ipv6_host_is_bound_in_brackets(tmp_path, monkeypatch):
    import importlib.util
    monkeypatch.setenv("ZEN_CONFIG", str(_config_on(tmp_path, "::1")))
    monkeypatch.setenv("PORT", "8123")
    # the directories the file sets up for a master: this process's own, taken back after the test
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prometheus"))
    monkeypatch.setenv(LIMITS_DIR_ENV, str(tmp_path / "limits"))
    spec = importlib.util.spec_from_file_location("gunicorn_conf", REPO_ROOT / "config" / "gunicorn.conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    assert conf.bind == "[::1]:8123" and conf._on_loopback(conf.bind)


def test_public_host_names_only_the_secrets_left_at_their_development_value(tmp_path):
    env = _env(tmp_path, _config_on(tmp_path, "0.0.0.0"), free_port(), JWT_SECRET=OWN_SECRETS["JWT_SECRET"])
    out = subprocess.run([sys.executable, "-m", "app", "serve"], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=START_TIMEOUT_S)
    assert out.returncode != 0
    assert "JWT_SECRET" not in out.stderr and "NODE_SECRET" in out.stderr and "METRICS_TOKEN" in out.stderr


def test_public_host_with_secrets_of_its_own_starts(tmp_path):
    gateway = _serve(tmp_path, "0.0.0.0", **OWN_SECRETS)
    try:
        r = requests.get(gateway.url + "/metrics", timeout=10,
                         headers={"Authorization": f"Bearer {OWN_SECRETS['METRICS_TOKEN']}"})
        assert r.status_code == 200
    finally:
        gateway.stop()


def test_loopback_with_development_secrets_starts(tmp_path):
    gateway = _serve(tmp_path, "127.0.0.1")
    gateway.stop()
