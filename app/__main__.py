"""`python -m app serve`: run the gateway under gunicorn with config/gunicorn.conf.py.

Extra arguments go to gunicorn (e.g. `--workers 4`). Configuration: config/default.toml,
or the file named by ZEN_CONFIG, with PORT, JWT_SECRET, REDIS_URL, ZEN_NODES, NODE_SECRET
and METRICS_TOKEN from the environment. An invalid configuration (among others: a host off
loopback with a shipped development secret) exits with status 2 before anything binds.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "serve":
        print("usage: python -m app serve [gunicorn options]", file=sys.stderr)
        return 2
    from app.config import ConfigError, count_from_env, load_config
    try:
        cfg = load_config()
        for name, default in (("GATEWAY_WORKERS", cfg.server.workers), ("GATEWAY_THREADS", cfg.server.threads)):
            count_from_env(name, default)   # refused here too: before the line that says it serves
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"gateway on http://{cfg.server.host}:{cfg.server.port}  nodes: "
          f"{', '.join(cfg.nodes.urls) or '(none)'}", file=sys.stderr)
    os.chdir(ROOT)
    gunicorn = [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "config" / "gunicorn.conf.py"),
                *argv[1:], "wsgi:app"]
    os.execv(sys.executable, gunicorn)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
