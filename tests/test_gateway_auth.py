"""JWT authentication of the gateway: what is accepted, and every way a token is refused."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from app import close_app, create_app
from app.devtoken import mint_token
from tests.test_gateway_support import METRICS_HEADERS, JWT_SECRET, bearer, make_config

ISS, AUD = "zen-dev", "zen-gateway"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _claims(**over):
    now = int(time.time())
    claims = {"owner": "acme", "iss": ISS, "aud": AUD, "iat": now, "nbf": now, "exp": now + 600}
    claims.update(over)
    return {k: v for k, v in claims.items() if v is not None}


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    rsa_jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_key.public_key()))
    ec_jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(ec_key.public_key()))
    rsa_jwk.update(kid="rsa-1", alg="RS256", use="sig")
    ec_jwk.update(kid="ec-1", alg="ES256", use="sig")
    path = tmp_path_factory.mktemp("jwks") / "jwks.json"
    path.write_text(json.dumps({"keys": [rsa_jwk, ec_jwk]}))
    rsa_public_pem = rsa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return {"rsa": rsa_key, "ec": ec_key, "jwks": str(path), "rsa_public_pem": rsa_public_pem}


@pytest.fixture(scope="module")
def client(keys):
    cfg = make_config([], auth={"jwks_file": keys["jwks"], "algorithms": ["HS256", "RS256", "ES256"]})
    app = create_app(cfg)
    yield app.test_client()
    close_app(app)


def _get(client, token: str | None, header: str | None = None):
    headers = {}
    if header is not None:
        headers["Authorization"] = header
    elif token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return client.get("/v1/models", headers=headers)


def _assert_401(resp, words: str):
    assert resp.status_code == 401, resp.data
    err = resp.get_json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    assert words in err["message"], err["message"]
    assert "Traceback" not in resp.get_data(as_text=True)
    # never which key was tried
    assert JWT_SECRET not in err["message"] and "rsa-1" not in err["message"]
    assert "ec-1" not in err["message"]
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")


def test_valid_hs256_rs256_es256_tokens_are_accepted(client, keys):
    hs = jwt.encode(_claims(), JWT_SECRET, algorithm="HS256")
    rs = jwt.encode(_claims(), keys["rsa"], algorithm="RS256", headers={"kid": "rsa-1"})
    es = jwt.encode(_claims(), keys["ec"], algorithm="ES256", headers={"kid": "ec-1"})
    es_no_kid = jwt.encode(_claims(), keys["ec"], algorithm="ES256")  # the only EC key
    for token in (hs, rs, es, es_no_kid):
        resp = _get(client, token)
        assert resp.status_code == 200, resp.get_json()


def test_missing_and_malformed_headers(client):
    _assert_401(_get(client, None), "missing bearer token")
    _assert_401(_get(client, None, header="Basic dXNlcjpwYXNz"), "Bearer <token>")
    _assert_401(_get(client, None, header="Bearer"), "Bearer <token>")
    _assert_401(_get(client, "garbage"), "malformed")
    _assert_401(_get(client, "a.b.c"), "malformed")


def test_alg_none_is_refused(client):
    token = _b64(json.dumps({"alg": "none", "typ": "JWT"}).encode()) + "." + \
        _b64(json.dumps(_claims()).encode()) + "."
    _assert_401(_get(client, token), "algorithm 'none' is not allowed")


def test_hs256_signed_with_the_rs256_public_key_is_refused(client, keys):
    # The classic key-confusion attack: HMAC over the token with the public key as secret.
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "rsa-1"}).encode())
    payload = _b64(json.dumps(_claims()).encode())
    sig = hmac.new(keys["rsa_public_pem"], f"{header}.{payload}".encode(), hashlib.sha256).digest()
    _assert_401(_get(client, f"{header}.{payload}.{_b64(sig)}"), "signature is invalid")


def test_hs256_refused_outright_when_only_public_key_algorithms_are_allowed(keys):
    cfg = make_config([], auth={"jwks_file": keys["jwks"], "algorithms": ["RS256"]})
    app = create_app(cfg)
    try:
        header = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
        payload = _b64(json.dumps(_claims()).encode())
        sig = hmac.new(keys["rsa_public_pem"], f"{header}.{payload}".encode(), hashlib.sha256).digest()
        _assert_401(_get(app.test_client(), f"{header}.{payload}.{_b64(sig)}"),
                    "algorithm 'HS256' is not allowed")
    finally:
        close_app(app)


@pytest.mark.parametrize("claims, words", [
    (dict(exp=int(time.time()) - 3600), "expired"),
    (dict(nbf=int(time.time()) + 3600), "not yet valid"),
    (dict(iss="someone-else"), "issuer"),
    (dict(aud="another-service"), "audience"),
    (dict(exp=None), "missing the required `exp` claim"),
    (dict(owner=None), "missing the `owner` claim"),
    (dict(owner=""), "missing the `owner` claim"),
    (dict(owner=42), "missing the `owner` claim"),
    (dict(owner="../../etc"), "not a valid organization id"),
    (dict(owner="acme\n"), "not a valid organization id"),     # it would go into the node's X-Request-Id
])
def test_claim_failures(client, claims, words):
    _assert_401(_get(client, jwt.encode(_claims(**claims), JWT_SECRET, algorithm="HS256")), words)


def test_wrong_secret_and_tampering(client, keys):
    _assert_401(_get(client, jwt.encode(_claims(), "another-secret-" * 4, algorithm="HS256")),
                "signature is invalid")
    good = jwt.encode(_claims(), JWT_SECRET, algorithm="HS256")
    head, payload, sig = good.split(".")
    forged = _b64(json.dumps(_claims(owner="initech")).encode())
    _assert_401(_get(client, f"{head}.{forged}.{sig}"), "signature is invalid")
    bad_sig = sig[:-4] + ("AAAA" if not sig.endswith("AAAA") else "BBBB")
    _assert_401(_get(client, f"{head}.{payload}.{bad_sig}"), "signature is invalid")
    # RS256 signed by a key that is not in the JWKS, claiming its kid
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _assert_401(_get(client, jwt.encode(_claims(), other, algorithm="RS256",
                                        headers={"kid": "rsa-1"})), "signature is invalid")
    _assert_401(_get(client, jwt.encode(_claims(), keys["rsa"], algorithm="RS256",
                                        headers={"kid": "nope"})), "unknown key")


def test_verified_tokens_are_remembered_until_they_expire(monkeypatch):
    """A token's verification is reused (its exact string), but not at a time outside its nbf-exp
    window, nor for longer than VERIFIED_TTL_S: then it is verified again. A changed signature is
    verified on its own."""
    from app import auth
    verifier = auth.TokenVerifier(make_config([]))
    now = int(time.time())
    clock = [float(now)]
    monkeypatch.setattr(auth.time, "time", lambda: clock[0])
    decodes = []
    real_decode = jwt.decode
    monkeypatch.setattr(auth.jwt, "decode", lambda *a, **k: decodes.append(1) or real_decode(*a, **k))
    leeway = verifier._auth.leeway_s
    token = jwt.encode(_claims(nbf=now, exp=now + 600), JWT_SECRET, algorithm="HS256")
    short = jwt.encode(_claims(nbf=now, exp=now + 30), JWT_SECRET, algorithm="HS256")

    def uses(at: float, t: str = token) -> int:
        clock[0] = at
        before = len(decodes)
        assert verifier.authenticate(f"Bearer {t}").org == "acme"
        return len(decodes) - before

    assert uses(now) == 1
    assert uses(now + 1) == 0                               # remembered
    assert uses(now + auth.VERIFIED_TTL_S - 1) == 0
    assert uses(now + auth.VERIFIED_TTL_S + 1) == 1         # no longer than the TTL
    assert uses(now, short) == 1
    assert uses(now + 30 + leeway - 1, short) == 0
    assert uses(now + 30 + leeway, short) == 1              # at exp (+ leeway): not from memory
    assert uses(now - leeway - 1, short) == 1               # before nbf (- leeway): not from memory
    head, payload, sig = token.split(".")
    with pytest.raises(auth.AuthError, match="signature is invalid"):
        verifier.authenticate(f"Bearer {head}.{payload}.{sig[:-4]}{'AAAA' if sig[-4:] != 'AAAA' else 'BBBB'}")


def test_oversized_token_is_refused(client):
    token = jwt.encode(_claims(pad="x" * 20000), JWT_SECRET, algorithm="HS256")
    _assert_401(_get(client, token), "too large")


def test_rs384_not_in_allow_list(client, keys):
    token = jwt.encode(_claims(), keys["rsa"], algorithm="RS384", headers={"kid": "rsa-1"})
    _assert_401(_get(client, token), "'RS384' is not allowed")


def test_a_key_without_alg_verifies_every_algorithm_of_its_type(keys, tmp_path):
    bare = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(keys["rsa"].public_key()))
    published = dict(bare, kid="rs256-only", alg="RS256")
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": [dict(bare, kid="any-rsa"), published]}))
    cfg = make_config([], auth={"jwks_file": str(path), "algorithms": ["RS256", "RS512", "PS256"]})
    app = create_app(cfg)
    try:
        c = app.test_client()
        for alg in ("RS256", "RS512", "PS256"):
            token = jwt.encode(_claims(), keys["rsa"], algorithm=alg, headers={"kid": "any-rsa"})
            assert _get(c, token).status_code == 200, (alg, _get(c, token).get_json())
        token = jwt.encode(_claims(), keys["rsa"], algorithm="PS256", headers={"kid": "rs256-only"})
        _assert_401(_get(c, token), "does not match its key")
    finally:
        close_app(app)


def test_org_scopes_what_the_caller_sees(client):
    cfg = make_config([])
    free = client.get("/v1/models", headers=bearer(cfg, "globex")).get_json()
    pro = client.get("/v1/models", headers=bearer(cfg, "acme")).get_json()
    assert [m["id"] for m in free["data"]] == ["zen-small"]
    assert len(pro["data"]) == 4
    # an org not in the config: its tier claim (or the default tier)
    assert len(client.get("/v1/models", headers=bearer(cfg, "newco", "pro")).get_json()["data"]) == 4
    assert len(client.get("/v1/models", headers=bearer(cfg, "newco2")).get_json()["data"]) == 1
    # a configured org cannot raise its tier through the claim
    assert len(client.get("/v1/models", headers=bearer(cfg, "globex", "enterprise")).get_json()["data"]) == 1


def test_unconfigured_orgs_can_be_refused():
    cfg = make_config([], auth={"allow_unconfigured_orgs": False})
    app = create_app(cfg)
    try:
        c = app.test_client()
        assert c.get("/v1/models", headers=bearer(cfg, "acme")).status_code == 200
        _assert_401(c.get("/v1/models", headers=bearer(cfg, "newco")), "not enabled")
    finally:
        close_app(app)


def test_public_endpoints_need_no_token(client):
    assert client.get("/health").status_code == 200
    assert client.get("/openapi.json").status_code == 200
    # /metrics holds every org's counters: it takes the metrics token, not a caller's JWT
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=METRICS_HEADERS).status_code == 200


def test_max_token_lifetime(keys):
    app = create_app(make_config([], auth={"jwks_file": keys["jwks"], "algorithms": ["HS256", "RS256"],
                                           "max_token_lifetime_s": 3600}))
    try:
        c = app.test_client()
        now = int(time.time())

        def hs(**claims) -> str:
            return jwt.encode(_claims(**claims), JWT_SECRET, algorithm="HS256")

        def rs(**claims) -> str:
            return jwt.encode(_claims(**claims), keys["rsa"], algorithm="RS256", headers={"kid": "rsa-1"})

        assert _get(c, hs(iat=now, exp=now + 3600)).status_code == 200
        assert _get(c, hs(iat=now - 3000, exp=now + 600)).status_code == 200
        assert _get(c, hs(iat=None, exp=now + 1800)).status_code == 200
        assert _get(c, rs()).status_code == 200
        _assert_401(_get(c, hs(iat=now, exp=now + 3601)),
                    "lifetime (exp - iat) is 3601 s, longer than the 3600 s")
        _assert_401(_get(c, hs(iat=now - 86400, exp=now + 600)), "lifetime (exp - iat)")
        _assert_401(_get(c, hs(iat=None, exp=now + 86400)), "lifetime (exp - now, without iat)")
        _assert_401(_get(c, rs(exp=now + 7 * 86400)), "longer than the 3600 s")
        # the development tokens of a gateway with a lifetime bound fit in it
        cfg = app.extensions["zen.config"]
        assert cfg.auth.dev_token_ttl_s > 3600
        assert _get(c, mint_token(cfg, "acme")).status_code == 200
    finally:
        close_app(app)


def test_devtoken_cli_prints_an_accepted_token(client, capsys, monkeypatch):
    from app.devtoken import main

    monkeypatch.setenv("JWT_SECRET", JWT_SECRET)
    assert main(["--org", "acme", "--tier", "pro"]) == 0
    token = capsys.readouterr().out.strip()
    assert _get(client, token).status_code == 200
    assert jwt.decode(token, options={"verify_signature": False})["owner"] == "acme"
    assert main(["--tier", "platinum"]) == 2
