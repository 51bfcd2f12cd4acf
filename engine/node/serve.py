"""Running the node: under gunicorn (one worker: it owns the device; gthread for concurrent streams),
with JSON logs, libgomp's defaults for the kernel threads (docs/performance.md says why), and a drain on
SIGTERM before gunicorn stops the worker (docs/node-protocol.md, Shutdown)."""
from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading

from flask import Flask
from prometheus_client import disable_created_metrics

from engine.logs import JsonFormatter
from engine.memory_dir import memory_dir
from engine.node.app import create_app
from engine.node.config import NodeConfig

OPENMP_SPINCOUNT = "30000"      # libgomp's default kept a core spinning, taken from the gateway, after each burst
OPENMP_PROC_BIND = "close"      # an unbound kernel thread moved to a busy core stalls the whole parallel region
DRAIN_MARGIN_S = 15             # gunicorn's graceful_timeout beyond the drain: ending streams, closing the engine


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("engine")
    logger.handlers = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


def _worker_node(worker):
    app = getattr(worker, "wsgi", None)
    return app.extensions.get("zen_node") if isinstance(app, Flask) else None


def _worker_exit(server, worker) -> None:
    node = _worker_node(worker)
    if node is not None:
        node.close()


def _post_worker_init(worker) -> None:
    """SIGTERM drains the node before gunicorn's own handler stops the worker: meanwhile the worker keeps
    its listener, so /state and /ready say "draining" (the router learns it) and new generations get 503."""
    node = _worker_node(worker)
    stop = signal.getsignal(signal.SIGTERM)
    if node is None or not callable(stop):
        return

    began = threading.Event()

    def drain_then_stop(signum):
        node.drain_gracefully()
        stop(signum, None)

    def on_term(signum, frame):
        if not began.is_set():   # a second SIGTERM changes nothing: the drain has its deadline
            began.set()
            threading.Thread(target=drain_then_stop, args=(signum,), name="drain", daemon=True).start()
    signal.signal(signal.SIGTERM, on_term)


def bind_address(config: NodeConfig) -> str:
    """gunicorn's bind for the node: HOST:PORT, an IPv6 address in brackets."""
    host = f"[{config.host}]" if ":" in config.host else config.host
    return f"{host}:{config.port}"


def serve(config: NodeConfig) -> None:
    """Run the node under gunicorn: one worker (it owns the device), gthread for concurrent streams."""
    from gunicorn.app.base import BaseApplication

    class NodeApplication(BaseApplication):
        def load_config(self):
            settings = {
                "bind": bind_address(config), "workers": 1, "worker_class": "engine.buffered_worker.BufferedThreadWorker",
                "threads": config.threads, "timeout": 120, "keepalive": 5,
                "graceful_timeout": math.ceil(config.drain_grace_s) + DRAIN_MARGIN_S, "post_worker_init": _post_worker_init,
                "accesslog": None, "errorlog": "-", "loglevel": config.log_level, "preload_app": False,
                "worker_exit": _worker_exit, "proc_name": f"zen-node-{config.port}",
                "control_socket_disable": True,   # one node per port; no shared control socket
                "worker_tmp_dir": memory_dir(),    # the heartbeat file, touched at every turn of the event loop
            }
            for key, value in settings.items():
                self.cfg.set(key, value)

        def load(self):   # in the worker: threads, the device and the models belong to it
            configure_logging(config.log_level)
            disable_created_metrics()
            return create_app(config)

    openmp_defaults(os.environ)   # before the worker loads libgomp, which reads them once
    NodeApplication().run()


def openmp_defaults(environ) -> None:
    """libgomp's settings for the node's kernel threads, where the operator chose none. Threads are
    bound only when numba starts one per CPU the node may use: with fewer (several nodes sharing a
    host), libgomp would bind every node's threads to the same first CPUs."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = OPENMP_SPINCOUNT
    cpus = len(os.sched_getaffinity(0))
    if (not any(k in environ for k in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY"))
            and environ.get("NUMBA_NUM_THREADS", str(cpus)).strip() == str(cpus)):
        environ["OMP_PROC_BIND"] = OPENMP_PROC_BIND