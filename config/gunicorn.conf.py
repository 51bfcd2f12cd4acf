"""gunicorn settings for the gateway: `gunicorn -c config/gunicorn.conf.py wsgi:app`.

Threaded workers (gthread), so that one worker carries many concurrent token streams.
Prometheus multiprocess mode: PROMETHEUS_MULTIPROC_DIR is set here, in the master, before
any worker imports prometheus_client; it is emptied at start and a dead worker's files
are marked dead so that /metrics on any worker reports the sum over all of them.
The embedded limits store (`[limits] storage_url = "embedded://"`): ZEN_LIMITS_DIR is set here
too, to a directory made at start (in /dev/shm where it exists) and removed at exit, so that
every worker counts in the same LMDB file; set it yourself to keep limits across restarts.
Bind address and counts come from the gateway config ([server], PORT), and can be
overridden with GATEWAY_WORKERS / GATEWAY_THREADS.
"""
import os
import shutil
import signal
import sys
import tempfile

from gunicorn.glogging import Logger

from app.config import ConfigError, count_from_env, load_config
from app.limit_store import LIMITS_DIR_ENV, new_limits_dir
from engine.memory_dir import memory_dir
from engine.protocol import is_loopback_host


def _refuse(message: str) -> None:
    """Exit 2 with the message, as `python -m app serve` does for a configuration it refuses."""
    print(message, file=sys.stderr)
    sys.exit(2)


try:
    _cfg = load_config()
except ConfigError as exc:      # the reason alone, as `python -m app serve` prints it, not a traceback
    _refuse(f"error: {exc}")


# an IPv6 literal in brackets, as gunicorn parses an address
_host = f"[{_cfg.server.host}]" if ":" in _cfg.server.host and not _cfg.server.host.startswith("[") else _cfg.server.host
bind = f"{_host}:{_cfg.server.port}"
try:
    workers = count_from_env("GATEWAY_WORKERS", _cfg.server.workers)
    threads = count_from_env("GATEWAY_THREADS", _cfg.server.threads)
except ConfigError as exc:
    _refuse(f"error: {exc}")
worker_class = "engine.buffered_worker.BufferedThreadWorker"   # gthread; a thread takes a request once it is whole
timeout = 120            # heartbeat of the worker process, not a limit on stream length
graceful_timeout = 30    # on SIGTERM a worker stops accepting and open streams get this long to finish
keepalive = 5
accesslog = None         # the app logs each request as JSON


class GatewayLogger(Logger):
    """gunicorn's logger without the access log. With logconfig_dict set, gunicorn would build an
    access line's fields after every request only for the logger below to drop it."""

    def access(self, resp, req, environ, request_time):
        pass


logger_class = GatewayLogger
errorlog = "-"
logconfig_dict = {       # gunicorn's own messages as JSON lines too
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": "engine.logs.JsonFormatter", "context": "ext://app.logs.request_fields"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json",
                            "stream": "ext://sys.stderr"}},
    "root": {"level": "WARNING", "handlers": ["stderr"]},
    "loggers": {
        "gunicorn.error": {"level": "INFO", "handlers": ["stderr"], "propagate": False},
        # the app logs each request (with its org, model and timings); no second line from gunicorn
        "gunicorn.access": {"level": "WARNING", "handlers": ["stderr"], "propagate": False},
    },
}
# gunicorn >= 27 opens a control socket at one fixed path per user; several gateways (or a
# gateway and an engine node) on one host would fight over it.
control_socket_disable = True

# The workers' heartbeat, touched at every turn of a worker's event loop, in memory (engine/memory_dir.py).
# The metrics' mmapped files stay on disk: they grow with the orgs and models served, and a full /dev/shm
# (64 MB in a container) would kill a worker writing to them with SIGBUS.
worker_tmp_dir = memory_dir()
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="zen-gateway-metrics-")
_metrics_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"]

# Made before any worker forks, so all of them inherit it; only a directory made here is removed at exit.
_own_limits_dir = None
if _cfg.limits.uses_embedded and not os.environ.get(LIMITS_DIR_ENV):
    _own_limits_dir = os.environ[LIMITS_DIR_ENV] = new_limits_dir()


def _on_loopback(address: str) -> bool:
    """Whether a gunicorn bind address (HOST:PORT, [IPV6]:PORT, unix:PATH, fd://N) reaches this machine only."""
    if address.startswith("unix:"):
        return True
    if address.startswith("fd://"):
        return False   # a socket handed over: where it listens is unknown here
    host = address.rsplit(":", 1)[0] if address.rsplit(":", 1)[-1].isdigit() else address
    return is_loopback_host(host)


def on_starting(server):
    # The bind gunicorn ends with (the command line and GUNICORN_CMD_ARGS override the one above): with
    # the shipped secrets, only loopback, as the config's own check says for server.host
    exposed = [a for a in server.cfg.bind if not _on_loopback(a)]
    if exposed and _cfg.development_secrets_in_use():
        sys.exit(f"error: {_cfg.development_secrets_message('gunicorn bind ' + ', '.join(exposed))}")
    os.makedirs(_metrics_dir, exist_ok=True)
    for name in os.listdir(_metrics_dir):
        path = os.path.join(_metrics_dir, name)
        if os.path.isfile(path) and name.endswith(".db"):
            os.remove(path)


def post_worker_init(worker):
    """On SIGTERM, /ready answers 503 on the connections the worker still serves while it drains."""
    from app.health import draining
    stop = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        draining(worker.wsgi).set()
        stop(signum, frame)
    signal.signal(signal.SIGTERM, on_term)


def child_exit(server, worker):
    from prometheus_client import multiprocess
    multiprocess.mark_process_dead(worker.pid)


def on_exit(server):
    if _metrics_dir.startswith(tempfile.gettempdir()) and "zen-gateway-metrics-" in _metrics_dir:
        shutil.rmtree(_metrics_dir, ignore_errors=True)
    if _own_limits_dir:
        shutil.rmtree(_own_limits_dir, ignore_errors=True)
limit_request_field_size = 16384   # a JWT up to auth.max_token_bytes reaches the app (which answers 401 past it)
