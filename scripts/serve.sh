#!/usr/bin/env bash
# `make serve`: one engine node with the default model (GPU when present, CPU otherwise) and the
# gateway on 127.0.0.1:${PORT:-8000}. Ctrl-C stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=.venv/bin/python
MODEL=${ZEN_MODEL_PATH:-models/weights/SmolLM2-135M-Instruct.Q4_1.gguf}
NODE_PORT=${NODE_PORT:-8001}
export NODE_SECRET=${NODE_SECRET:-zen-development-node-secret}
export ZEN_NODES=${ZEN_NODES:-http://127.0.0.1:$NODE_PORT}
export PORT=${PORT:-8000}

# Gemma 3 (`make model-gemma`) joins the default model when its file is there: listed, loaded on the
# first request for it (the catalog's zen-gemma), while SmolLM2 alone is loaded at start.
GEMMA=models/weights/gemma-3-270m-q4_k_m.gguf
MODELS=("$MODEL")
if [ -z "${ZEN_MODEL_PATH:-}" ] && [ -f "$GEMMA" ]; then
    MODELS+=("$GEMMA=gemma-3-270m" --preload SmolLM2-135M-Instruct)
fi

$VPY -m engine serve --host 127.0.0.1 --port "$NODE_PORT" --models "${MODELS[@]}" &
node=$!
trap 'kill $node 2>/dev/null; wait $node 2>/dev/null' EXIT INT TERM

for _ in $(seq 1 240); do
    if curl -fs "http://127.0.0.1:$NODE_PORT/ready" >/dev/null 2>&1; then break; fi
    kill -0 $node 2>/dev/null || { echo "the engine node failed to start" >&2; exit 1; }
    if curl -s "http://127.0.0.1:$NODE_PORT/ready" 2>/dev/null | grep -q preload_failed; then
        echo "the engine node could not load its start-up model (its log above says why)" >&2; exit 1
    fi
    sleep 0.5
done

TOKEN=$($VPY -m app.devtoken --org acme --tier pro)
cat <<MSG

  Gateway: http://127.0.0.1:$PORT   (engine node: http://127.0.0.1:$NODE_PORT)
  A development token for org "acme" (make token ORG=acme TIER=pro makes others):

  curl http://127.0.0.1:$PORT/v1/chat/completions -H "Authorization: Bearer $TOKEN" \\
    -H "Content-Type: application/json" \\
    -d '{"model": "zen-small", "messages": [{"role": "user", "content": "What is the capital of France?"}]}'

MSG
$VPY -m app serve
