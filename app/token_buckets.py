"""Token buckets on LLM tokens: one arithmetic, and where the buckets live.

A bucket holds up to `capacity` tokens (the org's burst) and refills at `rate` tokens per second.
`reserve` takes a request's tokens if the bucket holds them; `settle` gives back what it reserved
and did not use (or charges more: the bucket may go below 0, a debt paid back first).

Backends: this process's memory (MemoryTokenBuckets), Redis (RedisTokenBuckets, one Lua script
per operation, the same arithmetic written in Lua because it runs inside Redis), and the embedded
store shared by a gateway's workers (app/limit_store.py), which calls `apply_to_bucket` inside its
transaction.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import redis


def refill(tokens: float, last: float, now: float, capacity: float, rate: float) -> float:
    """Tokens in a bucket last seen holding `tokens` at `last`, at time `now`."""
    return min(capacity, tokens + max(0.0, now - last) * rate)


@dataclass(frozen=True)
class BucketResult:
    """The outcome of one bucket operation."""

    admitted: bool
    tokens: float            # tokens left after the operation
    capacity: int
    rate: float              # refill, tokens per second
    retry_after_s: float     # 0 when admitted; math.inf when the cost exceeds the capacity

    @property
    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, (self.capacity - self.tokens) / self.rate)


def apply_to_bucket(tokens: float, last: float, now: float, amount: float, capacity: int, rate: float,
                    reserve: bool) -> BucketResult:
    """One operation on a bucket last seen holding `tokens` at `last`: reserve takes `amount` if the
    bucket holds it, settle gives `amount` back (never above the capacity)."""
    tokens = refill(tokens, last, now, capacity, rate)
    admitted, wait = True, 0.0
    if reserve:
        if amount > capacity:
            admitted, wait = False, math.inf
        elif tokens >= amount:
            tokens -= amount
        else:
            admitted, wait = False, (amount - tokens) / rate
    else:
        tokens = min(float(capacity), tokens + amount)
    return BucketResult(admitted, tokens, capacity, rate, wait)


def bucket_ttl_s(tokens: float, capacity: int, rate: float) -> float:
    """How long an untouched bucket holding `tokens` is kept: past the time it takes to fill, it is full
    anyway (from below 0 too: forgotten sooner, its debt would be)."""
    return (capacity - tokens) / rate + 60.0


class TokenBuckets:
    """reserve and settle over one `_apply` that a backend implements atomically."""

    def _apply(self, key: str, amount: float, capacity: int, rate: float, reserve: bool) -> BucketResult:
        raise NotImplementedError

    def reserve(self, key: str, cost: int, capacity: int, rate: float) -> BucketResult:
        """Take `cost` tokens if the bucket holds them."""
        return self._apply(key, cost, capacity, rate, reserve=True)

    def settle(self, key: str, refund: float, capacity: int, rate: float) -> BucketResult:
        """Give back `refund` tokens (negative: charge more; the bucket may go below 0)."""
        return self._apply(key, refund, capacity, rate, reserve=False)


class MemoryTokenBuckets(TokenBuckets):
    """Token buckets in this process's memory."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}   # key -> (tokens, last update)

    def _apply(self, key: str, amount: float, capacity: int, rate: float,
               reserve: bool) -> BucketResult:
        with self._lock:
            now = self._clock()
            tokens, last = self._buckets.get(key, (float(capacity), now))
            result = apply_to_bucket(tokens, last, now, amount, capacity, rate, reserve)
            self._buckets[key] = (result.tokens, now)
            return result


# KEYS[1] = bucket; ARGV = capacity, rate, amount, mode ("reserve" | "settle").
# Redis's own clock is the time source, so every worker and replica agrees on it.
_BUCKET_LUA = """
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local amount = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then
  tokens = capacity
  ts = now
end
if now > ts then tokens = tokens + (now - ts) * rate end
if tokens > capacity then tokens = capacity end
local admitted = 1
local wait = 0
if ARGV[4] == 'reserve' then
  if amount > capacity then
    admitted = 0
    wait = -1
  elseif tokens >= amount then
    tokens = tokens - amount
  else
    admitted = 0
    wait = (amount - tokens) / rate
  end
else
  tokens = math.min(capacity, tokens + amount)
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens), 'ts', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1], math.ceil(((capacity - tokens) / rate) * 1000) + 60000)
return {admitted, string.format('%.6f', tokens), string.format('%.6f', wait)}
"""


class RedisTokenBuckets(TokenBuckets):
    """Token buckets in Redis, each operation one atomic Lua script."""

    def __init__(self, url: str, timeout_s: float, prefix: str = "zen:tokens:") -> None:
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s)
        self._script = self._redis.register_script(_BUCKET_LUA)
        self._prefix = prefix

    def _apply(self, key: str, amount: float, capacity: int, rate: float, reserve: bool) -> BucketResult:
        admitted, tokens, wait = self._script(keys=[self._prefix + key],
                                              args=[capacity, repr(float(rate)), repr(float(amount)),
                                                    "reserve" if reserve else "settle"])
        wait_s = float(wait)
        return BucketResult(bool(int(admitted)), float(tokens), capacity, rate,
                            math.inf if wait_s < 0 else wait_s)
