"""The gateway's configuration: one dataclass, built once.

Order of precedence (later wins): the shipped defaults in config/default.toml (or the file
named by ZEN_CONFIG), environment variables for secrets and addresses (PORT, JWT_SECRET,
REDIS_URL, ZEN_NODES, NODE_SECRET, METRICS_TOKEN, OpenTelemetry's OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT
and OTEL_SDK_DISABLED), then test overrides (a nested dict). Everything is
validated in __post_init__, so a bad file fails at start-up, not on the first request.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import tomllib
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Union, get_args, get_origin, get_type_hints
from urllib.parse import urlparse

from engine.protocol import DEV_NODE_SECRET, MAX_CHAT_TEMPLATE_CHARS, LatencyClass, is_loopback_host
from models.chat_template import TemplateCompileError, cached_chat_template
from models.formats import FORMATS


DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "config" / "default.toml"
JWT_ALGORITHMS = ("HS256", "HS384", "HS512", "RS256", "RS384", "RS512",
                  "ES256", "ES384", "ES512", "PS256", "PS384", "PS512", "EdDSA")
FAILURE_POLICIES = ("open", "closed")
RATE_LIMIT_STRATEGIES = ("fixed-window", "moving-window", "sliding-window-counter")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ConfigError(ValueError):
    """The configuration is invalid; the message names the offending key."""


class DevelopmentSecret(NamedTuple):
    key: str      # section.field in the TOML file
    env: str      # the environment variable that replaces it
    value: str    # the public value config/default.toml ships


# The secrets config/default.toml ships: public, so a gateway refuses them off loopback.
DEVELOPMENT_SECRETS = (
    DevelopmentSecret("auth.hs256_secret", "JWT_SECRET", "zen-development-secret-do-not-use-in-production"),
    DevelopmentSecret("nodes.secret", "NODE_SECRET", DEV_NODE_SECRET),
    DevelopmentSecret("server.metrics_token", "METRICS_TOKEN", "zen-development-metrics-token"),
)


def count_from_env(name: str, default: int) -> int:
    """An integer >= 1 from the environment variable `name` (unset or empty: `default`); ConfigError else."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    _require(value >= 1, f"{name} must be an integer >= 1, got {text!r}")   # 0 workers: a master that never serves
    return value


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 1_048_576
    max_n: int = 8
    max_prompts: int = 32      # prompts in one completions request (a list of them)
    log_level: str = "INFO"
    workers: int = 2
    threads: int = 16
    metrics_token: str = ""   # GET /metrics needs `Authorization: Bearer <it>`; empty = open to all
    org_thread_share: float = 1.0       # most of a worker's threads one org's generations may hold at once
    write_timeout_s: float = 30.0       # a stream whose client reads nothing for this long is ended
    max_logprob_entries: int = 131_072  # n x max_tokens x (top_logprobs + 1) of one answer that does not stream

    def __post_init__(self) -> None:
        _require(0 < self.port < 65536, f"server.port out of range: {self.port}")
        _require(self.max_body_bytes >= 1024, "server.max_body_bytes must be >= 1024")
        _require(1 <= self.max_n <= 128, "server.max_n must be in [1, 128]")
        _require(1 <= self.max_prompts <= 1024, "server.max_prompts must be in [1, 1024]")
        _require(self.workers >= 1 and self.threads >= 1, "server.workers/threads must be >= 1")
        _require(0 < self.org_thread_share <= 1, "server.org_thread_share must be in (0, 1]")
        _require(math.isfinite(self.write_timeout_s) and self.write_timeout_s > 0,
                 "server.write_timeout_s must be a finite number > 0")
        _require(self.max_logprob_entries >= 1, "server.max_logprob_entries must be >= 1")
        _require(self.log_level.upper() in LOG_LEVELS,
                 f"server.log_level must be one of {', '.join(LOG_LEVELS)}, not {self.log_level!r}")


@dataclass(frozen=True)
class AuthConfig:
    algorithms: tuple[str, ...] = ("HS256",)
    hs256_secret: str = ""
    jwks_file: str = ""
    jwks_url: str = ""
    issuer: str = ""
    audience: str = ""
    leeway_s: float = 5.0
    max_token_bytes: int = 8192
    allow_unconfigured_orgs: bool = True
    default_tier: str = "free"
    dev_token_ttl_s: int = 86400
    jwks_refetch_interval_s: float = 60.0   # least time between two fetches of jwks_url
    max_token_lifetime_s: int = 0           # longest exp - iat accepted; 0: any

    def __post_init__(self) -> None:
        object.__setattr__(self, "algorithms", tuple(self.algorithms))
        _require(len(self.algorithms) > 0, "auth.algorithms must not be empty")
        for alg in self.algorithms:
            _require(alg in JWT_ALGORITHMS, f"auth.algorithms: unsupported algorithm {alg!r}")
        if self.allows_hmac:
            _require(len(self.hs256_secret.encode()) >= 32,
                     "auth.hs256_secret (JWT_SECRET) must be at least 32 bytes when an HS* "
                     "algorithm is allowed")
        if any(not a.startswith("HS") for a in self.algorithms) and not (
                self.jwks_file or self.jwks_url):
            # Public-key algorithms without keys simply never verify; drop them so that the
            # allow-list says what can actually be accepted.
            object.__setattr__(self, "algorithms",
                               tuple(a for a in self.algorithms if a.startswith("HS")))
            _require(len(self.algorithms) > 0,
                     "auth: RS*/ES* algorithms need auth.jwks_file or auth.jwks_url")
        # a string such as "false" would read as true: an unconfigured org's token could claim any tier
        _require(isinstance(self.allow_unconfigured_orgs, bool), "auth.allow_unconfigured_orgs must be true or false")
        _require(self.leeway_s >= 0, "auth.leeway_s must be >= 0")
        _require(self.max_token_bytes >= 256, "auth.max_token_bytes must be >= 256")
        _require(not (self.jwks_file and self.jwks_url),
                 "auth: give jwks_file or jwks_url, not both (which keys would verify is not clear)")
        _require(self.dev_token_ttl_s > 0, "auth.dev_token_ttl_s must be > 0")
        if self.jwks_file:   # read at auth set-up in every worker: a file that cannot serve fails here, once
            from jwt.exceptions import PyJWTError

            from app.jwks import signing_keys
            try:
                with open(self.jwks_file, "rb") as fh:
                    signing_keys(json.load(fh))
            except OSError as exc:
                raise ConfigError(f"auth.jwks_file: cannot read {self.jwks_file}: {exc.strerror}") from None
            except (ValueError, PyJWTError) as exc:   # not JSON, or no usable signing key
                raise ConfigError(f"auth.jwks_file: {self.jwks_file}: {exc}") from None
        if self.jwks_url:
            url = urlparse(self.jwks_url)
            # Over plain http anyone on the path could swap in their own signing keys.
            _require(bool(url.netloc) and (url.scheme == "https" or (
                url.scheme == "http" and is_loopback_host(url.hostname))),
                f"auth.jwks_url must be an https:// URL (http:// only on a loopback host), "
                f"got {self.jwks_url!r}")
        _require(self.jwks_refetch_interval_s > 0, "auth.jwks_refetch_interval_s must be > 0")
        _require(self.max_token_lifetime_s >= 0, "auth.max_token_lifetime_s must be >= 0 (0: off)")

    @property
    def allows_hmac(self) -> bool:
        return any(a.startswith("HS") for a in self.algorithms)


@dataclass(frozen=True)
class LimitsConfig:
    storage_url: str = "embedded://"
    strategy: str = "moving-window"
    failure_policy: str = "open"
    retry_s: float = 5.0
    redis_timeout_s: float = 0.5
    burst_seconds: float = 60.0

    def __post_init__(self) -> None:
        scheme = urlparse(self.storage_url).scheme
        _require(scheme in ("embedded", "memory", "redis", "rediss"),
                 f"limits.storage_url must be embedded://, memory:// or redis://, got {self.storage_url!r}")
        _require(scheme != "embedded" or self.storage_url.rstrip("/") == "embedded:",
                 f"limits.storage_url: embedded:// takes no host or path (ZEN_LIMITS_DIR sets its "
                 f"directory), got {self.storage_url!r}")
        _require(self.strategy in RATE_LIMIT_STRATEGIES,
                 f"limits.strategy must be one of {RATE_LIMIT_STRATEGIES}")
        _require(self.failure_policy in FAILURE_POLICIES,
                 f"limits.failure_policy must be one of {FAILURE_POLICIES}")
        _require(self.retry_s > 0 and self.redis_timeout_s > 0,
                 "limits.retry_s and redis_timeout_s must be > 0")
        _require(self.burst_seconds > 0, "limits.burst_seconds must be > 0")

    @property
    def uses_redis(self) -> bool:
        return self.storage_url.startswith(("redis://", "rediss://"))

    @property
    def uses_embedded(self) -> bool:
        """The store shared by the workers of one gateway (app/limit_store.py)."""
        return self.storage_url.startswith("embedded:")


@dataclass(frozen=True)
class TierConfig:
    name: str
    requests_per_minute: int
    tokens_per_second: float
    burst_tokens: int
    models: tuple[str, ...]
    max_latency_class: LatencyClass = LatencyClass.STANDARD
    default_latency_class: LatencyClass = LatencyClass.STANDARD

    def __post_init__(self) -> None:
        _require(self.requests_per_minute >= 1, f"tiers.{self.name}.requests_per_minute must be >= 1")
        _require(self.tokens_per_second > 0, f"tiers.{self.name}.tokens_per_second must be > 0")
        _require(self.burst_tokens >= 1, f"tiers.{self.name}.burst_tokens must be >= 1")
        object.__setattr__(self, "models", tuple(self.models))


@dataclass(frozen=True)
class OrgConfig:
    id: str
    tier: str
    max_latency_class: LatencyClass
    default_latency_class: LatencyClass


def _read_chat_template(path: str, where: str) -> str:
    """The source of the chat template at `path`, checked to compile and to fit in a node request."""
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    _require(0 < len(source) <= MAX_CHAT_TEMPLATE_CHARS,
             f"{where}: {path} must hold 1 to {MAX_CHAT_TEMPLATE_CHARS} characters")
    try:
        cached_chat_template(source)
    except TemplateCompileError as exc:
        raise ConfigError(f"{where}: {path}: {exc}") from None
    return source


@dataclass(frozen=True)
class ModelConfig:
    alias: str
    model: str
    quantization: str
    max_context: int = 8192
    default_max_tokens: int = 512
    cold_load_s: float = 5.0
    chat: bool = True          # false: the model has no chat template; chat requests get a 400 here
    chat_template: str = ""    # a .jinja file (relative to the config file's folder) rendering this alias's chats
    # the template's source, read from chat_template at load (sent to the nodes with each chat request)
    chat_template_source: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        _require(bool(self.model), f"models.{self.alias}.model must not be empty")
        _require(isinstance(self.chat, bool), f"models.{self.alias}.chat must be true or false")
        if self.chat_template:
            _require(self.chat, f"models.{self.alias}: chat = false and a chat_template contradict each other "
                                "(a named template makes the alias serve chat)")
            object.__setattr__(self, "chat_template_source", _read_chat_template(self.chat_template,
                                                                                 f"models.{self.alias}.chat_template"))
        _require(self.quantization in FORMATS,
                 f"models.{self.alias}.quantization must be one of {FORMATS}")
        _require(self.max_context >= 16, f"models.{self.alias}.max_context must be >= 16")
        _require(1 <= self.default_max_tokens <= self.max_context,
                 f"models.{self.alias}.default_max_tokens must be in [1, max_context]")
        _require(self.cold_load_s >= 0, f"models.{self.alias}.cold_load_s must be >= 0")


@dataclass(frozen=True)
class NodesConfig:
    urls: tuple[str, ...] = ()
    secret: str = ""
    poll_interval_s: float = 1.0
    state_ttl_s: float = 5.0
    max_temperature_c: float = 85.0
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    max_attempts: int = 3
    dns_refresh_s: float = 10.0      # how often dns+http(s):// names are resolved again (app/discovery.py)

    def __post_init__(self) -> None:
        urls = tuple(u.strip().rstrip("/") for u in self.urls if u.strip())
        object.__setattr__(self, "urls", urls)
        for url in urls:
            _require(_is_node_url(url), f"nodes.urls: not an http(s) or dns+http(s) URL with a host and a "
                                        f"port in 1..65535: {url!r}")
        _require(len(set(urls)) == len(urls), "nodes.urls has duplicates")
        _require(self.poll_interval_s > 0, "nodes.poll_interval_s must be > 0")
        _require(self.state_ttl_s >= self.poll_interval_s,
                 "nodes.state_ttl_s must be >= nodes.poll_interval_s")
        _require(self.connect_timeout_s > 0 and self.read_timeout_s > 0,
                 "nodes.connect_timeout_s/read_timeout_s must be > 0")
        _require(self.max_attempts >= 1, "nodes.max_attempts must be >= 1")
        _require(self.dns_refresh_s > 0, "nodes.dns_refresh_s must be > 0")


def _is_node_url(url: str) -> bool:
    """Whether `url` names a host (and a valid port, if any) under a scheme the gateway reaches nodes by."""
    parsed = urlparse(url)
    try:
        port = parsed.port   # raises ValueError for "80O1" or 99999
    except ValueError:
        return False
    return (parsed.scheme in ("http", "https", "dns+http", "dns+https") and bool(parsed.hostname)
            and not any(c.isspace() for c in url) and (port is None or port >= 1))


ROUTING_POLICIES = ("score", "round_robin", "least_outstanding")   # app/routing_policy.py says what each does


@dataclass(frozen=True)
class RoutingConfig:
    alpha: float = 1.0
    beta: float = 1.0
    gamma: float = 1.0
    default_prefill_tokens_per_s: float = 500.0
    default_decode_tokens_per_s: float = 20.0
    policy: str = "score"              # score | round_robin | least_outstanding (app/routing_policy.py)
    prefix_weight: float = 1.0         # δ: weight of the prefill seconds a node's prefix cache likely saves
    prefix_block_chars: int = 64       # characters per hashed prompt block (about a 16-token KV block)
    prefix_index_blocks: int = 100_000   # block hashes the router remembers (LRU), per worker process

    def __post_init__(self) -> None:
        _require(min(self.alpha, self.beta, self.gamma, self.prefix_weight) >= 0, "routing weights must be >= 0")
        _require(self.policy in ROUTING_POLICIES,
                 f"routing.policy must be one of {', '.join(ROUTING_POLICIES)}, not {self.policy!r}")
        _require(self.prefix_block_chars >= 1 and self.prefix_index_blocks >= 1,
                 "routing.prefix_block_chars and routing.prefix_index_blocks must be >= 1")
        _require(self.default_prefill_tokens_per_s > 0 and self.default_decode_tokens_per_s > 0,
                 "routing default rates must be > 0")


@dataclass(frozen=True)
class TracingConfig:
    enabled: bool = True        # false: no traces even where an endpoint is configured
    endpoint: str = ""          # OTLP/HTTP collector (no path: /v1/traces is added) or traces URL; empty: off
    sample_ratio: float = 1.0   # share of traces started here that are kept (a client's sampled flag wins)

    def __post_init__(self) -> None:
        _require(isinstance(self.enabled, bool), "tracing.enabled must be true or false")
        _require(0.0 <= self.sample_ratio <= 1.0, "tracing.sample_ratio must be in [0, 1]")
        if self.endpoint:
            url = urlparse(self.endpoint)
            _require(url.scheme in ("http", "https") and bool(url.netloc),
                     f"tracing.endpoint: not an http(s) URL: {self.endpoint!r}")


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway reads, validated as a whole."""

    server: ServerConfig = field(default_factory=ServerConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    nodes: NodesConfig = field(default_factory=NodesConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    tiers: Mapping[str, TierConfig] = field(default_factory=dict)
    orgs: Mapping[str, OrgConfig] = field(default_factory=dict)
    models: Mapping[str, ModelConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(len(self.tiers) > 0, "at least one tier must be configured")
        _require(len(self.models) > 0, "at least one model must be configured")
        for tier in self.tiers.values():
            for alias in tier.models:
                _require(alias in self.models,
                         f"tiers.{tier.name}.models: unknown model alias {alias!r}")
        for org in self.orgs.values():
            _require(org.tier in self.tiers, f"orgs.{org.id}.tier: unknown tier {org.tier!r}")
            _require(org.default_latency_class.rank >= org.max_latency_class.rank,
                     f"orgs.{org.id}: default_latency_class is above its max_latency_class")
        _require(self.auth.default_tier in self.tiers,
                 f"auth.default_tier: unknown tier {self.auth.default_tier!r}")
        shipped = self.development_secrets_in_use()
        _require(not shipped or is_loopback_host(self.server.host),
                 self.development_secrets_message(f"server.host {self.server.host!r}"))

    def development_secrets_message(self, where: str) -> str:
        """Why serving on `where` (not loopback) is refused while shipped secrets are in use."""
        return (f"{where} is not a loopback address, and the gateway would serve it with the public development "
                f"secrets of config/default.toml: "
                + ", ".join(f"{s.key} (set {s.env})" for s in self.development_secrets_in_use())
                + ". Set those environment variables to secrets of your own, or serve on 127.0.0.1.")

    def development_secrets_in_use(self) -> list[DevelopmentSecret]:
        """The shipped development secrets this configuration still uses."""
        in_use = []
        for secret in DEVELOPMENT_SECRETS:
            if secret.key == "auth.hs256_secret" and not self.auth.allows_hmac:
                continue    # never used to verify a token
            section, name = secret.key.split(".")
            if getattr(getattr(self, section), name) == secret.value:
                in_use.append(secret)
        return in_use

    def replace(self, **changes: Any) -> "GatewayConfig":
        return dataclasses.replace(self, **changes)


# -- building -----------------------------------------------------------------------------

def _latency(value: Any, where: str) -> LatencyClass:
    try:
        return LatencyClass.parse(str(value))
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "nothing"}
# what a TOML value is, for the message (never the value itself: it may be a secret)
_VALUE_NAMES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array",
                dict: "a table"}


def _fits(value: Any, hint: Any) -> bool:
    """Whether `value` has the type a dataclass field is annotated with (true/false is no number)."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_fits(value, h) for h in get_args(hint))
    if origin is tuple:
        return isinstance(value, (list, tuple)) and all(_fits(v, get_args(hint)[0]) for v in value)
    if hint in (int, float) and isinstance(value, bool):
        return False
    if hint is float:
        return isinstance(value, (int, float))
    if hint in _TYPE_NAMES:
        return isinstance(value, hint)
    return True   # LatencyClass and the like: parsed by their own check, which names the key


def _type_name(hint: Any) -> str:
    if get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_type_name(h) for h in get_args(hint) if h is not type(None))
    if get_origin(hint) is tuple:
        return f"an array, each {_type_name(get_args(hint)[0])}"
    return _TYPE_NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def _value_name(value: Any) -> str:
    if isinstance(value, list) and value:
        return "an array holding " + " and ".join(sorted({_value_name(v) for v in value}))
    return _VALUE_NAMES.get(type(value), type(value).__name__)


def _table(value: Any, where: str) -> Mapping[str, Any]:
    _require(isinstance(value, Mapping), f"{where} must be a table, got {_value_name(value)}")
    return value


def _check_types(cls: type, data: Mapping[str, Any], where: str) -> None:
    """Refuse a value whose type is not its field's, naming the key: before the checks that compare it."""
    hints = get_type_hints(cls)
    for key, value in data.items():
        if key in hints and not _fits(value, hints[key]):
            raise ConfigError(f"{where}.{key} must be {_type_name(hints[key])}, got {_value_name(value)}")


def _section(cls: type, data: Any, where: str) -> Any:
    data = _table(data, where)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - known
    _require(not unknown, f"[{where}] unknown keys: {sorted(unknown)}")
    _check_types(cls, data, where)
    return cls(**data)


def _model(alias: str, m: Any, base: Path) -> ModelConfig:
    m = dict(_table(m, f"models.{alias}"))
    _require("chat_template_source" not in m, f"[models.{alias}] unknown keys: ['chat_template_source']")
    if isinstance(m.get("chat_template"), str) and m["chat_template"]:
        m["chat_template"] = str(base / m["chat_template"])   # an absolute path stays as it is
    return _section(ModelConfig, {"alias": alias, **m}, f"models.{alias}")


def _build(data: Mapping[str, Any], base: Path) -> GatewayConfig:
    top_known = {"server", "auth", "limits", "nodes", "routing", "tracing", "tiers", "orgs", "models"}
    unknown = set(data) - top_known
    _require(not unknown, f"unknown config sections: {sorted(unknown)}")
    limits = _section(LimitsConfig, data.get("limits", {}), "limits")

    tiers = {}
    for name, t in _table(data.get("tiers", {}), "tiers").items():
        t = dict(_table(t, f"tiers.{name}"))
        _check_types(TierConfig, t, f"tiers.{name}")
        rate = float(t.pop("tokens_per_second", 0))
        burst = int(t.pop("burst_tokens", round(rate * limits.burst_seconds)))
        tiers[name] = TierConfig(
            name=name,
            requests_per_minute=int(t.pop("requests_per_minute", 0)),
            tokens_per_second=rate,
            burst_tokens=burst,
            models=tuple(t.pop("models", ())),
            max_latency_class=_latency(t.pop("max_latency_class", "standard"),
                                       f"tiers.{name}.max_latency_class"),
            default_latency_class=_latency(t.pop("default_latency_class", "standard"),
                                           f"tiers.{name}.default_latency_class"),
        )
        _require(not t, f"[tiers.{name}] unknown keys: {sorted(t)}")

    orgs = {}
    for org_id, o in _table(data.get("orgs", {}), "orgs").items():
        o = dict(_table(o, f"orgs.{org_id}"))
        _check_types(OrgConfig, o, f"orgs.{org_id}")
        tier_name = o.pop("tier", None)
        _require(tier_name in tiers, f"orgs.{org_id}.tier: unknown tier {tier_name!r}")
        tier = tiers[tier_name]
        max_cls = _latency(o.pop("max_latency_class", tier.max_latency_class.label),
                           f"orgs.{org_id}.max_latency_class")
        default_cls = _latency(o.pop("default_latency_class", tier.default_latency_class.label),
                               f"orgs.{org_id}.default_latency_class")
        _require(not o, f"[orgs.{org_id}] unknown keys: {sorted(o)}")
        orgs[org_id] = OrgConfig(org_id, tier_name, max_cls, default_cls)

    models = {alias: _model(alias, m, base) for alias, m in _table(data.get("models", {}), "models").items()}

    return GatewayConfig(
        server=_section(ServerConfig, data.get("server", {}), "server"),
        auth=_section(AuthConfig, data.get("auth", {}), "auth"),
        limits=limits,
        nodes=_section(NodesConfig, data.get("nodes", {}), "nodes"),
        routing=_section(RoutingConfig, data.get("routing", {}), "routing"),
        tracing=_section(TracingConfig, data.get("tracing", {}), "tracing"),
        tiers=tiers,
        orgs=orgs,
        models=models,
    )


def merge_tables(base: dict, overrides: Mapping[str, Any]) -> dict:
    """Deep-merge `overrides` into a copy of `base` (tables merge, other values replace)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge_tables(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _env_overrides(env: Mapping[str, str]) -> dict:
    over: dict[str, dict] = {}
    if env.get("PORT"):
        try:
            over.setdefault("server", {})["port"] = int(env["PORT"])
        except ValueError:
            raise ConfigError(f"PORT is not an integer: {env['PORT']!r}") from None
    if env.get("JWT_SECRET"):
        over.setdefault("auth", {})["hs256_secret"] = env["JWT_SECRET"]
    if env.get("REDIS_URL"):
        over.setdefault("limits", {})["storage_url"] = env["REDIS_URL"]
    if env.get("ZEN_NODES"):
        over.setdefault("nodes", {})["urls"] = [u for u in env["ZEN_NODES"].split(",") if u.strip()]
    if env.get("METRICS_TOKEN"):
        over.setdefault("server", {})["metrics_token"] = env["METRICS_TOKEN"]
    if env.get("NODE_SECRET"):
        over.setdefault("nodes", {})["secret"] = env["NODE_SECRET"]
    if any(name.startswith("OTEL_") for name in env):   # tracing's module only where it may be on
        from engine.tracing import endpoint_from_env, sdk_disabled
        if sdk_disabled(env):
            over.setdefault("tracing", {})["enabled"] = False
        elif endpoint_from_env(env):
            over.setdefault("tracing", {})["endpoint"] = endpoint_from_env(env)
    return over


def load_config(path: str | os.PathLike | None = None, *,
                env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> GatewayConfig:
    """Build the configuration: TOML file, then environment, then `overrides`."""
    env = os.environ if env is None else env
    path = Path(path or env.get("ZEN_CONFIG") or DEFAULT_CONFIG_PATH)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    data = merge_tables(data, _env_overrides(env))
    if overrides:
        data = merge_tables(data, overrides)
    try:
        return _build(data, path.resolve().parent)
    except TypeError as exc:  # a wrong type that the dataclass constructor refused
        raise ConfigError(f"{path}: {exc}") from None
