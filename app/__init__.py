"""The gateway: a synchronous Flask app (served by gunicorn through wsgi.py).

`create_app(config=None)` builds it: defaults from config/default.toml (or ZEN_CONFIG),
secrets from the environment, then test overrides (`config` may be a GatewayConfig or a
dict merged over the file). Extensions are created bare and bound here, in the order
their request hooks must run: request id → the request's span → auth → rate limits → the views.
"""
from __future__ import annotations

from typing import Any, Mapping

from flask import Flask, g, request

from app.catalog import Catalog
from app.config import GatewayConfig, load_config


def create_app(config: GatewayConfig | Mapping[str, Any] | None = None) -> Flask:
    from app import api, auth, health, limits, metrics, openapi, tokenizer_api, tracing
    from app.errors import register_error_handlers
    from app.load_records import open_load_records
    from app.logs import configure_logging, init_request_logging
    from app.node_client import NodeClient
    from app.org_share import CONCURRENCY_KEY, OrgThreadShare
    from app.router import NodePool, load_record_hold_s

    cfg = config if isinstance(config, GatewayConfig) else load_config(overrides=config or None)
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = cfg.server.max_body_bytes
    app.json.sort_keys = False
    app.extensions["zen.config"] = cfg
    app.extensions["zen.catalog"] = Catalog(cfg.models)
    configure_logging(cfg.server.log_level)

    register_error_handlers(app)
    init_request_logging(app)           # 1. request id
    tracer = tracing.init_tracing(app, cfg)   # 2. the request's span (when tracing is on)
    auth.init_auth(app, cfg)            # 3. g.caller from the bearer token
    limits.init_limits(app, cfg)        # 4. requests per minute, token bucket
    app.extensions[CONCURRENCY_KEY] = OrgThreadShare(cfg.server)   # 5. an org's share of a worker's threads
    gateway_metrics = metrics.init_metrics(app, cfg)

    # the router records the loads it starts where the limits live: every worker and replica sees them
    records = open_load_records(cfg.limits.storage_url, app.extensions.get(limits.STORE_KEY),
                                load_record_hold_s(cfg.nodes), cfg.limits.redis_timeout_s)
    pool = NodePool(cfg.nodes, cfg.routing, records=records)
    client = NodeClient(pool, pool_size=max(8, cfg.server.threads * 2))
    client.on_failover = gateway_metrics.failover
    gateway_metrics.node_entry = pool.discovery.entry_of
    client.tracing = tracer
    app.extensions["zen.nodes"] = client

    app.register_blueprint(api.bp)
    app.register_blueprint(tokenizer_api.bp)
    app.register_blueprint(openapi.bp)
    app.register_blueprint(health.bp)

    @app.after_request
    def _count_request(response):
        if request.blueprint in limits.RATE_LIMITED_BLUEPRINTS and not response.is_streamed:
            org = g.get("org")
            gateway_metrics.request_done(org, request.endpoint or "none", response.status_code)
            if response.status_code == 429:
                gateway_metrics.limited(org, g.get("limited_by", "requests"))
        return response

    return app


def close_app(app: Flask) -> None:
    """Stop what create_app started (node poller, HTTP sessions, the embedded limits store, the span
    exporter)."""
    from app.limits import close_limits
    from app.tracing import close_tracing
    client = app.extensions.get("zen.nodes")
    if client is not None:
        client.pool.close()
        client.close()
    close_limits(app)
    close_tracing(app)
