"""GET /health (the gateway's liveness) and GET /ready (whether it should take traffic: it sees at least
one engine node ready, and it is not draining). Both unauthenticated."""
from __future__ import annotations

import threading

from flask import Blueprint, Flask, current_app, jsonify

bp = Blueprint("health", __name__)

RETRY_AFTER_S = 2


def draining(app: Flask) -> threading.Event:
    """Set once the worker has been told to stop (gunicorn's SIGTERM, config/gunicorn.conf.py)."""
    return app.extensions.setdefault("zen.draining", threading.Event())


@bp.get("/health")
def health():
    pool = current_app.extensions["zen.nodes"].pool
    return jsonify({"status": "ok", "nodes_up": pool.count_ready(refresh=False), "nodes": len(pool.snapshot())})


@bp.get("/ready")
def ready():
    pool = current_app.extensions["zen.nodes"].pool
    up, total = pool.count_ready(), len(pool.snapshot())
    if draining(current_app).is_set():
        status, reason = "draining", "the gateway is shutting down"
    elif up == 0:
        status, reason = "no_ready_node", f"none of the {total} configured engine nodes is ready"
    else:
        return jsonify({"status": "ready", "nodes_up": up, "nodes": total})
    resp = jsonify({"status": status, "reason": reason, "nodes_up": up, "nodes": total})
    resp.status_code = 503
    resp.headers["Retry-After"] = str(RETRY_AFTER_S)
    return resp
