"""GET /health: the gateway's liveness, with how many engine nodes it currently sees up."""
from __future__ import annotations

from flask import Blueprint, current_app, jsonify

bp = Blueprint("health", __name__)


@bp.get("/health")
def health():
    pool = current_app.extensions["zen.nodes"].pool
    pool.start()
    views = pool.snapshot()
    up = sum(1 for v in views if not v.down and v.state is not None and v.state.healthy)
    return jsonify({"status": "ok", "nodes_up": up, "nodes": len(views)})
