"""JWT attacks against a real gateway (gunicorn, loopback): every forged, stale, misdirected or
malformed token gets 401 in OpenAI's error shape, on every API route, and the refusal never shows
key material. The gateway accepts HS256 (the shared secret) and RS256 (public keys from a JWKS
file); the controls show that honest tokens of both kinds are accepted by the same gateway."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

import jwt
import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from tests.serving_fixtures import JWT_SECRET, gateway_config, launch_gateway

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::jwt.warnings.InsecureKeyLengthWarning")]
ISSUER, AUDIENCE, KID = "zen-test", "zen-gateway", "test-rsa-1"
# Below gunicorn's own limit on one header field (8190 bytes), so that the gateway's check is the one
# that answers an oversized token (see test_token_beyond_the_http_header_limit for the other case).
MAX_TOKEN_BYTES = 4096
ROUTES = [("GET", "/v1/models", None),
          ("GET", "/v1/models/zen-tiny", None),
          ("POST", "/v1/chat/completions", {"model": "zen-tiny", "messages": [{"role": "user", "content": "hi"}],
                                            "max_tokens": 2}),
          ("POST", "/v1/completions", {"model": "zen-tiny", "prompt": "hi", "max_tokens": 2})]


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64url_json(obj: dict) -> str:
    return b64url(json.dumps(obj, separators=(",", ":")).encode())


def unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@pytest.fixture(scope="module")
def keys():
    """The gateway's RSA key (published in its JWKS) and an attacker's RSA key."""
    mine = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return mine, other


@pytest.fixture(scope="module")
def gateway(keys, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jwt-gateway")
    jwk = json.loads(RSAAlgorithm.to_jwk(keys[0].public_key()))
    jwk.update({"kid": KID, "alg": "RS256", "use": "sig"})
    jwks = tmp / "jwks.json"
    jwks.write_text(json.dumps({"keys": [jwk]}))
    config = gateway_config({"auth": {"algorithms": ["HS256", "RS256"], "jwks_file": str(jwks),
                                      "issuer": ISSUER, "audience": AUDIENCE, "leeway_s": 5,
                                      "allow_unconfigured_orgs": False,
                                      "max_token_bytes": MAX_TOKEN_BYTES}})
    gw = launch_gateway(config, node_urls=[], log_dir=str(tmp), workers=2, threads=8)
    yield gw
    gw.stop()


def claims(**over) -> dict:
    now = int(time.time())
    out = {"owner": "bravo", "sub": "tester", "iat": now, "nbf": now, "exp": now + 600, "iss": ISSUER,
           "aud": AUDIENCE}
    out.update(over)
    return {k: v for k, v in out.items() if v is not None}


def hs256(payload: dict, secret: str | bytes = JWT_SECRET, **header) -> str:
    return jwt.encode(payload, secret, algorithm="HS256", headers=header or None)


def rs256(payload: dict, key, kid: str | None = KID, **header) -> str:
    h = {"kid": kid, **header} if kid else (header or None)
    return jwt.encode(payload, key, algorithm="RS256", headers=h)


def forge(header: dict, payload: dict, signing_input_key: bytes | None = None, signature: bytes = b"") -> str:
    """A token built by hand: HMAC-SHA256 over the signing input with `signing_input_key`, or the
    given raw signature."""
    signing_input = b64url_json(header) + "." + b64url_json(payload)
    if signing_input_key is not None:
        signature = hmac.new(signing_input_key, signing_input.encode(), hashlib.sha256).digest()
    return signing_input + "." + b64url(signature)


def flip_char(segment: str, index: int) -> str:
    c = segment[index]
    return segment[:index] + ("A" if c != "A" else "B") + segment[index + 1:]


def attacks(keys) -> dict[str, str]:
    mine, other = keys
    public_pem = mine.public_key().public_bytes(serialization.Encoding.PEM,
                                                serialization.PublicFormat.SubjectPublicKeyInfo)
    public_der = mine.public_key().public_bytes(serialization.Encoding.DER,
                                                serialization.PublicFormat.SubjectPublicKeyInfo)
    jwk_public = json.loads(RSAAlgorithm.to_jwk(mine.public_key()))
    good = hs256(claims())
    h, p, s = good.split(".")
    good_rs = rs256(claims(), mine)
    rh, rp, rsig = good_rs.split(".")
    now = int(time.time())
    return {
        # alg none, in every spelling, with and without a signature
        "alg none": forge({"alg": "none", "typ": "JWT"}, claims()),
        "alg None": forge({"alg": "None", "typ": "JWT"}, claims()),
        "alg NONE": forge({"alg": "NONE", "typ": "JWT"}, claims()),
        "alg none with signature": forge({"alg": "none"}, claims(), signature=unb64url(s)),
        "alg missing": forge({"typ": "JWT"}, claims(), JWT_SECRET.encode()),
        # key confusion: HS256 with the RS256 public key as the HMAC secret
        "HS256 signed with the RS256 public key (PEM)": forge({"alg": "HS256", "typ": "JWT", "kid": KID},
                                                               claims(), public_pem),
        "HS256 signed with the RS256 public key (PEM, no kid)": forge({"alg": "HS256"}, claims(), public_pem),
        "HS256 signed with the RS256 public key (DER)": forge({"alg": "HS256", "kid": KID}, claims(), public_der),
        "HS256 signed with the RS256 modulus": forge({"alg": "HS256", "kid": KID}, claims(),
                                                     jwk_public["n"].encode()),
        "HS256 with a wrong secret": hs256(claims(), "not-the-secret-but-long-enough-0123456789"),
        "HS256 with an empty secret": forge({"alg": "HS256"}, claims(), b""),
        "HS512 (not allowed)": jwt.encode(claims(), JWT_SECRET, algorithm="HS512"),
        "RS256 signed with another key": rs256(claims(), other),
        "RS256 signed with another key, no kid": rs256(claims(), other, kid=None),
        "RS256 with an unknown kid": rs256(claims(), other, kid="attacker-key"),
        "RS256 with an embedded jwk": rs256(claims(), other, kid=None,
                                            jwk=json.loads(RSAAlgorithm.to_jwk(other.public_key()))),
        "RS256 with a jku": rs256(claims(), other, kid="x", jku="http://127.0.0.1:9/jwks.json"),
        "PS256 (not allowed)": jwt.encode(claims(), mine, algorithm="PS256", headers={"kid": KID}),
        # time
        "expired": hs256(claims(exp=now - 3600, iat=now - 7200, nbf=now - 7200)),
        "expired just beyond the leeway": hs256(claims(exp=now - 30)),
        "expired RS256": rs256(claims(exp=now - 3600, iat=now - 7200, nbf=now - 7200), mine),
        "not yet valid": hs256(claims(nbf=now + 3600)),
        "not yet valid RS256": rs256(claims(nbf=now + 3600), mine),
        "no exp": hs256(claims(exp=None)),
        "exp not a number": hs256(claims(exp="tomorrow")),
        # audience, issuer, owner
        "wrong issuer": hs256(claims(iss="evil-issuer")),
        "no issuer": hs256(claims(iss=None)),
        "wrong audience": hs256(claims(aud="other-service")),
        "no audience": hs256(claims(aud=None)),
        "wrong audience RS256": rs256(claims(aud="other-service"), mine),
        "missing owner": hs256(claims(owner=None)),
        "empty owner": hs256(claims(owner="")),
        "owner not a string": hs256(claims(owner=["bravo"])),
        "owner not a valid org id": hs256(claims(owner="../../bravo")),
        "owner not configured": hs256(claims(owner="mallory")),
        # tampering
        "tampered payload (owner)": f"{h}.{b64url_json({**json.loads(unb64url(p)), 'owner': 'alpha'})}.{s}",
        "tampered payload (exp)": f"{h}.{b64url_json({**json.loads(unb64url(p)), 'exp': now + 10**8})}.{s}",
        "tampered payload RS256": f"{rh}.{b64url_json({**json.loads(unb64url(rp)), 'owner': 'alpha'})}.{rsig}",
        "tampered header (alg to HS384)": f"{b64url_json({'alg': 'HS384', 'typ': 'JWT'})}.{p}.{s}",
        "tampered signature": f"{h}.{p}.{flip_char(s, 5)}",
        "tampered signature RS256": f"{rh}.{rp}.{flip_char(rsig, 40)}",
        "signature removed": f"{h}.{p}.",
        "signature of another token": f"{h}.{p}.{hs256(claims(owner='alpha')).split('.')[2]}",
        # size
        "oversized token": hs256(claims(pad="x" * 4000)),
        "oversized token RS256": rs256(claims(pad="x" * 4000), mine),
        "oversized header": forge({"alg": "HS256", "pad": "y" * 4000}, claims(), JWT_SECRET.encode()),
        # garbage
        "garbage": "garbage",
        "garbage with dots": "a.b.c",
        "four segments": f"{h}.{p}.{s}.extra",
        "two segments": f"{h}.{p}",
        "not base64": "%%%.$$$.###",
        "header not JSON": f"{b64url(b'not json')}.{p}.{s}",
        "header a JSON list": f"{b64url(b'[1,2]')}.{p}.{s}",
        "payload not JSON": f"{h}.{b64url(b'{not json')}.{s}",
        "payload a JSON list": f"{h}.{b64url(b'[1,2,3]')}.{s}",
        "binary": b64url(bytes(range(256))),
        "a bearer token of spaces": "    ",
    }


def test_controls_are_accepted(gateway, keys):
    """An honest HS256 token and an honest RS256 token are accepted by this same gateway."""
    for token in (hs256(claims()), rs256(claims(), keys[0])):
        r = requests.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 200, r.text
        assert any(m["id"] == "zen-tiny" for m in r.json()["data"])


def _assert_refused(r: requests.Response, keys, name: str) -> None:
    assert r.status_code == 401, (name, r.status_code, r.text[:300])
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body
    text = r.text
    public_pem = keys[0].public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    for secret in (JWT_SECRET, public_pem.splitlines()[1], KID, "Traceback"):
        assert secret not in text, (name, secret, text[:300])


def test_every_attack_gets_401_on_every_route(gateway, keys):
    tokens = attacks(keys)
    assert len(tokens) >= 40
    failures = []
    for name, token in tokens.items():
        for method, path, body in ROUTES:
            r = requests.request(method, gateway.url + path, json=body, timeout=30,
                                 headers={"Authorization": f"Bearer {token}"})
            try:
                _assert_refused(r, keys, name)
            except AssertionError as exc:
                failures.append(f"{name} {method} {path}: {exc}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "bearer",
                                    "Token abc", "Bearer a b c", "Bearer\tabc"])
def test_missing_or_malformed_authorization_header(gateway, keys, header):
    headers = {} if header is None else {"Authorization": header}
    r = requests.post(gateway.url + "/v1/chat/completions", headers=headers, timeout=30,
                      json=ROUTES[2][2])
    _assert_refused(r, keys, repr(header))


def test_messages_say_what_is_wrong(gateway, keys):
    """The message names the problem (so an operator can fix a client), not the key that was tried."""
    now = int(time.time())
    expect = {
        "expired": hs256(claims(exp=now - 3600)),
        "not yet valid": hs256(claims(nbf=now + 3600)),
        "issuer": hs256(claims(iss="evil")),
        "audience": hs256(claims(aud="evil")),
        "owner": hs256(claims(owner=None)),
        "signature": hs256(claims(), "not-the-secret-but-long-enough-0123456789"),
        "not allowed": forge({"alg": "none"}, claims()),
    }
    for word, token in expect.items():
        r = requests.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 401
        assert word in r.json()["error"]["message"], (word, r.json())


def test_token_beyond_the_http_header_limit(gateway, keys):
    """A token larger than gunicorn's header-field limit never reaches the app: refused with a 4xx (not
    a 5xx, not a 200), and the gateway keeps serving."""
    token = hs256(claims(pad="x" * 9000))
    r = requests.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert 400 <= r.status_code < 500, r.status_code
    good = requests.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {hs256(claims())}"},
                        timeout=30)
    assert good.status_code == 200
    assert gateway.alive()
