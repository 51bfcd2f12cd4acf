"""Gateway metrics: prometheus-flask-exporter plus per-org and latency metrics.

Under gunicorn the environment variable PROMETHEUS_MULTIPROC_DIR is set (by
config/gunicorn.conf.py) before prometheus_client is imported; every worker then writes its
samples to that directory and GET /metrics on any worker aggregates all of them
(prometheus-flask-exporter's GunicornInternalPrometheusMetrics). Without it (tests, a
single process) the plain exporter serves the app's own registry.

Label values are bounded: `org` is one of the configured orgs, or "other" (an
unconfigured org) or "anonymous" (no valid token); `model` is a catalog alias or "none";
`node` is a configured node URL, or the dns+ entry under which discovery found the pod (pod
addresses change with every rollout), or "other".
"""
from __future__ import annotations

import hmac
import os
from typing import Callable

from flask import Flask, request
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_flask_exporter import PrometheusMetrics

from app.config import GatewayConfig
from app.errors import CLIENT_CLOSED
from engine.protocol import APIError

PREFIX = "zen_gateway"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 480.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0,
               480.0, 960.0)

OTHER_ORG = "other"
ANONYMOUS = "anonymous"


def multiprocess_mode() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"})
OTHER_METHOD = "OTHER"


def bounded_methods(wsgi_app):
    """The WSGI app with any method outside HTTP's own read as OTHER (which no route allows: a 405): the
    exporter labels its series with the method, and a client, no token needed, made a series of each
    method it invented."""
    def app(environ, start_response):
        if environ.get("REQUEST_METHOD") not in HTTP_METHODS:
            environ["REQUEST_METHOD"] = OTHER_METHOD
        return wsgi_app(environ, start_response)
    return app


def build_exporter() -> PrometheusMetrics:
    """prometheus-flask-exporter, created bare (bound later with init_app)."""
    # The generation routes have the gateway's own metrics: the exporter's would time a stream only to
    # its headers, and its hook would run while the node computes the first token (docs/serving.md).
    common = dict(group_by="endpoint", defaults_prefix=f"{PREFIX}_flask",
                  excluded_paths=["^/metrics$", "^/v1/completions$", "^/v1/chat/completions$"])
    if multiprocess_mode():
        from prometheus_flask_exporter.multiprocess import GunicornInternalPrometheusMetrics
        return GunicornInternalPrometheusMetrics.for_app_factory(**common)
    return PrometheusMetrics.for_app_factory(registry=CollectorRegistry(), **common)


class GatewayMetrics:
    """The gateway's own counters and histograms (one instance per app)."""

    def __init__(self, config: GatewayConfig, registry: CollectorRegistry) -> None:
        self._orgs = frozenset(config.orgs)
        self._models = frozenset(config.models)
        self._nodes = frozenset(config.nodes.urls)
        # the node URLs the router's discovery knows now (dns+ names resolved to pods): set by create_app
        self.node_entry: Callable[[str], str | None] = lambda url: None   # the discovery's entry_of
        by_org = ["org"]
        self.requests = Counter(f"{PREFIX}_org_requests", "Requests by org, endpoint and status (499: the client "
                                "left first).",
                                by_org + ["endpoint", "status"], registry=registry)
        self.prompt_tokens = Counter(f"{PREFIX}_org_prompt_tokens", "Prompt tokens by org and model.",
                                     by_org + ["model"], registry=registry)
        self.completion_tokens = Counter(f"{PREFIX}_org_completion_tokens",
                                         "Completion tokens by org and model.",
                                         by_org + ["model"], registry=registry)
        self.errors = Counter(f"{PREFIX}_org_errors", "Errors by org and status (stream errors "
                              "after the first token count as status `stream`; a client that left is none).",
                              by_org + ["status"], registry=registry)
        self.rate_limited = Counter(f"{PREFIX}_org_rate_limited",
                                    "Requests refused by a rate limit, by org and limit.",
                                    by_org + ["limit"], registry=registry)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Time to first token seen by the gateway (of a JSON answer: the node's own).",
                              ["model", "latency_class"], buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "Time between tokens of a stream seen by the gateway (streams only: a JSON "
                             "answer's tokens arrive at once).",
                             ["model", "latency_class"], buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds",
                             "End-to-end request latency at the gateway.",
                             ["model", "latency_class"], buckets=E2E_BUCKETS, registry=registry)
        self.node_attempts = Counter(f"{PREFIX}_node_failovers",
                                     "Node attempts that failed before the first token, by node "
                                     "and reason.", ["node", "reason"], registry=registry)

    # -- bounded labels --------------------------------------------------------------------

    def org_label(self, org: str | None) -> str:
        if org is None:
            return ANONYMOUS
        return org if org in self._orgs else OTHER_ORG

    def model_label(self, alias: str | None) -> str:
        return alias if alias in self._models else "none"

    def node_label(self, url: str) -> str:
        return url if url in self._nodes else self.node_entry(url) or "other"

    # -- recording -------------------------------------------------------------------------

    def request_done(self, org: str | None, endpoint: str, status: int | str) -> None:
        org_l = self.org_label(org)
        self.requests.labels(org_l, endpoint, str(status)).inc()
        if status == "stream" or (isinstance(status, int) and status >= 400 and status != CLIENT_CLOSED):
            self.errors.labels(org_l, str(status)).inc()

    def limited(self, org: str | None, limit: str) -> None:
        self.rate_limited.labels(self.org_label(org), limit).inc()

    def usage(self, org: str | None, alias: str, prompt_tokens: int, completion_tokens: int) -> None:
        org_l, model_l = self.org_label(org), self.model_label(alias)
        if prompt_tokens > 0:
            self.prompt_tokens.labels(org_l, model_l).inc(prompt_tokens)
        if completion_tokens > 0:
            self.completion_tokens.labels(org_l, model_l).inc(completion_tokens)

    def latency(self, alias: str, latency_class: str, *, ttft_s: float | None = None,
                itl_s: float | None = None, e2e_s: float | None = None) -> None:
        labels = (self.model_label(alias), latency_class)
        if ttft_s is not None and ttft_s >= 0:
            self.ttft.labels(*labels).observe(ttft_s)
        if itl_s is not None and itl_s >= 0:
            self.itl.labels(*labels).observe(itl_s)
        if e2e_s is not None and e2e_s >= 0:
            self.e2e.labels(*labels).observe(e2e_s)

    def failover(self, node: str, reason: str) -> None:
        self.node_attempts.labels(self.node_label(node), reason).inc()


def init_metrics(app: Flask, config: GatewayConfig) -> GatewayMetrics:
    token = config.server.metrics_token
    if token:
        expected = f"Bearer {token}".encode()

        @app.before_request
        def _metrics_need_the_token():
            # Per-org counters are other orgs' business: a caller's own JWT does not open them.
            if request.path == "/metrics" and not hmac.compare_digest(
                    request.headers.get("Authorization", "").encode(), expected):
                raise APIError(401, "GET /metrics needs the metrics token (Authorization: Bearer <metrics_token>)",
                               code="invalid_metrics_token")

    exporter = build_exporter()
    exporter.init_app(app)
    app.wsgi_app = bounded_methods(app.wsgi_app)
    metrics = GatewayMetrics(config, exporter.registry)
    app.extensions["zen.metrics"] = metrics
    app.extensions["zen.exporter"] = exporter
    return metrics
