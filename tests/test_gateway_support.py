"""Shared pieces of the gateway tests: the stand-in engine node (scripts/stand_in_node.py), token minting,
app fixtures.

This module holds no tests. Test modules import what they need from it, fixtures included.
"""
from __future__ import annotations

import pytest

from app import close_app, create_app
from scripts.local_processes import free_port, start_redis
from scripts.stand_in_node import (EOS_AFTER, JWT_SECRET, MODEL_ID, NODE_SECRET, TOKENS,  # noqa: F401
                                   StandInNode, bearer, make_config, overrides_for_tests)


# -- fixtures ----------------------------------------------------------------------------------

@pytest.fixture
def node():
    n = StandInNode().start()
    yield n
    n.stop()


@pytest.fixture
def gateway(node):
    """(app, config) with one stand-in node."""
    config = make_config([node.url])
    app = create_app(config)
    yield app, config
    close_app(app)


@pytest.fixture
def client(gateway):
    return gateway[0].test_client()


@pytest.fixture
def auth(gateway):
    return bearer(gateway[1])


# -- Redis ----------------------------------------------------------------------------------------

@pytest.fixture
def redis_url():
    port = free_port()
    proc = start_redis(port)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


# GET /metrics of a gateway on the shipped configuration (config/default.toml's metrics_token).
METRICS_HEADERS = {"Authorization": "Bearer zen-development-metrics-token"}
