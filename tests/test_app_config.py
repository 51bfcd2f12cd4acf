"""Configuration, latency classes and the model catalog of the gateway."""
from __future__ import annotations

import tomllib

import pytest

from app.catalog import Catalog
from app.config import DEFAULT_CONFIG_PATH, DEVELOPMENT_SECRETS, ConfigError, load_config
from engine.protocol import APIError
from app.priority import cap_latency_class, latency_class_for
from engine.protocol import LatencyClass


def test_shipped_default_config_loads():
    cfg = load_config(DEFAULT_CONFIG_PATH, env={})
    assert cfg.server.port == 8000
    assert cfg.models["zen-small"].model == "SmolLM2-135M-Instruct"
    assert cfg.models["zen-small"].quantization == "q4_1"
    assert cfg.models["zen-small"].max_context == 8192
    assert {m.quantization for m in cfg.models.values()} == {"q4_1", "q8_0", "f16", "q4_k"}
    # burst proportional to the tier: tokens_per_second * burst_seconds
    for tier in cfg.tiers.values():
        assert tier.burst_tokens == round(tier.tokens_per_second * cfg.limits.burst_seconds)
    assert cfg.tiers["pro"].burst_tokens > cfg.tiers["free"].burst_tokens
    assert cfg.orgs["globex"].max_latency_class is LatencyClass.STANDARD
    assert cfg.limits.storage_url == "embedded://" and cfg.limits.uses_embedded


def test_environment_overrides_secrets_and_addresses():
    env = {"PORT": "9123", "JWT_SECRET": "x" * 40, "REDIS_URL": "redis://127.0.0.1:6390/1",
           "ZEN_NODES": "http://10.0.0.1:8001, http://10.0.0.2:8001/", "NODE_SECRET": "s3"}
    cfg = load_config(env=env)
    assert cfg.server.port == 9123
    assert cfg.auth.hs256_secret == "x" * 40
    assert cfg.limits.storage_url == "redis://127.0.0.1:6390/1" and cfg.limits.uses_redis
    assert cfg.nodes.urls == ("http://10.0.0.1:8001", "http://10.0.0.2:8001")
    assert cfg.nodes.secret == "s3"


def test_test_overrides_win_over_env():
    cfg = load_config(env={"PORT": "9123"}, overrides={"server": {"port": 9999}})
    assert cfg.server.port == 9999


def test_config_file_from_env(tmp_path):
    text = DEFAULT_CONFIG_PATH.read_text().replace("port = 8000", "port = 8111")
    path = tmp_path / "gw.toml"
    path.write_text(text)
    assert load_config(env={"ZEN_CONFIG": str(path)}).server.port == 8111


@pytest.mark.parametrize("overrides, words", [
    ({"server": {"port": 0}}, "server.port"),
    ({"auth": {"hs256_secret": "short"}}, "hs256_secret"),
    ({"auth": {"algorithms": ["none"]}}, "unsupported algorithm"),
    ({"limits": {"storage_url": "mongodb://x"}}, "storage_url"),
    ({"limits": {"failure_policy": "maybe"}}, "failure_policy"),
    ({"tiers": {"free": {"models": ["nope"]}}}, "unknown model alias"),
    ({"orgs": {"acme": {"tier": "platinum"}}}, "unknown tier"),
    ({"orgs": {"globex": {"default_latency_class": "realtime"}}}, "above its max_latency_class"),
    ({"orgs": {"acme": {"max_latency_class": "urgent"}}}, "must be one of"),
    ({"models": {"zen-small": {"quantization": "q3_k"}}}, "quantization"),
    ({"nodes": {"urls": ["ftp://x"]}}, "nodes.urls"),
    ({"server": {"bogus": 1}}, "unknown keys"),
    ({"bogus": {}}, "unknown config sections"),
    ({"auth": {"jwks_url": "http://idp.example.com/jwks.json"}}, "jwks_url must be an https:// URL"),
    ({"auth": {"jwks_url": "http://10.0.0.7/jwks.json"}}, "jwks_url must be an https:// URL"),
    ({"auth": {"jwks_url": "file:///etc/jwks.json"}}, "jwks_url must be an https:// URL"),
    ({"auth": {"jwks_url": "https:///jwks.json"}}, "jwks_url must be an https:// URL"),
    ({"auth": {"jwks_refetch_interval_s": 0}}, "jwks_refetch_interval_s"),
    ({"auth": {"max_token_lifetime_s": -1}}, "max_token_lifetime_s"),
    ({"auth": {"allow_unconfigured_orgs": "false"}}, "allow_unconfigured_orgs must be true or false"),
    ({"tracing": {"enabled": "false"}}, "tracing.enabled must be true or false"),
])
def test_invalid_config_is_refused_naming_the_key(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_config(env={}, overrides=overrides)


@pytest.mark.parametrize("url", ["https://idp.example.com/.well-known/jwks.json",
                                 "http://127.0.0.1:8080/jwks.json", "http://localhost/jwks.json",
                                 "http://[::1]:9000/jwks.json"])
def test_jwks_url_is_https_or_on_loopback(url):
    cfg = load_config(env={}, overrides={"auth": {"jwks_url": url, "algorithms": ["RS256"]}})
    assert cfg.auth.jwks_url == url
    assert cfg.auth.jwks_refetch_interval_s == 60.0 and cfg.auth.max_token_lifetime_s == 0


def test_development_secrets_are_the_shipped_ones():
    """DEVELOPMENT_SECRETS is what config/default.toml ships: the two cannot drift apart."""
    with open(DEFAULT_CONFIG_PATH, "rb") as fh:
        shipped = tomllib.load(fh)
    assert {s.key for s in DEVELOPMENT_SECRETS} == {"auth.hs256_secret", "nodes.secret",
                                                    "server.metrics_token"}
    for secret in DEVELOPMENT_SECRETS:
        section, name = secret.key.split(".")
        assert shipped[section][name] == secret.value, secret.key
    cfg = load_config(DEFAULT_CONFIG_PATH, env={})
    assert cfg.development_secrets_in_use() == list(DEVELOPMENT_SECRETS)
    env = {s.env: f"{s.env.lower()}-of-my-own-0123456789abcdef-0123456789" for s in DEVELOPMENT_SECRETS}
    assert load_config(DEFAULT_CONFIG_PATH, env=env).development_secrets_in_use() == []


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "localhost", "LocalHost", "::1", "[::1]"])
def test_development_secrets_are_fine_on_loopback(host):
    cfg = load_config(env={}, overrides={"server": {"host": host}})
    assert cfg.server.host == host and len(cfg.development_secrets_in_use()) == 3


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "gateway.example.com", "128.0.0.1"])
def test_development_secrets_are_refused_off_loopback(host):
    with pytest.raises(ConfigError, match="not a loopback address") as err:
        load_config(env={}, overrides={"server": {"host": host}})
    for secret in DEVELOPMENT_SECRETS:
        assert f"{secret.key} (set {secret.env})" in str(err.value)
        assert secret.value not in str(err.value)


def _jwks_file(path):
    """A JWKS file with one EC public key."""
    import json

    import jwt
    from cryptography.hazmat.primitives.asymmetric import ec
    path.write_text(json.dumps({"keys": [json.loads(jwt.algorithms.ECAlgorithm.to_jwk(
        ec.generate_private_key(ec.SECP256R1()).public_key()))]}))
    return path


def test_off_loopback_only_the_secrets_in_use_count(tmp_path):
    own = {"NODE_SECRET": "node-secret-of-my-own", "METRICS_TOKEN": "metrics-token-of-my-own"}
    keys = _jwks_file(tmp_path / "keys.json")
    with pytest.raises(ConfigError) as err:
        load_config(env=own, overrides={"server": {"host": "0.0.0.0"}})
    assert "auth.hs256_secret (set JWT_SECRET)" in str(err.value)
    assert "NODE_SECRET" not in str(err.value) and "METRICS_TOKEN" not in str(err.value)
    # the HS256 secret verifies nothing when no HS* algorithm is allowed
    cfg = load_config(env=own, overrides={"server": {"host": "0.0.0.0"},
                                          "auth": {"algorithms": ["RS256"], "jwks_file": str(keys)}})
    assert cfg.development_secrets_in_use() == []


def test_create_app_refuses_development_secrets_off_loopback():
    """The app factory (what gunicorn's workers build) goes through the same check."""
    from app import create_app
    shipped: dict = {"server": {"host": "0.0.0.0"}, "nodes": {"urls": []}}
    for secret in DEVELOPMENT_SECRETS:      # over whatever the environment sets
        section, name = secret.key.split(".")
        shipped.setdefault(section, {})[name] = secret.value
    with pytest.raises(ConfigError, match="not a loopback address"):
        create_app(shipped)


def test_bad_port_env_is_a_config_error():
    with pytest.raises(ConfigError, match="PORT"):
        load_config(env={"PORT": "eighty"})


@pytest.mark.parametrize("overrides, message", [
    ({"server": {"port": "8000"}}, "server.port must be an integer, got a string"),
    ({"server": {"port": True}}, "server.port must be an integer, got a boolean"),
    ({"models": {"zen-small": {"max_context": "8192"}}}, "models.zen-small.max_context must be an integer"),
    ({"tiers": {"free": {"requests_per_minute": "twenty"}}}, "tiers.free.requests_per_minute must be an integer"),
    ({"tiers": {"free": {"tokens_per_second": "fast"}}}, "tiers.free.tokens_per_second must be a number"),
    ({"tiers": {"free": {"models": "zen-small"}}}, "tiers.free.models must be an array, each a string"),
    ({"tiers": {"free": "x"}}, "tiers.free must be a table, got a string"),
    ({"orgs": {"acme": {"tier": ["pro"]}}}, "orgs.acme.tier must be a string, got an array"),
    ({"models": {"zen-small": 1}}, "models.zen-small must be a table"),
    ({"server": 8000}, "server must be a table"),
    ({"auth": {"hs256_secret": 10 ** 40}}, "auth.hs256_secret must be a string, got an integer"),
    ({"nodes": {"urls": [8001]}}, "nodes.urls must be an array, each a string, got an array holding an integer"),
    ({"limits": {"storage_url": 6379}}, "limits.storage_url must be a string"),
    ({"nodes": {"max_attempts": 2.5}}, "nodes.max_attempts must be an integer, got a float"),
    ({"nodes": {"poll_interval_s": False}}, "nodes.poll_interval_s must be a number, got a boolean"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(env={}, overrides=overrides)
    assert message in str(err.value)
    assert str(10 ** 40) not in str(err.value)    # a value is never echoed: it may be a secret


def test_a_float_key_takes_an_integer():
    cfg = load_config(env={}, overrides={"auth": {"leeway_s": 5}, "tiers": {"free": {"tokens_per_second": 100}}})
    assert cfg.auth.leeway_s == 5 and cfg.tiers["free"].tokens_per_second == 100.0


@pytest.mark.parametrize("name, line, new_line, words", [
    ("rpm", "requests_per_minute = 20\n", 'requests_per_minute = "twenty"\n', "tiers.free.requests_per_minute"),
    ("tier", "[tiers.free]\n", '[tiers]\nfree = "x"\n[tiers.free-old]\n', "tiers.free must be a table"),
])
def test_serve_reports_a_wrong_type_without_a_traceback(tmp_path, name, line, new_line, words):
    """`python -m app serve` prints its one `error:` line and exits 2, before gunicorn starts."""
    import os
    import subprocess
    import sys
    text = DEFAULT_CONFIG_PATH.read_text()
    assert line in text
    path = tmp_path / f"{name}.toml"
    path.write_text(text.replace(line, new_line, 1))
    env = {k: v for k, v in os.environ.items() if k not in ("PORT", "ZEN_NODES", "JWT_SECRET")}
    out = subprocess.run([sys.executable, "-m", "app", "serve"], env={**env, "ZEN_CONFIG": str(path)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"error: {path}" not in out.stderr and words in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "dns+http://localhost:80O1", "http://:8001",
                                 "http://10.0.0.1:0", "http://a:8001 http://b:8001"])
def test_a_node_url_needs_a_host_and_a_valid_port(url):
    with pytest.raises(ConfigError, match="nodes.urls") as err:
        load_config(env={}, overrides={"nodes": {"urls": [url]}})
    assert repr(url) in str(err.value)


def test_zen_nodes_separated_by_spaces_is_refused():
    with pytest.raises(ConfigError, match="nodes.urls"):
        load_config(env={"ZEN_NODES": "http://a:8001 http://b:8001"})
    cfg = load_config(env={"ZEN_NODES": "http://[::1]:8001,dns+https://zen-node.svc:8443,http://node"})
    assert cfg.nodes.urls == ("http://[::1]:8001", "dns+https://zen-node.svc:8443", "http://node")


@pytest.mark.parametrize("overrides, words", [
    ({"server": {"log_level": "verbose"}}, "server.log_level must be one of DEBUG, INFO"),
    ({"nodes": {"max_attempts": 0}}, "nodes.max_attempts must be >= 1"),
    ({"auth": {"dev_token_ttl_s": -3600}}, "auth.dev_token_ttl_s must be > 0"),
    ({"auth": {"dev_token_ttl_s": 0}}, "auth.dev_token_ttl_s must be > 0"),
    ({"auth": {"jwks_file": "/nonexistent/jwks.json"}}, "auth.jwks_file: cannot read /nonexistent/jwks.json"),
])
def test_keys_used_later_are_checked_at_load(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_config(env={}, overrides=overrides)


def test_jwks_file_must_be_a_readable_file(tmp_path):
    with pytest.raises(ConfigError, match="auth.jwks_file: cannot read"):
        load_config(env={}, overrides={"auth": {"jwks_file": str(tmp_path)}})    # a directory
    keys = tmp_path / "jwks.json"
    for text in ('{"keys": []}', '{"keys": [{"kty": "RSA"}]}', "not json"):
        keys.write_text(text)
        with pytest.raises(ConfigError, match="auth.jwks_file"):
            load_config(env={}, overrides={"auth": {"jwks_file": str(keys)}})
    _jwks_file(keys)
    assert load_config(env={}, overrides={"auth": {"jwks_file": str(keys)}}).auth.jwks_file == str(keys)
    with pytest.raises(ConfigError, match="not both"):
        load_config(env={}, overrides={"auth": {"jwks_file": str(keys), "jwks_url": "https://idp.example/jwks"}})
    assert load_config(env={}, overrides={"server": {"log_level": "debug"}}).server.log_level == "debug"


def _gunicorn_settings(tmp_path, **env_vars):
    """`gunicorn -c config/gunicorn.conf.py --print-config` with these environment variables."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "PORT", "ZEN_CONFIG"))}
    env.update({"ZEN_NODES": "http://127.0.0.1:9", "ZEN_LIMITS_DIR": str(tmp_path / "limits"),
                "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics"), **env_vars})
    for folder in ("limits", "metrics"):
        (tmp_path / folder).mkdir(exist_ok=True)
    root = DEFAULT_CONFIG_PATH.parent.parent
    return subprocess.run([sys.executable, "-m", "gunicorn", "-c", str(root / "config" / "gunicorn.conf.py"),
                           "--print-config", "wsgi:app"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("name, value", [("GATEWAY_WORKERS", "abc"), ("GATEWAY_WORKERS", "0"),
                                         ("GATEWAY_THREADS", "-1"), ("GATEWAY_THREADS", "2.5")])
def test_gateway_workers_and_threads_must_be_counts(tmp_path, name, value):
    out = _gunicorn_settings(tmp_path, **{name: value})
    assert out.returncode == 2                    # as `python -m app serve` exits for any setting it refuses
    assert f"error: {name} must be an integer >= 1, got {value!r}" in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_refuses_a_bad_count_before_it_says_it_serves():
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "app", "serve"], env={**os.environ, "GATEWAY_WORKERS": "0"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "error: GATEWAY_WORKERS must be an integer >= 1, got '0'" in out.stderr
    assert "gateway on" not in out.stderr


def test_gateway_workers_and_threads_from_the_environment(tmp_path):
    out = _gunicorn_settings(tmp_path, GATEWAY_WORKERS="3", GATEWAY_THREADS="5")
    assert out.returncode == 0, out.stderr[-2000:]
    settings = dict(map(str.strip, line.split("=", 1)) for line in out.stdout.splitlines() if " = " in line)
    assert settings["workers"] == "3" and settings["threads"] == "5"


@pytest.mark.parametrize("algorithms, expected", [(["HS512"], "HS512"), (["RS256", "HS384", "HS256"], "HS384"),
                                                  (["HS256", "HS512"], "HS256")])
def test_dev_token_is_signed_with_an_allowed_hs_algorithm(algorithms, expected):
    import jwt
    from app.auth import TokenVerifier
    from app.devtoken import mint_token
    cfg = load_config(env={"JWT_SECRET": "s" * 64}, overrides={"auth": {"algorithms": algorithms}})
    token = mint_token(cfg, "acme")
    assert jwt.get_unverified_header(token)["alg"] == expected
    assert TokenVerifier(cfg).authenticate("Bearer " + token).org == "acme"


# -- latency classes ---------------------------------------------------------------------------

@pytest.mark.parametrize("header, sla, default, expected", [
    (None, "realtime", "standard", "standard"),        # the org default
    ("", "realtime", "batch", "batch"),
    ("realtime", "realtime", "standard", "realtime"),
    ("REALTIME", "standard", "standard", "standard"),  # capped: no realtime in the SLA
    ("realtime", "batch", "batch", "batch"),
    ("batch", "realtime", "standard", "batch"),        # asking for less is always fine
    ("standard", "batch", "batch", "batch"),
])
def test_latency_class_capped_by_sla(header, sla, default, expected):
    got = latency_class_for(header, LatencyClass(sla), LatencyClass(default))
    assert got is LatencyClass(expected)


def test_unknown_latency_class_is_refused():
    with pytest.raises(ValueError, match="realtime, standard, batch"):
        latency_class_for("urgent", LatencyClass.REALTIME, LatencyClass.STANDARD)


def test_cap_never_raises_priority():
    for wanted in LatencyClass:
        for sla in LatencyClass:
            assert cap_latency_class(wanted, sla).rank >= sla.rank


# -- catalog -----------------------------------------------------------------------------------

def test_catalog_resolves_aliases_and_enforces_tiers():
    cfg = load_config(env={})
    cat = Catalog(cfg.models)
    free, pro = cfg.tiers["free"], cfg.tiers["pro"]
    m = cat.resolve("zen-small", free)
    assert (m.model, m.quantization) == ("SmolLM2-135M-Instruct", "q4_1")
    assert cat.resolve("zen-small-f16", pro).quantization == "f16"
    for alias, tier in [("zen-small-f16", free), ("gpt-4", pro), ("SmolLM2-135M-Instruct", pro)]:
        with pytest.raises(APIError) as err:
            cat.resolve(alias, tier)
        assert err.value.status == 404 and err.value.code == "model_not_found"
        assert err.value.param == "model"
    assert [m.alias for m in cat.visible_to(free)] == ["zen-small"]
    assert [m.alias for m in cat.visible_to(pro)] == ["zen-small", "zen-small-q8", "zen-small-f16", "zen-gemma"]


def test_the_gateway_does_not_load_the_engine_kernels():
    """A gateway worker needs the wire protocol, SamplingParams, and the grammar checks and tool-call
    format of structured outputs (llguidance, no tokenizer) only: numba (and the kernels) would cost
    every worker ~80 MB and seconds of start-up."""
    import subprocess
    import sys
    code = ("import os, sys; os.environ['ZEN_NODES'] = 'http://127.0.0.1:9'; "
            "from app import close_app, create_app; app = create_app(); close_app(app); "
            "print(sorted(m for m in sys.modules if m == 'numba' or m.startswith('engine.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ("['engine.client_socket', 'engine.grammar', 'engine.logs', 'engine.memory_dir', 'engine.protocol', "
                                  "'engine.request_body', 'engine.sampling', 'engine.tools']")
