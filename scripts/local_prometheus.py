"""A local Prometheus for `make observe` and the observability test.

The Debian package's `prometheus` binary runs as a plain process (no service) on a loopback port, with
deploy/prometheus/prometheus.yml rewritten for the stack it watches (the gateway's and the node's
addresses, the gateway's metrics token, the scrape interval) into a directory of its own, beside its
storage, and deploy/prometheus/rules.yml loaded.

    python -m scripts.local_prometheus --gateway 127.0.0.1:8000 --node 127.0.0.1:8001 [--port 9090]

runs until interrupted. The metrics token is the gateway's: METRICS_TOKEN, else [server] metrics_token
of ZEN_CONFIG (or config/default.toml).
"""
from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import yaml

from scripts.local_processes import Service, wait_http

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_PATH = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"
RULES_PATH = REPO_ROOT / "deploy" / "prometheus" / "rules.yml"
DASHBOARD_PATH = REPO_ROOT / "deploy" / "grafana" / "zen-inference.json"
GATEWAY_JOB, NODE_JOB = "zen-gateway", "zen-node"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
ANNOUNCE_WAIT_S = 300.0


def prometheus_binary(name: str = "prometheus") -> str:
    """The path of `prometheus` (or `promtool`); a clear error when the package is missing."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"`{name}` is not installed: apt-get install prometheus (Debian/Ubuntu)")
    return path


def gateway_metrics_token() -> str:
    """The token the gateway wants on GET /metrics, read the way the gateway reads it."""
    from app.config import load_config
    return load_config().server.metrics_token


def prometheus_config(gateway: str, nodes: list[str], metrics_token: str, scrape_interval: str = "15s",
                      rules: Path = RULES_PATH) -> dict:
    """The shipped configuration with these targets (host:port), token, interval and rules file."""
    config = yaml.safe_load(CONFIG_PATH.read_text())
    config["global"].update(scrape_interval=scrape_interval, evaluation_interval=scrape_interval)
    config["rule_files"] = [str(rules)]
    for job in config["scrape_configs"]:
        if job["job_name"] == GATEWAY_JOB:
            job["static_configs"] = [{"targets": [gateway]}]
            if metrics_token:
                job["authorization"] = {"type": "Bearer", "credentials": metrics_token}
            else:   # an open /metrics: a gateway configured without a token
                job.pop("authorization", None)
        elif job["job_name"] == NODE_JOB:
            job["static_configs"] = [{"targets": list(nodes)}]
    return config


class LocalPrometheus:
    """Prometheus on 127.0.0.1:`port` with `config`; its config file, storage and log in `directory`."""

    def __init__(self, directory: str | Path, port: int, config: dict):
        self.directory = Path(directory)
        self.port = port
        self.config = config
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = self.directory / "prometheus.log"
        self.service: Service | None = None

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.service.proc if self.service is not None else None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> "LocalPrometheus":
        """Start it and wait until it is ready (its rules loaded, scraping)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        config_file = self.directory / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(self.config, sort_keys=False))
        args = [prometheus_binary(), f"--config.file={config_file}",
                f"--storage.tsdb.path={self.directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        self.service = Service("prometheus", args, None, self.log_path, stop_timeout_s=STOP_TIMEOUT_S)
        try:
            wait_http(self.url + "/-/ready", self.service, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def log(self) -> str:
        return self.service.log() if self.service is not None else ""

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()

    def api(self, path: str, **params) -> object:
        """The `data` of a GET on Prometheus' HTTP API (/api/v1/<path>)."""
        r = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = r.json()   # errors too (a bad query: 400 with its reason)
        if r.status_code != 200 or body.get("status") != "success":
            raise RuntimeError(f"prometheus /api/v1/{path} {params}: {r.status_code} {body}")
        return body["data"]

    def series(self, metric: str) -> list[dict]:
        """The label sets of every series named `metric` that Prometheus holds."""
        return self.api("series", **{"match[]": metric})

    def scrapes_done(self) -> dict[str, int]:
        """{job: how many of its targets are up}, from the active targets."""
        up: dict[str, int] = {}
        for target in self.api("targets", state="active")["activeTargets"]:
            job = target["labels"]["job"]
            up[job] = up.get(job, 0) + (target["health"] == "up")
        return up


def announce_when_scraping(prometheus: LocalPrometheus) -> None:
    """Print the URL once every target answers (below the stack's own start-up lines), or after
    ANNOUNCE_WAIT_S."""
    deadline = time.monotonic() + ANNOUNCE_WAIT_S
    while time.monotonic() < deadline and prometheus.proc.poll() is None:
        try:
            up = prometheus.scrapes_done()
            if up and all(up.values()):
                break
        except (requests.RequestException, RuntimeError):
            pass
        time.sleep(1)
    print(f"\n  Prometheus: {prometheus.url}   (alerts: {prometheus.url}/alerts, rules from "
          f"{RULES_PATH.relative_to(REPO_ROOT)}; up: {prometheus.url}/targets)\n", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", default="127.0.0.1:8000", help="the gateway's host:port")
    parser.add_argument("--node", action="append", help="an engine node's host:port (repeatable)")
    parser.add_argument("--port", type=int, default=9090, help="Prometheus' port on 127.0.0.1")
    parser.add_argument("--scrape-interval", default="5s")
    args = parser.parse_args(argv)
    config = prometheus_config(args.gateway, args.node or ["127.0.0.1:8001"], gateway_metrics_token(),
                               args.scrape_interval)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # leave through `finally`: stop Prometheus
    with tempfile.TemporaryDirectory(prefix="zen-prometheus-") as directory:
        prometheus = LocalPrometheus(directory, args.port, config)
        try:
            prometheus.start()
            announce_when_scraping(prometheus)
            prometheus.proc.wait()
            print(f"prometheus exited with {prometheus.proc.returncode}:\n{prometheus.log()[-2000:]}",
                  file=sys.stderr)
            return 1
        except RuntimeError as exc:   # it did not start: its log says why
            print(exc, file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
        finally:
            prometheus.stop()


if __name__ == "__main__":
    sys.exit(main())
