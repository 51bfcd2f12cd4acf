"""Server processes on this machine's loopback for the launchers (scripts/cluster.py, the benchmarks'
--start) and the tests: a free port, a service in its own process group with its log in a file, a
wait for its HTTP endpoint, and redis-server (no persistence).

Each process runs in its own session: a terminal's Ctrl-C reaches only whoever started it, which
stops it (Service.stop, RedisProcess.stop), so that nothing is left behind.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
REDIS_START_TIMEOUT_S = 10.0
REDIS_STOP_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_all(stops: Iterable[Callable[[], None]], what: str) -> None:
    """Call every stop in turn, also after one raised; the errors are printed, never raised (what is
    stopped next must still be)."""
    errors = []
    for stop in stops:
        try:
            stop()
        except Exception as exc:  # noqa: BLE001 - keep stopping the others
            errors.append(repr(exc))
    if errors:
        print(f"errors while stopping {what}:", errors, file=sys.stderr)


def terminate(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM to a running process, SIGKILL if it is still there after timeout_s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class Service:
    """A server process (its own process group, its output in `log_path`). stop() sends `stop_signal` to
    its process group (or to the process alone: `signal_group=False`), SIGKILL to the group after
    `stop_timeout_s`. `env` None: this process's environment; `cwd` None: the repository."""

    def __init__(self, name: str, argv: list[str], env: dict | None, log_path: Path, *,
                 stop_signal: int = signal.SIGTERM, signal_group: bool = True, stop_timeout_s: float = 30.0,
                 cwd: Path | None = None):
        self.name, self.log_path = name, Path(log_path)
        self.stop_signal, self.signal_group, self.stop_timeout_s = stop_signal, signal_group, stop_timeout_s
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, cwd=cwd or ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                if self.signal_group:
                    os.killpg(self.proc.pid, self.stop_signal)
                else:
                    self.proc.send_signal(self.stop_signal)
                self.proc.wait(self.stop_timeout_s)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        self._log.close()

    def log(self) -> str:
        """Its output so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 4000) -> str:
        return self.log()[-n:]


def wait_http(url: str, service: Service, timeout: float, ok=lambda r: r.status_code == 200) -> None:
    """Poll `url` until `ok(response)`; RuntimeError (with the log's tail) if the service exits first or
    the timeout passes. The service is left running: whoever started it stops it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise RuntimeError(f"the {service.name} exited with {service.proc.returncode}:\n{service.tail()}")
        try:
            r = requests.get(url, timeout=2.0)
            if ok(r):
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the {service.name} did not become ready in {timeout:.0f} s:\n{service.tail()}")


def start_redis(port: int, directory: str | Path | None = None):
    """A real redis-server on loopback (no persistence; its working directory `directory` when given);
    returns the process."""
    import redis as redis_lib

    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server; .ci/run does it)")
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--loglevel", "warning"]
    if directory is not None:
        args += ["--dir", str(directory)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    client = redis_lib.Redis(port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + REDIS_START_TIMEOUT_S
    while True:
        try:
            client.ping()
            break
        except redis_lib.RedisError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
    client.close()
    return proc


class RedisProcess:
    """redis-server on a fixed loopback port; stop() and start() again on the same port."""

    def __init__(self, port: int | None = None, directory: str | Path | None = None):
        self.port = port or free_port()
        self.directory = directory
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisProcess":
        self.proc = start_redis(self.port, self.directory)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, REDIS_STOP_TIMEOUT_S)
        self.proc = None
