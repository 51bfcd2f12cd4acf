"""The public keys of a JWKS URL (`[auth] jwks_url`), fetched and cached for the token verifier.

Keys are fetched on first use and again when they are older than JWKS_LIFESPAN_S (the cached ones serve
while another thread fetches), or when a token names a key id the cached set lacks (the identity provider
rotated its keys). Whatever asks, the URL
is fetched at most once per `[auth] jwks_refetch_interval_s`: a stream of tokens with made-up key ids
costs no fetches, only 401s, and an unreachable endpoint is not retried on every request. A failed
fetch keeps the keys fetched before it.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from time import monotonic
from typing import Any

from jwt import PyJWK, PyJWKClient
from jwt.exceptions import PyJWKClientError, PyJWKSetError, PyJWTError

JWKS_LIFESPAN_S = 300.0     # the cached set is refreshed at this age: a withdrawn key verifies until then
JWKS_TIMEOUT_S = 5.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SigningKey:
    """A key of a JWKS that verifies signatures, and the algorithm the set publishes for it (None: none;
    pyjwt's PyJWK names a default one then, and keeps the published one private)."""
    key_id: str | None
    key_type: str
    alg: str | None
    jwk: PyJWK


def signing_keys(document: Any) -> list[SigningKey]:
    """The usable signing keys of a JWKS document (`{"keys": [...]}`): members that are not keys, keys
    for encryption and keys pyjwt cannot use are left out. PyJWKSetError if none is left."""
    members = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(members, list):
        raise PyJWKSetError("a JWKS is a JSON object with a list of keys")
    keys = []
    for data in members:
        if not isinstance(data, dict) or data.get("use", "sig") != "sig":
            continue
        try:
            jwk = PyJWK(data)
        except (PyJWTError, TypeError, ValueError):   # pyjwt's own, or a member's fields of the wrong type
            continue
        alg = data.get("alg")
        keys.append(SigningKey(jwk.key_id, jwk.key_type, alg if isinstance(alg, str) else None, jwk))
    if not keys:
        raise PyJWKSetError("the JWKS holds no usable signing key")
    return keys


class RemoteKeySet:
    """The signing keys published at a JWKS URL, refetched at most once per `refetch_interval_s`."""

    def __init__(self, url: str, refetch_interval_s: float, *, lifespan_s: float = JWKS_LIFESPAN_S,
                 timeout_s: float = JWKS_TIMEOUT_S) -> None:
        # pyjwt's client only fetches and parses; caching and throttling are here, in one place.
        self._client = PyJWKClient(url, cache_jwk_set=False, timeout=timeout_s)
        self._refetch_interval_s = refetch_interval_s
        self._lifespan_s = lifespan_s
        self._keys: list[SigningKey] = []
        self._fetched_at: float | None = None     # monotonic time of the last successful fetch
        self._tried_at: float | None = None       # monotonic time of the last fetch, failed or not
        self._lock = threading.Lock()

    def keys(self, kid: str | None) -> list[SigningKey]:
        """The cached signing keys, refetched first if they are stale or lack `kid` (when the
        refetch interval allows)."""
        keys, fetched_at = self._keys, self._fetched_at
        stale = fetched_at is None or monotonic() - fetched_at >= self._lifespan_s
        known = kid is None or any(k.key_id == kid for k in keys)
        if stale or not known:
            return self._refetch(wait=not (keys and known))
        return keys

    def _refetch(self, wait: bool) -> list[SigningKey]:
        """Fetch the set (one thread at a time). wait=False: the cached keys serve this caller, so it does
        not wait for another thread's fetch."""
        if not self._lock.acquire(blocking=wait):
            return self._keys
        try:
            # the interval counts from the end of the last fetch: who waited through a slow one does not
            # fetch again
            if self._tried_at is not None and monotonic() - self._tried_at < self._refetch_interval_s:
                return self._keys
            try:
                keys = signing_keys(self._client.fetch_data())
            except (PyJWKClientError, PyJWKSetError, OSError, ValueError) as exc:   # ValueError: not JSON
                log.warning("JWKS fetch from %s failed: %s", self._client.uri, exc)
                return self._keys
            finally:
                self._tried_at = monotonic()
            self._keys = keys     # a key without a kid serves tokens without one (the only key of its type)
            self._fetched_at = self._tried_at
            return self._keys
        finally:
            self._lock.release()
