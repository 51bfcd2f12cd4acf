#!/usr/bin/env bash
# `make observe`: `make serve`'s stack (scripts/serve.sh: one engine node, the gateway) plus a real
# Prometheus on 127.0.0.1:${PROMETHEUS_PORT:-9090} that scrapes both (the gateway with its metrics token)
# and loads deploy/prometheus/rules.yml (scripts/local_prometheus.py). Ctrl-C stops all three.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=.venv/bin/python
command -v prometheus >/dev/null || { echo "prometheus is not installed: apt-get install prometheus" >&2; exit 1; }
export NODE_PORT=${NODE_PORT:-8001}
export PORT=${PORT:-8000}

$VPY -m scripts.local_prometheus --port "${PROMETHEUS_PORT:-9090}" --gateway "127.0.0.1:$PORT" \
    --node "127.0.0.1:$NODE_PORT" --scrape-interval "${SCRAPE_INTERVAL:-5s}" &
prometheus=$!
trap 'kill $prometheus 2>/dev/null; wait $prometheus 2>/dev/null' EXIT INT TERM

scripts/serve.sh
