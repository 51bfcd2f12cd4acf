"""The engine node: one process per accelerator serving the engine over HTTP (docs/node-protocol.md).

app (the Flask factory) and views (the endpoints) on top; node (what they serve from), admission,
generation, registry (resident models), loop (a model's step thread), config, telemetry, metrics;
serve runs it all under gunicorn (`python -m engine serve`).
"""
