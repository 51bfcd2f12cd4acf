"""Authentication: `Authorization: Bearer <JWT>` → the calling organization.

Tokens are verified with pyjwt against an allow-list of algorithms. The algorithm family
picks the key: HS* tokens are checked only against the configured secret, RS*/ES*/EdDSA
tokens only against the public keys of the JWKS (file or URL, see app/jwks.py), so a token can
never get an HMAC check with a public key, and `none` is never allowed. `exp` is required; `nbf`,
`iss` and `aud` are checked when present/configured, and the lifetime (exp - iat) when
`max_token_lifetime_s` is set. The org is the `owner` claim.

A `before_app_request` hook puts the caller in `g.caller` (and `g.org`); `login_required`
guards the API routes and answers 401 in OpenAI's shape with what is wrong.
"""
from __future__ import annotations

import functools
import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import jwt
from flask import Blueprint, Flask, current_app, g, request

from app.config import AuthConfig, GatewayConfig, TierConfig
from app.errors import unauthorized
from app.jwks import RemoteKeySet, SigningKey, signing_keys
from app.tracing import request_span
from engine.protocol import LatencyClass

EXTENSION_KEY = "zen.auth"
_ORG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_KEY_TYPES = {"RS": "RSA", "PS": "RSA", "ES": "EC", "Ed": "OKP"}

bp = Blueprint("auth", __name__)


class AuthError(Exception):
    """A token was refused; the message says why (never which key was tried)."""


@dataclass(frozen=True)
class Caller:
    """Who is calling: the org (JWT `owner`), its tier and SLA."""

    org: str
    tier: TierConfig
    max_latency_class: LatencyClass
    default_latency_class: LatencyClass
    configured: bool          # the org has its own entry in the config
    subject: str | None = None


# Verified tokens are remembered (the exact token string: its signature included) for at most this
# long: a client sends the same token with every request, and verifying it again (pyjwt, base64 and
# JSON in Python, an RSA or EC signature) was a tenth of the gateway's own time per request. The
# expiry and not-before times are checked on every use; the bound is how long a key withdrawn from
# the JWKS may still admit a token it signed earlier.
VERIFIED_TTL_S = 60.0
VERIFIED_MAX = 4096


@dataclass(frozen=True)
class _Verified:
    caller: Caller
    exp: int
    nbf: int | None
    at: float


class TokenVerifier:
    """Verifies JWTs and turns their claims into a Caller."""

    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self._auth: AuthConfig = config.auth
        self._verified: dict[str, _Verified] = {}
        self._verified_lock = threading.Lock()
        self._jwks: list[SigningKey] | None = None
        self._remote_jwks: RemoteKeySet | None = None
        if self._auth.jwks_file:
            with open(self._auth.jwks_file, encoding="utf-8") as fh:
                self._jwks = signing_keys(json.load(fh))
        elif self._auth.jwks_url:
            self._remote_jwks = RemoteKeySet(self._auth.jwks_url, self._auth.jwks_refetch_interval_s)

    # -- keys -----------------------------------------------------------------------------

    def _public_key(self, alg: str, kid: str | None) -> Any:
        """The JWKS key for a public-key algorithm: by kid, or the only key of its type."""
        want_kty = _KEY_TYPES.get(alg[:2])
        if self._remote_jwks is not None:
            keys = self._remote_jwks.keys(kid)
        elif self._jwks is not None:
            keys = self._jwks
        else:
            keys = []
        if kid is not None:
            keys = [k for k in keys if k.key_id == kid]
        keys = [k for k in keys if k.key_type == want_kty and k.key_type != "oct"]
        if kid is None and len(keys) > 1:
            raise AuthError("token has no key id (kid) and several keys could verify it")
        if not keys:
            raise AuthError("token is signed with an unknown key")
        key = keys[0]
        # A key published for one algorithm is not used with another: an RSA key without one verifies
        # RS384, RS512 and PS256-512 tokens too; an EC key's curve fixes its algorithm.
        published = key.alg or (key.jwk.algorithm_name if key.key_type == "EC" else None)
        if published and published != alg and alg != "EdDSA":
            raise AuthError("token algorithm does not match its key")
        return key.jwk.key

    def _key_for(self, alg: str, kid: str | None) -> Any:
        if alg.startswith("HS"):
            return self._auth.hs256_secret.encode()
        return self._public_key(alg, kid)

    # -- verification ---------------------------------------------------------------------

    def verify(self, token: str) -> dict:
        """The verified claims of `token`; AuthError with the reason otherwise."""
        if len(token) > self._auth.max_token_bytes:
            raise AuthError("token is too large")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise AuthError("token is malformed") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self._auth.algorithms:
            raise AuthError(f"token algorithm {str(alg)[:16]!r} is not allowed")
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise AuthError("token is malformed")
        key = self._key_for(alg, kid)
        try:
            claims = jwt.decode(
                token, key, algorithms=[alg],
                audience=self._auth.audience or None,
                issuer=self._auth.issuer or None,
                leeway=self._auth.leeway_s,
                options={"require": ["exp"], "verify_aud": bool(self._auth.audience)},
            )
        except jwt.ExpiredSignatureError:
            raise AuthError("token has expired") from None
        except jwt.ImmatureSignatureError:
            raise AuthError("token is not yet valid") from None
        except jwt.InvalidIssuerError:
            raise AuthError("token issuer is not accepted") from None
        except jwt.InvalidAudienceError:
            raise AuthError("token audience is not accepted") from None
        except jwt.MissingRequiredClaimError as exc:
            raise AuthError(f"token is missing the required `{exc.claim}` claim") from None
        except (jwt.InvalidSignatureError, jwt.InvalidKeyError):
            raise AuthError("token signature is invalid") from None
        except jwt.InvalidAlgorithmError:
            raise AuthError(f"token algorithm {alg!r} is not allowed") from None
        except jwt.DecodeError:
            raise AuthError("token is malformed") from None
        except jwt.PyJWTError:
            raise AuthError("token is invalid") from None
        self._check_lifetime(claims)
        return claims

    def _check_lifetime(self, claims: dict) -> None:
        """AuthError when the token was issued for longer than max_token_lifetime_s allows."""
        limit = self._auth.max_token_lifetime_s
        if not limit:
            return
        # pyjwt has checked that exp (and iat, when present) are integers
        if "iat" in claims:
            lifetime, span = int(claims["exp"]) - int(claims["iat"]), "exp - iat"
        else:
            lifetime, span = int(claims["exp"]) - int(time.time()), "exp - now, without iat"
        if lifetime > limit:
            raise AuthError(f"token lifetime ({span}) is {lifetime} s, longer than the {limit} s "
                            f"this gateway accepts")

    def caller_for(self, claims: dict) -> Caller:
        """The Caller the verified `claims` name; AuthError when they name none."""
        org = claims.get("owner")
        if not isinstance(org, str) or not org:
            raise AuthError("token is missing the `owner` claim")
        if not _ORG_RE.fullmatch(org):
            raise AuthError("token `owner` claim is not a valid organization id")
        sub = claims.get("sub") if isinstance(claims.get("sub"), str) else None
        org_cfg = self._config.orgs.get(org)
        if org_cfg is not None:
            tier = self._config.tiers[org_cfg.tier]
            return Caller(org, tier, org_cfg.max_latency_class, org_cfg.default_latency_class,
                          configured=True, subject=sub)
        if not self._auth.allow_unconfigured_orgs:
            raise AuthError(f"organization `{org}` is not enabled on this gateway")
        claimed = claims.get("tier")
        tier_name = claimed if isinstance(claimed, str) and claimed in self._config.tiers \
            else self._auth.default_tier
        tier = self._config.tiers[tier_name]
        return Caller(org, tier, tier.max_latency_class, tier.default_latency_class,
                      configured=False, subject=sub)

    def authenticate(self, authorization: str | None) -> Caller:
        """The Caller of an Authorization header value; AuthError otherwise."""
        if not authorization:
            raise AuthError("missing bearer token: send `Authorization: Bearer <token>`")
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthError("authorization header must be `Bearer <token>`")
        now = time.time()
        leeway = self._auth.leeway_s
        seen = self._verified.get(token)
        if seen is not None and now - seen.at < VERIFIED_TTL_S and now < seen.exp + leeway \
                and (seen.nbf is None or now >= seen.nbf - leeway):
            return seen.caller
        claims = self.verify(token)
        caller = self.caller_for(claims)
        nbf = claims.get("nbf")
        with self._verified_lock:
            if len(self._verified) >= VERIFIED_MAX:
                self._verified.pop(next(iter(self._verified)))   # the oldest
            self._verified[token] = _Verified(caller, int(claims["exp"]),
                                              int(nbf) if nbf is not None else None, now)
        return caller


def init_auth(app: Flask, config: GatewayConfig) -> None:
    app.extensions[EXTENSION_KEY] = TokenVerifier(config)
    app.register_blueprint(bp)


@bp.before_app_request
def load_caller() -> None:
    """Put the authenticated caller in g.caller/g.org, or the reason in g.auth_error."""
    g.caller = None
    g.org = None
    g.auth_error = None
    header = request.headers.get("Authorization")
    if header is None:
        g.auth_error = "missing bearer token: send `Authorization: Bearer <token>`"
        return
    with request_span("auth"):
        try:
            g.caller = current_app.extensions[EXTENSION_KEY].authenticate(header)
            g.org = g.caller.org
        except AuthError as exc:
            g.auth_error = str(exc)


def login_required(view: Callable) -> Callable:
    """Guard a view: 401 in OpenAI's shape unless a valid token named the caller."""

    @functools.wraps(view)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if g.get("caller") is None:
            raise unauthorized(g.get("auth_error") or "authentication required")
        return view(*args, **kwargs)

    return wrapped
