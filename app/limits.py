"""Per-org rate limits: requests per minute and a token bucket on LLM tokens.

Requests per minute go through `limits` (the library flask-limiter is built on), keyed by
the org of the JWT, with one counter shared by every API route. LLM tokens go through a
token bucket per org: its capacity (the burst) and refill rate come from the org's tier. A
request reserves its prompts' estimated tokens plus max_tokens for every choice (n per
prompt; a completions request may carry several prompts) when admitted and is settled with
its real usage when it ends (the unused part goes back into the bucket).

Storage (`[limits] storage_url`): `embedded://`, the default, is an LMDB file shared by
every worker of the gateway (app/limit_store.py); Redis is shared by every replica too, the
bucket updated by one Lua script; `memory://` counts in each process alone (one-process use
and tests). Every change is atomic in the store, so concurrent workers and replicas never
over-admit. If the shared store fails, the configured policy applies: "open" keeps serving
with per-process in-memory limits until it answers again, "closed" answers 503. Both are
logged.
"""
from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import limits
import limits.errors
import limits.storage
import limits.strategies
import lmdb
import redis
from flask import Flask, Response, g, request
from prometheus_client import Counter

from app.config import GatewayConfig, LimitsConfig, TierConfig
from app.limit_store import EmbeddedStorage, EmbeddedTokenBuckets, LimitStore, open_limit_store
from app.token_buckets import BucketResult, MemoryTokenBuckets, RedisTokenBuckets, TokenBuckets
from app.tracing import request_span
from engine.protocol import APIError

log = logging.getLogger("zen.gateway")
EXTENSION_KEY = "zen.tokens"
REQUESTS_KEY = "zen.requests"
STORE_KEY = "zen.limit_store"
KEY_PREFIX, SCOPE = "zen", "requests"    # a window's key in the storage: LIMITER/zen/<org>/requests/...
# What a shared storage raises when it fails (limits wraps its own; the buckets do not).
STORAGE_ERRORS = (redis.RedisError, lmdb.Error, limits.errors.StorageError)
# Unregistered: the gateway runs under gunicorn in Prometheus multiprocess mode, where every value is
# written to PROMETHEUS_MULTIPROC_DIR and /metrics reads them all (deploy/prometheus/rules.yml alerts on it).
STORAGE_FAILURES = Counter("zen_gateway_limits_storage_failures",
                           "Calls to the shared rate-limit storage (Redis or embedded) that failed.", registry=None)
B = TypeVar("B")
T = TypeVar("T")


# -- the token limiter: reservations and the failure policy ----------------------------------

@dataclass
class Reservation:
    """Tokens held for one request until it is settled."""

    org: str
    tier: TierConfig
    cost: int
    result: BucketResult
    shared: bool = True   # held in the shared store (False: the per-process one, the failure policy's)
    settled: bool = field(default=False)


class StorageHealth:
    """Whether the shared limits storage (Redis, or the embedded store) answered its last call, shared
    by both limiters of a worker, and what to do while it does not: the failure policy.

    Only changes are logged: the first failure (error, with the policy that now applies) and the first
    answer after it (warning), never one line per request."""

    def __init__(self, policy: str, retry_s: float = 5.0, *, name: str) -> None:
        self.policy = policy
        self.retry_s = retry_s
        self.name = name
        self._down_since: float | None = None
        self._lock = threading.Lock()

    def down_for(self) -> float | None:
        """Seconds since the storage last failed, or None while it answers."""
        with self._lock:
            return None if self._down_since is None else time.monotonic() - self._down_since

    def failed(self, exc: BaseException) -> None:
        STORAGE_FAILURES.inc()
        with self._lock:
            first = self._down_since is None
            self._down_since = time.monotonic()
        if first:
            then = ("failing closed: API requests get 503" if self.policy == "closed"
                    else "failing open: per-process in-memory limits")
            log.error("rate-limit storage (%s) unavailable (%s); policy %s, %s until it answers again",
                      self.name, exc.__class__.__name__, self.policy, then,
                      extra={"event": "limits_storage_down"})

    def answered(self) -> None:
        with self._lock:
            was_down = self._down_since is not None
            self._down_since = None
        if was_down:
            log.warning("rate-limit storage recovered: using %s again", self.name,
                        extra={"event": "limits_storage_recovered"})

    def call(self, op: Callable[[B], T], shared: B | None, local: B) -> T:
        """`op` on the shared backend (Redis or embedded; None: memory:// is configured, `local` is the storage),
        unless it failed less than retry_s ago; when it fails, the policy: `op` on the per-process
        `local` backend (open) or a 503 APIError (closed)."""
        return self.call_where(op, shared, local)[0]

    def call_where(self, op: Callable[[B], T], shared: B | None, local: B) -> tuple[T, bool]:
        """`call`, and whether the shared backend answered it."""
        if shared is None:
            return op(local), False
        down = self.down_for()
        if down is None or down >= self.retry_s:
            try:
                result = op(shared)
                self.answered()
                return result, True
            except STORAGE_ERRORS as exc:
                self.failed(exc)
        if self.policy == "closed":
            raise APIError(503, "Rate limiting is temporarily unavailable; retry shortly.",
                           code="service_unavailable", headers={"Retry-After": "1"})
        return op(local), False


def storage_health(config: LimitsConfig) -> StorageHealth:
    return StorageHealth(config.failure_policy, config.retry_s,
                         name="Redis" if config.uses_redis else "embedded")


class TokenLimiter:
    """Reserve-then-settle on the org's token bucket, with the shared store's failure handling.

    `store`: the embedded store when it is configured (without one, the limiter opens its own)."""

    def __init__(self, config: LimitsConfig, health: StorageHealth | None = None,
                 store: LimitStore | None = None) -> None:
        self._memory = MemoryTokenBuckets()
        self._shared: TokenBuckets | None = None
        if config.uses_redis:
            self._shared = RedisTokenBuckets(config.storage_url, config.redis_timeout_s)
        elif config.uses_embedded:
            self._shared = EmbeddedTokenBuckets(store or open_limit_store())
        self.health = health or storage_health(config)

    def reserve(self, org: str, tier: TierConfig, cost: int) -> Reservation:
        """Hold `cost` tokens for a request, or raise a 429 APIError."""
        result, shared = self.health.call_where(
            lambda buckets: buckets.reserve(org, cost, tier.burst_tokens, tier.tokens_per_second),
            self._shared, self._memory)
        if not result.admitted:
            raise token_limit_error(org, tier, cost, result)
        return Reservation(org, tier, cost, result, shared)

    def settle(self, reservation: Reservation, used_tokens: int) -> BucketResult | None:
        """Charge the real usage: give back what the request reserved but did not use, to the bucket that
        holds the reservation (a refund elsewhere would credit tokens that bucket never charged). The
        bucket after it; None where nothing changed."""
        if reservation.settled:
            return None
        reservation.settled = True
        refund = reservation.cost - max(0, used_tokens)
        if refund == 0:
            return None
        tier = reservation.tier
        buckets = self._shared if reservation.shared and self._shared is not None else self._memory
        try:
            return buckets.settle(reservation.org, refund, tier.burst_tokens, tier.tokens_per_second)
        except STORAGE_ERRORS as exc:   # the shared store went down since: the reservation stays charged
            self.health.failed(exc)
            return None


# -- headers and 429 bodies -------------------------------------------------------------------

def format_duration(seconds: float) -> str:
    """OpenAI's reset format: `250ms`, `1.5s`, `6m0s`, `1h2m3s`."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{int(math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    total = int(math.ceil(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{secs}s"


def token_headers(result: BucketResult) -> dict[str, str]:
    return {
        "x-ratelimit-limit-tokens": str(result.capacity),
        "x-ratelimit-remaining-tokens": str(max(0, int(result.tokens))),
        "x-ratelimit-reset-tokens": format_duration(result.reset_s),
    }


def request_headers(limit: int, remaining: int, reset_s: float) -> dict[str, str]:
    return {
        "x-ratelimit-limit-requests": str(limit),
        "x-ratelimit-remaining-requests": str(max(0, remaining)),
        "x-ratelimit-reset-requests": format_duration(reset_s),
    }


def retry_headers(seconds: float) -> dict[str, str]:
    return {"retry-after": str(max(1, int(math.ceil(seconds)))),
            "retry-after-ms": str(max(1, int(math.ceil(seconds * 1000))))}


def token_limit_error(org: str, tier: TierConfig, cost: int, result: BucketResult) -> APIError:
    headers = token_headers(result)
    if math.isinf(result.retry_after_s):
        headers["x-should-retry"] = "false"
        message = (f"Request too large for organization {org} on tokens: it needs {cost} tokens "
                   f"(prompt + n × max_tokens), more than the tier's burst of {tier.burst_tokens}. "
                   f"Lower max_tokens or shorten the prompt.")
    else:
        headers.update(retry_headers(result.retry_after_s))
        message = (f"Rate limit reached for organization {org} on tokens: limit "
                   f"{tier.burst_tokens}, remaining {max(0, int(result.tokens))}, requested "
                   f"{cost}. Please try again in {format_duration(result.retry_after_s)}.")
    return APIError(429, message, type="tokens", code="rate_limit_exceeded", headers=headers)


# -- requests per minute per org (limits) ----------------------------------------------------------

class SweptMemoryStorage(limits.storage.MemoryStorage):
    """limits' in-memory storage with its expired entries swept by one long-lived thread.

    The stock storage starts a new `threading.Timer` thread on a request's path to prune (its cost:
    docs/serving.md); one daemon thread sweeping every SWEEP_S keeps it from starting another. Reads
    never depended on the sweep (every window check compares timestamps); it only bounds memory.
    """

    STORAGE_SCHEME = ["zen-memory"]   # its own: limits maps URI schemes to storage classes
    SWEEP_S = 1.0

    def __init__(self, uri: str | None = None, wrap_exceptions: bool = False, **options) -> None:
        super().__init__(uri, wrap_exceptions=wrap_exceptions, **options)
        self.timer.cancel()
        # The thread holds the storage weakly: an app that is dropped (tests build many) lets it end.
        self.timer = threading.Thread(target=_sweep, args=(weakref.ref(self), self.SWEEP_S),
                                      name="rate-limit-sweeper", daemon=True)
        self.timer.start()


def _sweep(ref: "weakref.ref[SweptMemoryStorage]", every_s: float) -> None:
    while True:
        time.sleep(every_s)
        storage = ref()
        if storage is None:
            return
        try:
            storage._MemoryStorage__expire_events()   # limits' own pruning (a name-mangled private method)
        except Exception:   # it can race with the request threads' own expiry (a key gone meanwhile)
            log.debug("rate-limit sweep failed; the next one retries", exc_info=True)
        del storage


@dataclass(frozen=True)
class RequestWindow:
    """One request's hit on its org's window: where it went, to read the window back for headers."""

    limiter: limits.strategies.RateLimiter
    item: limits.RateLimitItem
    org: str
    admitted: bool

    def headers(self) -> dict[str, str]:
        stats = self.limiter.get_window_stats(self.item, KEY_PREFIX, self.org, SCOPE)
        return request_headers(self.item.amount, stats.remaining, stats.reset_time - time.time())

    def reset_s(self) -> float:
        try:
            return max(0.0, self.limiter.get_window_stats(self.item, KEY_PREFIX, self.org, SCOPE).reset_time
                       - time.time())
        except STORAGE_ERRORS:
            return 60.0


class RequestLimiter:
    """Requests per minute per org, one counter shared by every API route: a `limits` rate limiter
    (the configured strategy: moving, fixed or sliding window) over the shared storage, and over
    per-process memory while the shared store (Redis or embedded) is down and the policy is open.

    `store`: the embedded store when it is configured (without one, the limiter opens its own).

    `limits` is the library under flask-limiter, called straight from the gateway's own hook: the
    gateway has one limit per request, its org's tier's, and flask-limiter's generic hook resolving
    every kind of limit cost too much of the hop (docs/serving.md).
    """

    def __init__(self, config: LimitsConfig, health: StorageHealth, store: LimitStore | None = None) -> None:
        strategy = limits.strategies.STRATEGIES[config.strategy]
        self._local = strategy(SweptMemoryStorage())
        self._shared: limits.strategies.RateLimiter | None = None
        if config.uses_redis:
            self._shared = strategy(limits.storage.storage_from_string(
                config.storage_url, socket_timeout=config.redis_timeout_s,
                socket_connect_timeout=config.redis_timeout_s, wrap_exceptions=True))
        elif config.uses_embedded:
            self._shared = strategy(EmbeddedStorage(store or open_limit_store()))
        self.health = health
        self._items: dict[int, limits.RateLimitItem] = {}

    @property
    def storage(self) -> limits.storage.Storage:
        """Where the counters live while the storage answers."""
        return (self._shared or self._local).storage

    def hit(self, org: str, tier: TierConfig) -> RequestWindow:
        """Count one request of `org`; a 429 APIError past its tier's limit (503 while the storage is
        down and the policy is closed)."""
        item = self._items.get(tier.requests_per_minute)
        if item is None:
            item = self._items.setdefault(tier.requests_per_minute,
                                          limits.RateLimitItemPerMinute(tier.requests_per_minute))
        window = self.health.call(
            lambda limiter: RequestWindow(limiter, item, org, limiter.hit(item, KEY_PREFIX, org, SCOPE)),
            self._shared, self._local)
        if not window.admitted:
            reset_s = window.reset_s()
            headers = request_headers(item.amount, 0, reset_s)
            headers.update(retry_headers(reset_s))
            raise APIError(
                429, f"Rate limit reached for organization {org} on requests per minute: limit "
                     f"{item.amount}. Please try again in {format_duration(reset_s)}.",
                type="requests", code="rate_limit_exceeded", headers=headers)
        return window


def request_limit_headers() -> dict[str, str]:
    """This request's requests-per-minute headers (none before its hit), read from the storage once: a
    Redis round trip when Redis holds the windows, so callers read them where a wait costs nothing."""
    headers = g.get("request_limit_headers")
    if headers is None:
        headers = {}
        window = g.get("request_window")
        if window is not None:
            try:
                headers = window.headers()
            except STORAGE_ERRORS:   # headers are best effort
                pass
        g.request_limit_headers = headers
    return headers


RATE_LIMITED_BLUEPRINTS = ("api", "tokenizer")   # the generation API and the tokenizer endpoints


def init_limits(app: Flask, config: GatewayConfig) -> None:
    """Both limiters, and their hooks; call after auth (its hook must run first)."""
    health = storage_health(config.limits)
    store = app.extensions[STORE_KEY] = open_limit_store() if config.limits.uses_embedded else None
    requests = RequestLimiter(config.limits, health, store)
    app.extensions[REQUESTS_KEY] = requests
    app.extensions[EXTENSION_KEY] = TokenLimiter(config.limits, health, store)

    @app.before_request
    def _count_request_per_minute():
        # Only authenticated calls to the API count (not health checks, metrics or the schema).
        caller = g.get("caller")
        if caller is not None and request.blueprint in RATE_LIMITED_BLUEPRINTS:
            try:
                with request_span("limits.requests", lambda: {"zen.org": caller.org}):
                    g.request_window = requests.hit(caller.org, caller.tier)
            except APIError as exc:
                if exc.status == 429:
                    g.limited_by = "requests"
                raise

    @app.after_request
    def _add_limit_headers(response: Response) -> Response:
        # A generation read the window while its node read the request (app/api.py); other requests
        # read it here.
        headers = dict(g.get("token_limit_headers", {}))
        headers.update(request_limit_headers())
        if headers:
            # Those an error response set already stay; one pass over the response's headers (a
            # setdefault each would scan them all six times).
            present = {key.lower() for key in response.headers.keys()}
            response.headers.extend((k, v) for k, v in headers.items() if k not in present)
        return response


def token_limiter(app: Flask) -> TokenLimiter:
    return app.extensions[EXTENSION_KEY]


def close_limits(app: Flask) -> None:
    """Close the embedded store (a private one's directory goes with it)."""
    store = app.extensions.get(STORE_KEY)
    if store is not None:
        store.close()
