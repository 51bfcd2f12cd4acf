"""Public keys from a JWKS URL: accepted tokens, and how often the gateway fetches the URL. A real
JWKS server on loopback counts its fetches; the key set's clock is a test clock."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from app import close_app, create_app, jwks
from scripts.stand_in_node import serve_in_thread, stop_serving
from tests.test_gateway_auth import _assert_401, _claims, _get
from tests.test_gateway_support import JWT_SECRET, make_config

INTERVAL_S = 60.0


def _public_jwk(private_key, kid: str, alg: str) -> dict:
    to_jwk = jwt.algorithms.RSAAlgorithm if alg.startswith("RS") else jwt.algorithms.ECAlgorithm
    out = json.loads(to_jwk.to_jwk(private_key.public_key()))
    out.update(kid=kid, alg=alg, use="sig")
    return out


@pytest.fixture(scope="module")
def keys():
    return {"rsa": rsa.generate_private_key(public_exponent=65537, key_size=2048),
            "rsa2": rsa.generate_private_key(public_exponent=65537, key_size=2048),
            "ec": ec.generate_private_key(ec.SECP256R1())}


class JwksServer:
    """Serves `keys` (or `body`, when set) at /jwks.json on loopback with `status`, counting the fetches."""

    def __init__(self, keys: list[dict]) -> None:
        self.keys, self.status, self.fetches = list(keys), 200, 0
        self.body: bytes | None = None
        self.during_fetch = lambda: None   # run while a fetch is answered (a test moves its clock)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.fetches += 1
                owner.during_fetch()
                body = owner.body if owner.body is not None else json.dumps({"keys": owner.keys}).encode()
                self.send_response(owner.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self._server = serve_in_thread(Handler)
        self.url = f"http://127.0.0.1:{self._server.server_port}/jwks.json"

    def close(self) -> None:
        stop_serving(self._server)


@pytest.fixture
def jwks_server(keys):
    server = JwksServer([_public_jwk(keys["rsa"], "rsa-1", "RS256"),
                         _public_jwk(keys["ec"], "ec-1", "ES256")])
    yield server
    server.close()


@pytest.fixture
def clock(monkeypatch):
    """The key set's monotonic clock, moved by the test: now[0] += seconds."""
    now = [1000.0]
    monkeypatch.setattr(jwks, "monotonic", lambda: now[0])
    return now


@pytest.fixture
def client(jwks_server, clock):
    app = create_app(make_config([], auth={"jwks_url": jwks_server.url, "algorithms": ["RS256", "ES256"],
                                           "jwks_refetch_interval_s": INTERVAL_S}))
    yield app.test_client()
    close_app(app)


def _rs256(key, kid: str, **claims) -> str:
    return jwt.encode(_claims(**claims), key, algorithm="RS256", headers={"kid": kid})


def test_jwks_from_a_url(keys, jwks_server, client):
    rs = jwt.encode(_claims(), keys["rsa"], algorithm="RS256", headers={"kid": "rsa-1"})
    assert _get(client, rs).status_code == 200
    es = jwt.encode(_claims(), keys["ec"], algorithm="ES256", headers={"kid": "ec-1"})
    assert _get(client, es).status_code == 200
    _assert_401(_get(client, jwt.encode(_claims(), keys["rsa"], algorithm="RS256",
                                        headers={"kid": "ec-1"})), "unknown key")
    _assert_401(_get(client, jwt.encode(_claims(), JWT_SECRET, algorithm="HS256")),
                "'HS256' is not allowed")


def test_a_key_without_a_kid_verifies_tokens_without_one(keys, jwks_server, client):
    # as from a jwks_file: a set with one RSA key and no kids
    jwks_server.keys = [{k: v for k, v in _public_jwk(keys["rsa"], "x", "RS256").items() if k != "kid"}]
    assert _get(client, jwt.encode(_claims(), keys["rsa"], algorithm="RS256")).status_code == 200


def test_unknown_kids_are_refetched_at_most_once_per_interval(keys, jwks_server, client, clock):
    assert _get(client, _rs256(keys["rsa"], "rsa-1")).status_code == 200
    assert jwks_server.fetches == 1
    for i in range(20):                        # made-up key ids: 401s, no fetches
        clock[0] += 1.0
        _assert_401(_get(client, _rs256(keys["rsa2"], f"attacker-{i}")), "unknown key")
    assert jwks_server.fetches == 1
    # the identity provider rotates its keys: the new kid is fetched once the interval has passed
    jwks_server.keys.append(_public_jwk(keys["rsa2"], "rsa-2", "RS256"))
    rotated = _rs256(keys["rsa2"], "rsa-2")
    _assert_401(_get(client, rotated), "unknown key")
    assert jwks_server.fetches == 1
    clock[0] += INTERVAL_S
    assert _get(client, rotated).status_code == 200
    assert jwks_server.fetches == 2
    for i in range(20):
        _assert_401(_get(client, _rs256(keys["rsa2"], f"attacker-again-{i}")), "unknown key")
    assert jwks_server.fetches == 2
    assert _get(client, _rs256(keys["rsa"], "rsa-1", sub="still-known")).status_code == 200
    assert jwks_server.fetches == 2


def test_an_unreachable_jwks_is_fetched_at_most_once_per_interval(keys, jwks_server, client, clock):
    jwks_server.status = 503
    for i in range(20):
        _assert_401(_get(client, _rs256(keys["rsa"], "rsa-1", sub=f"user-{i}")), "unknown key")
    assert jwks_server.fetches == 1
    jwks_server.status = 200
    clock[0] += INTERVAL_S / 2
    _assert_401(_get(client, _rs256(keys["rsa"], "rsa-1", sub="early")), "unknown key")
    assert jwks_server.fetches == 1
    clock[0] += INTERVAL_S / 2
    assert _get(client, _rs256(keys["rsa"], "rsa-1", sub="after")).status_code == 200
    assert jwks_server.fetches == 2


@pytest.mark.parametrize("body", [b"<html>not json</html>", b'{"keys": []}', b'{"keys": [{"kty": "RSA"}]}',
                                  b"[]"])
def test_a_jwks_that_is_not_one_is_a_401(keys, jwks_server, client, body):
    jwks_server.body = body
    _assert_401(_get(client, _rs256(keys["rsa"], "rsa-1")), "unknown key")
    assert jwks_server.fetches == 1


def test_a_failed_refresh_keeps_the_keys_it_had(keys, jwks_server, client, clock):
    assert _get(client, _rs256(keys["rsa"], "rsa-1")).status_code == 200
    jwks_server.status = 500
    clock[0] += jwks.JWKS_LIFESPAN_S              # stale: refetched, and the fetch fails
    assert _get(client, _rs256(keys["rsa"], "rsa-1", sub="during-outage")).status_code == 200
    assert jwks_server.fetches == 2
    clock[0] += 1.0
    assert _get(client, _rs256(keys["rsa"], "rsa-1", sub="still-during-outage")).status_code == 200
    assert jwks_server.fetches == 2
    # a key withdrawn from the set stops verifying at the next successful fetch
    jwks_server.status = 200
    jwks_server.keys = [_public_jwk(keys["ec"], "ec-1", "ES256")]
    clock[0] += INTERVAL_S
    _assert_401(_get(client, _rs256(keys["rsa"], "rsa-1", sub="withdrawn")), "unknown key")
    assert jwks_server.fetches == 3


def test_a_slow_fetch_is_not_repeated_by_those_who_waited_for_it(keys, jwks_server, clock):
    key_set = jwks.RemoteKeySet(jwks_server.url, INTERVAL_S)
    arrived = threading.Barrier(9)

    def slow():   # the fetch outlasts the refetch interval (the other lookups queue up meanwhile)
        clock[0] += 2 * INTERVAL_S
        time.sleep(0.2)
    jwks_server.during_fetch = slow
    results: list[list[str]] = []

    def look_up(kid: str) -> None:
        arrived.wait(10)
        results.append([k.key_id for k in key_set.keys(kid)])

    threads = [threading.Thread(target=look_up, args=(f"kid-{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    arrived.wait(10)
    for t in threads:
        t.join(30)
    assert jwks_server.fetches == 1 and len(results) == 8


def test_concurrent_unknown_kids_cost_one_fetch(keys, jwks_server, clock):
    key_set = jwks.RemoteKeySet(jwks_server.url, INTERVAL_S)
    results: list[list[str]] = []

    def look_up(kid: str) -> None:
        results.append([k.key_id for k in key_set.keys(kid)])

    threads = [threading.Thread(target=look_up, args=(f"kid-{i}",)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert jwks_server.fetches == 1
    assert all(sorted(r) == ["ec-1", "rsa-1"] for r in results) and len(results) == 16


def test_a_key_serves_only_the_algorithm_its_set_publishes(keys, jwks_server, clock):
    """rsa-1 is published for RS256: an RS384 token it signed is refused. rsa-2 publishes no algorithm:
    any RSA one verifies with it. An encryption key and members that are no keys are left out."""
    unnamed = {k: v for k, v in _public_jwk(keys["rsa2"], "rsa-2", "RS256").items() if k != "alg"}
    jwks_server.keys = [_public_jwk(keys["rsa"], "rsa-1", "RS256"), unnamed,
                        dict(_public_jwk(keys["rsa"], "rsa-enc", "RS256"), use="enc"), "not a key", {"kty": "RSA"},
                        dict(_public_jwk(keys["rsa"], "rsa-odd", "RS256"), alg=["RS256"])]   # a field mistyped
    app = create_app(make_config([], auth={"jwks_url": jwks_server.url, "algorithms": ["RS256", "RS384"],
                                           "jwks_refetch_interval_s": INTERVAL_S}))
    try:
        client = app.test_client()
        sign = lambda key, kid, alg: jwt.encode(_claims(), keys[key], algorithm=alg, headers={"kid": kid})  # noqa: E731
        assert _get(client, sign("rsa", "rsa-1", "RS256")).status_code == 200
        _assert_401(_get(client, sign("rsa", "rsa-1", "RS384")), "does not match its key")
        assert _get(client, sign("rsa2", "rsa-2", "RS384")).status_code == 200
        _assert_401(_get(client, sign("rsa", "rsa-enc", "RS256")), "unknown key")
    finally:
        close_app(app)
    assert [(k.key_id, k.alg) for k in jwks.signing_keys({"keys": jwks_server.keys})] == [
        ("rsa-1", "RS256"), ("rsa-2", None)]
    with pytest.raises(jwt.exceptions.PyJWKSetError):
        jwks.signing_keys({"keys": [{"kty": "RSA"}]})
