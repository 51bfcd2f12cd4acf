"""Node discovery by DNS (app/discovery.py): dns+http:// names become one node per address, nodes
come and go as the answers change, and a gateway routes to a node it found by name."""
from __future__ import annotations

import datetime
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from app.config import ConfigError, NodesConfig, RoutingConfig, load_config
from app.discovery import NameNotFound, NodeDiscovery, address_url, resolve_addresses
from app.devtoken import mint_token
from app.node_client import NodeClient
from app.router import NodePool
from scripts.stand_in_node import NODE_SECRET, StandInNode
from tests.node_fixtures import free_port, start_node, tiny_models  # noqa: F401 (fixtures)
from tests.serving_fixtures import gateway_config, launch_gateway

ROOT = Path(__file__).resolve().parents[1]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ChangingResolver:
    """A resolver stub whose answer the test changes; records what it was asked."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.asked: list[tuple[str, int]] = []

    def __call__(self, host: str, port: int):
        self.asked.append((host, port))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return list(self.answer)


def test_a_name_becomes_one_node_per_address_ipv4_and_ipv6():
    resolver = ChangingResolver(["10.0.0.5", "fd00::7"])
    found = NodeDiscovery(["dns+http://zen-node.zen.svc.cluster.local:8001"], 10.0, resolver)
    assert found.urls() == ["http://10.0.0.5:8001", "http://[fd00::7]:8001"]
    assert resolver.asked == [("zen-node.zen.svc.cluster.local", 8001)]


def test_names_are_resolved_again_only_after_dns_refresh_s():
    clock, resolver = FakeClock(), ChangingResolver(["10.0.0.1"])
    found = NodeDiscovery(["dns+http://nodes:8001"], 10.0, resolver, clock)
    assert found.urls() == ["http://10.0.0.1:8001"]
    resolver.answer = ["10.0.0.1", "10.0.0.2"]
    clock.now += 9.9
    assert found.urls() == ["http://10.0.0.1:8001"]
    clock.now += 0.1
    assert found.urls() == ["http://10.0.0.1:8001", "http://10.0.0.2:8001"]
    assert len(resolver.asked) == 2


def test_plain_urls_are_kept_as_they_are_beside_names():
    resolver = ChangingResolver(["10.0.0.3"])
    found = NodeDiscovery(["http://127.0.0.1:8001", "dns+https://nodes:9443"], 10.0, resolver)
    assert found.known() == ["http://127.0.0.1:8001"]           # nothing resolved yet
    assert found.urls() == ["http://127.0.0.1:8001", "https://10.0.0.3:9443"]
    assert not NodeDiscovery(["http://127.0.0.1:8001"], 10.0, resolver).dynamic


def test_a_name_that_is_gone_stands_for_no_node_and_a_dns_failure_keeps_the_last_answer():
    clock, resolver = FakeClock(), ChangingResolver(["10.0.0.1", "10.0.0.2"])
    found = NodeDiscovery(["dns+http://nodes:8001"], 1.0, resolver, clock)
    assert len(found.urls()) == 2
    resolver.answer, clock.now = OSError("temporary failure in name resolution"), clock.now + 1
    assert found.urls() == ["http://10.0.0.1:8001", "http://10.0.0.2:8001"]
    resolver.answer, clock.now = NameNotFound("nodes: Name or service not known"), clock.now + 1
    assert found.urls() == []


def test_a_malformed_entry_stands_for_no_node_and_the_others_are_still_resolved():
    """A dns+ entry with a bad port (in a NodeDiscovery built without the config's check) is logged and
    skipped, each time the names are resolved; it does not stop the names after it."""
    clock, resolver = FakeClock(), ChangingResolver(["10.0.0.4"])
    found = NodeDiscovery(["dns+http://localhost:80O1", "dns+http://nodes:99999", "dns+http://nodes:8001"],
                          1.0, resolver, clock)
    assert found.urls() == ["http://10.0.0.4:8001"]
    assert resolver.asked == [("nodes", 8001)]
    resolver.answer, clock.now = ["10.0.0.4", "10.0.0.5"], clock.now + 1
    assert found.urls() == ["http://10.0.0.4:8001", "http://10.0.0.5:8001"]


def test_node_pool_adds_and_drops_nodes_as_the_answers_change():
    port = free_port()     # nothing listens there: every poll is refused at once
    clock, resolver = FakeClock(), ChangingResolver(["127.0.0.2", "127.0.0.3"])
    nodes = NodesConfig(urls=(f"dns+http://zen-node:{port}",), dns_refresh_s=5.0, connect_timeout_s=0.5)
    pool = NodePool(nodes, RoutingConfig(), clock=clock, resolver=resolver)
    try:
        assert pool.snapshot() == []
        pool.refresh()
        assert [v.url for v in pool.snapshot()] == [f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}"]
        assert all(v.down and v.last_error for v in pool.snapshot())

        resolver.answer, clock.now = ["127.0.0.3", "127.0.0.4"], clock.now + 5.0
        pool.refresh()
        assert [v.url for v in pool.snapshot()] == [f"http://127.0.0.3:{port}", f"http://127.0.0.4:{port}"]
        # a request that ends on a dropped node (its stream was in flight) marks nothing
        pool.mark_down(f"http://127.0.0.2:{port}", "ConnectionResetError")
        assert f"http://127.0.0.2:{port}" not in [v.url for v in pool.snapshot()]

        resolver.answer, clock.now = [], clock.now + 5.0
        pool.refresh()
        assert pool.snapshot() == []
    finally:
        pool.close()


class FakeConnection:
    closed = False

    def close(self) -> None:
        self.closed = True


class FakeResponse(FakeConnection):
    will_close = False

    def isclosed(self) -> bool:
        return True


def test_a_resolver_that_hangs_holds_up_neither_the_polls_nor_other_callers():
    """Once the name was answered, a lookup that hangs (a DNS server's timeouts) leaves the nodes known so
    far polled and routable, and other callers get the last answer at once."""
    node = StandInNode().start()
    answered, hang = threading.Event(), threading.Event()

    def resolver(host, port):
        if answered.is_set():
            hang.wait(30)
        answered.set()
        return ["127.0.0.1"]
    clock = FakeClock()
    nodes = NodesConfig(urls=(f"dns+http://zen-node:{node.port}",), secret=NODE_SECRET, dns_refresh_s=5.0)
    pool = NodePool(nodes, RoutingConfig(), clock=clock, resolver=resolver)
    try:
        pool.refresh()
        assert [v.url for v in pool.snapshot()] == [node.url] and not pool.snapshot()[0].down
        clock.now += 5.0
        polls = node.state_polls
        started = time.monotonic()
        pool.refresh()                                   # its lookup hangs on a poll thread
        assert time.monotonic() - started < 5 and node.state_polls == polls + 1
        started = time.monotonic()
        assert pool.discovery.urls() == [node.url] and time.monotonic() - started < 1
    finally:
        hang.set()
        pool.close()
        node.stop()


_EXIT_DURING_A_HANGING_LOOKUP = """
import time
from app.config import NodesConfig, RoutingConfig
from app.router import NodePool
now, calls = [0.0], []
def resolver(host, port):
    calls.append(1)
    if len(calls) > 1:
        time.sleep(60)                  # getaddrinfo's timeouts
    return ["127.0.0.1"]
pool = NodePool(NodesConfig(urls=("dns+http://zen-node:9",), dns_refresh_s=5.0, connect_timeout_s=0.2),
                RoutingConfig(), clock=lambda: now[0], resolver=resolver)
pool.refresh()
now[0] += 5.0
pool.refresh()
pool.close()
"""


def test_a_worker_exits_while_a_lookup_hangs():
    """The lookup runs on a daemon thread: a gateway worker that stops meanwhile is not held until it ends."""
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _EXIT_DURING_A_HANGING_LOOKUP], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert time.monotonic() - started < 30


def test_the_poller_keeps_a_connection_pool_for_every_discovered_pod():
    """Six pods under one dns+ name: six pools kept (sized by the config's one entry, the poller dropped a
    pool at each poll, and connected again)."""
    clock, resolver = FakeClock(), ChangingResolver([f"127.0.0.{i}" for i in range(2, 8)])
    pool = NodePool(NodesConfig(urls=("dns+http://zen-node:9",), connect_timeout_s=0.2), RoutingConfig(),
                    clock=clock, resolver=resolver)
    try:
        pool.refresh()
        pool.refresh()
        assert len(pool._http.pools) == 6
    finally:
        pool.close()


def test_node_client_connects_to_discovered_nodes_and_lets_go_of_dropped_ones():
    clock, resolver = FakeClock(), ChangingResolver(["127.0.0.2"])
    pool = NodePool(NodesConfig(urls=("dns+http://zen-node:8001",)), RoutingConfig(), clock=clock,
                    resolver=resolver)
    client = NodeClient(pool, pool_size=4)
    try:
        pool.refresh()
        first = client._connections_of("http://127.0.0.2:8001")
        assert (first.host, first.port) == ("127.0.0.2", 8001)
        client.faults.served("http://127.0.0.3:8001", ["http://127.0.0.2:8001"] * 3)   # passed over
        resolver.answer, clock.now = ["127.0.0.3"], clock.now + 10.0
        pool.refresh()
        client._connections_of("http://127.0.0.3:8001")
        assert set(client._connections) == {"http://127.0.0.3:8001"}
        assert not client.faults._until                   # nor is anything held against the dropped node
        # the stream that was in flight on the dropped node ends: its connection is closed, not kept
        conn = FakeConnection()
        client.release("http://127.0.0.2:8001", conn, FakeResponse())
        assert conn.closed
    finally:
        pool.close()
        client.close()


def test_getaddrinfo_gives_the_addresses_of_localhosts_first_family():
    port = free_port()
    infos = socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM)
    expected = {info[4][0] for info in infos if info[0] == infos[0][0]}
    found = NodeDiscovery([f"dns+http://localhost:{port}"], 10.0)
    assert set(found.urls()) == {address_url("http", a, port) for a in expected}


def test_a_dual_stack_name_counts_each_pod_once(monkeypatch):
    def dual_stack(host, port, type=0):
        v4 = [(socket.AF_INET, type, 6, "", (f"10.0.0.{i}", port)) for i in (1, 2)]
        v6 = [(socket.AF_INET6, type, 6, "", (f"fd00::{i}", port, 0, 0)) for i in (1, 2)]
        return [v6[0], v4[0], v6[1], v4[1]]
    monkeypatch.setattr(socket, "getaddrinfo", dual_stack)
    assert NodeDiscovery(["dns+http://zen-node:8001"], 10.0).urls() == [
        "http://[fd00::1]:8001", "http://[fd00::2]:8001"]


def test_getaddrinfo_answers_ipv6_in_brackets_and_unknown_names_as_not_found():
    assert NodeDiscovery(["dns+http://[::1]:8001"], 10.0).urls() == ["http://[::1]:8001"]
    with pytest.raises(NameNotFound):
        resolve_addresses("no-such-node.invalid", 8001)


def test_config_accepts_dns_names_and_validates_the_refresh():
    cfg = load_config(env={"ZEN_NODES": "dns+http://zen-node.zen.svc.cluster.local:8001"})
    assert cfg.nodes.urls == ("dns+http://zen-node.zen.svc.cluster.local:8001",)
    assert cfg.nodes.dns_refresh_s == 10.0
    with pytest.raises(ConfigError, match="dns_refresh_s"):
        NodesConfig(urls=("dns+http://nodes:8001",), dns_refresh_s=0)
    with pytest.raises(ConfigError, match="nodes.urls"):
        NodesConfig(urls=("dns+ftp://nodes:8001",))


@pytest.mark.slow
def test_gateway_routes_to_a_node_found_by_name(start_node, tiny_models, tmp_path):
    node_url = start_node([tiny_models["a"] + "=tiny-a"], secret="serving-tests-node-secret")
    port = node_url.rsplit(":", 1)[1]
    config = gateway_config({"nodes": {"dns_refresh_s": 0.5}})
    gateway = launch_gateway(config, node_urls=[f"dns+http://localhost:{port}"], log_dir=str(tmp_path),
                             wait_nodes=1)
    ok = False
    try:
        token = mint_token(gateway.config, "loadco")
        r = requests.post(gateway.url + "/v1/completions", headers={"Authorization": f"Bearer {token}"},
                          json={"model": "zen-tiny", "prompt": "hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        # /ready polls in whichever worker answers; /health reads a view the worker may not have built yet
        assert requests.get(gateway.url + "/ready", timeout=10).json()["nodes_up"] == 1
        ok = True
    finally:
        if not ok:
            print("---- gateway log (tail)\n" + gateway.log()[-6000:])
        gateway.stop()


def _certificate(name: str, issuer: x509.Name, key, signer, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=1))
               .not_valid_after(now + datetime.timedelta(hours=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
    return builder.sign(signer, hashes.SHA256())


@pytest.fixture
def node_tls(tmp_path, monkeypatch):
    """A server context whose certificate names only `zen-node.zen.test` (no address), from a CA the
    gateway's default TLS contexts trust (SSL_CERT_FILE)."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("zen test CA", None, ca_key, ca_key, ca=True)
    cert = _certificate("zen-node.zen.test", ca.subject, key, ca_key, ca=False)
    (tmp_path / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "node.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tmp_path / "node.pem")
    return tls


@pytest.mark.parametrize("name, verified", [("zen-node.zen.test", True), ("other.zen.test", False)])
def test_a_dns_https_node_is_verified_against_the_name_it_was_found_under(node_tls, name, verified):
    node = StandInNode(node_id="tls-node", tls=node_tls).start()
    nodes = NodesConfig(urls=(f"dns+https://{name}:{node.port}",), secret=NODE_SECRET, connect_timeout_s=2.0)
    pool = NodePool(nodes, RoutingConfig(), resolver=ChangingResolver(["127.0.0.1"]))
    client = NodeClient(pool, pool_size=2)
    try:
        pool.refresh()
        [view] = pool.snapshot()
        assert view.url == f"https://127.0.0.1:{node.port}"
        connections = client._connections_of(view.url)
        if verified:   # the state poll (urllib3) and the requests' connections (http.client) both
            assert not view.down and view.state.node_id == "tls-node"
            conn = connections.connect()
            conn.request("GET", "/health")
            assert conn.getresponse().status == 200
            conn.close()
        else:          # the certificate does not name what the gateway looked up
            assert view.down and "CERTIFICATE_VERIFY_FAILED" in view.last_error
            with pytest.raises(ssl.SSLCertVerificationError):
                connections.connect()
    finally:
        client.close()
        pool.close()
        node.stop()
