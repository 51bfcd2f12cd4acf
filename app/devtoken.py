"""Print a development JWT: `python -m app.devtoken --org acme --tier pro`.

The token is signed with the first HS* algorithm the configuration allows (HS256 in the shipped
one) and the configured development secret (JWT_SECRET or [auth] hs256_secret), with the
configured issuer and audience, so the gateway built from the same configuration accepts it.
For development only: production tokens come from the operator's identity provider.
"""
from __future__ import annotations

import argparse
import sys
import time
import uuid

import jwt

from app.config import ConfigError, GatewayConfig, load_config


def mint_token(config: GatewayConfig, org: str, tier: str | None = None, *,
               ttl_s: int | None = None, subject: str = "dev", **claims) -> str:
    """An HS* token for `org`, accepted by a gateway running `config`."""
    now = int(time.time())
    if ttl_s is None:   # the configured lifetime, within what the gateway accepts
        ttl_s = config.auth.dev_token_ttl_s
        if config.auth.max_token_lifetime_s:
            ttl_s = min(ttl_s, config.auth.max_token_lifetime_s)
    payload = {
        "owner": org,
        "sub": subject,
        "iat": now,
        "nbf": now,
        "exp": now + ttl_s,
        "jti": uuid.uuid4().hex,
    }
    if tier:
        payload["tier"] = tier
    if config.auth.issuer:
        payload["iss"] = config.auth.issuer
    if config.auth.audience:
        payload["aud"] = config.auth.audience
    payload.update(claims)
    # the gateway refuses an HS* algorithm its allow-list lacks; none allowed: main() refuses before this
    algorithm = next((a for a in config.auth.algorithms if a.startswith("HS")), "HS256")
    return jwt.encode(payload, config.auth.hs256_secret, algorithm=algorithm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.devtoken", description=__doc__.splitlines()[0])
    parser.add_argument("--org", default="acme", help="organization (the `owner` claim)")
    parser.add_argument("--tier", default=None,
                        help="tier claim (used only for orgs not in the config)")
    parser.add_argument("--ttl", type=int, default=None, help="lifetime in seconds")
    parser.add_argument("--config", default=None, help="config file (default: ZEN_CONFIG or "
                                                       "config/default.toml)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not config.auth.allows_hmac:
        print("error: the configuration allows no HS* algorithm; dev tokens cannot be used",
              file=sys.stderr)
        return 2
    if args.tier is not None and args.tier not in config.tiers:
        print(f"error: unknown tier {args.tier!r}; configured: {', '.join(config.tiers)}",
              file=sys.stderr)
        return 2
    org_cfg = config.orgs.get(args.org)
    if org_cfg is not None and args.tier and args.tier != org_cfg.tier:
        print(f"note: org {args.org!r} is configured with tier {org_cfg.tier!r}; the gateway "
              f"uses that, not {args.tier!r}", file=sys.stderr)
    print(mint_token(config, args.org, args.tier, ttl_s=args.ttl))
    return 0


if __name__ == "__main__":
    sys.exit(main())
