"""docs/metrics.md against the metrics the gateway and a node export: the same names, of the same types."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from app import close_app, create_app
from app.limits import STORAGE_FAILURES
from engine.node.app import create_app as create_node_app
from engine.node.config import ModelSpec, NodeConfig
from scripts.stand_in_node import StandInNode, make_config
from tests.test_gateway_support import METRICS_HEADERS

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
# present only where the platform reports them (docs/metrics.md says so)
PLATFORM_ONLY = {"zen_node_accelerator_power_watts", "zen_node_accelerator_temperature_celsius"}


def _families(exposition: str) -> dict[str, str]:
    """name -> type of every family in a text exposition (not the `_created` gauges of counters)."""
    return {name: kind for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.M)
            if not name.endswith("_created")}


def _documented() -> dict[str, str]:
    rows = re.findall(r"^\| `(zen_\w+)` \| (\w+) \|", DOC.read_text(), re.M)
    assert len(rows) == len(dict(rows)), "a metric listed twice"
    return dict(rows)


@pytest.fixture(scope="module")
def exported() -> dict[str, str]:
    node = StandInNode().start()
    gateway = create_app(make_config([node.url]))
    engine_node = create_node_app(NodeConfig(models=[ModelSpec("model.gguf", "model")], backend="cpu"), start=False)
    try:
        families = _families(gateway.test_client().get("/metrics", headers=METRICS_HEADERS).get_data(as_text=True))
        families |= _families(engine_node.test_client().get("/metrics").get_data(as_text=True))
    finally:
        close_app(gateway)
        node.stop()
        engine_node.extensions["zen_node"].close()
    # counted in the multiprocess files under gunicorn only (unregistered in a test's app)
    families[STORAGE_FAILURES._name + "_total"] = STORAGE_FAILURES._type
    return families


def test_every_exported_metric_is_documented_with_its_type(exported):
    documented = _documented()
    assert {n: t for n, t in exported.items() if documented.get(n) != t} == {}


def test_every_documented_metric_is_exported(exported):
    assert set(_documented()) - set(exported) - PLATFORM_ONLY == set()
