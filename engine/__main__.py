"""Command line: `python -m engine generate ...` (offline generation) and `python -m engine serve ...` (a node)."""
from __future__ import annotations

import argparse
import os
import sys
import time

from engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS


def _generate(args) -> int:
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    try:
        llm = LLM(model=args.model, quantization=args.quantization, backend=args.backend)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or None)
        t0 = time.perf_counter()
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            out = llm.generate(args.prompt, params)[0]
        dt = time.perf_counter() - t0
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    c = out.outputs[0]
    print(c.text)
    print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(c.token_ids)} generated in {dt:.2f} s, "
          f"finish: {c.finish_reason}]", file=sys.stderr)
    return 0


def _serve(args) -> int:
    import logging

    # The node keeps its metrics in its own registry, in its single worker: never multiprocess mode.
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    from engine.node.config import ModelSpec, NodeConfig, parse_bytes
    from engine.node.serve import configure_logging, serve

    configure_logging(args.log_level)
    try:
        config = NodeConfig(
            models=[ModelSpec.parse(m) for m in args.models], host=args.host, port=args.port,
            node_id=args.node_id, secret=NodeConfig.secret_from_env(args.secret_env, host=args.host),
            memory_budget_bytes=parse_bytes(args.memory_budget) if args.memory_budget else None,
            kv_cache_bytes=parse_bytes(args.kv_cache_bytes), max_waiting=args.max_waiting,
            org_waiting_share=args.org_waiting_share, backend=args.backend,
            block_size=args.block_size, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
            preload=args.preload, load_wait_s=args.load_wait, threads=args.threads,
            log_level=args.log_level, drain_grace_s=args.drain_grace_s, otlp_endpoint=args.otlp_endpoint)
        for spec in config.models:
            if not os.path.exists(spec.path):
                raise ValueError(f"model not found: {spec.path}")
    except ValueError as e:
        logging.getLogger("engine.node").error("bad configuration: %s", e)
        print(f"error: {e}", file=sys.stderr)
        return 2
    serve(config)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text offline")
    g.add_argument("--model", default=None, help="a .gguf file or a safetensors directory (default: the bundled SmolLM2)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--quantization", default=None)
    g.add_argument("--backend", default="auto")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    s = sub.add_parser("serve", help="run an engine node (HTTP, under gunicorn)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8001)
    s.add_argument("--models", nargs="+", action="extend", required=True, metavar="PATH[=ID]",
                   help="models this node may serve: a .gguf file or safetensors directory, optionally =ID")
    s.add_argument("--memory-budget", default=None, metavar="BYTES",
                   help="weights + KV cache of the resident models (e.g. 8GiB); default: 90%% of the GPU's "
                        "memory, or 80%% of the host's available memory")
    s.add_argument("--kv-cache-bytes", default="256MiB", metavar="BYTES", help="KV cache of each resident model")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="sequences accepted but not yet started; beyond it: 503 with Retry-After")
    s.add_argument("--org-waiting-share", type=float, default=1.0, metavar="SHARE",
                   help="most of --max-waiting one org's sequences may take; beyond it: 429 org_queue_full "
                        "(default 1: no bound of its own)")
    s.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    s.add_argument("--secret-env", default="NODE_SECRET",
                   help="environment variable holding the internal secret (X-Node-Secret)")
    s.add_argument("--node-id", default="")
    s.add_argument("--threads", type=int, default=None,
                   help="concurrent HTTP requests (streams); default: --max-num-seqs plus --max-waiting plus 32")
    s.add_argument("--preload", nargs="*", default=None, metavar="ID",
                   help="model ids to load at start (default: the listed models, in order, while they fit)")
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--load-wait", type=float, default=120.0, metavar="SECONDS",
                   help="how long a request waits for a cold load before a 503")
    s.add_argument("--drain-grace-s", type=float, default=os.environ.get("NODE_DRAIN_GRACE_S", "30"),
                   metavar="SECONDS", help="on SIGTERM: how long streams in flight may finish before they are "
                                           "ended (default 30, or NODE_DRAIN_GRACE_S)")
    s.add_argument("--log-level", default="info")
    s.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="export traces over OTLP/HTTP to this collector (default: OTEL_EXPORTER_OTLP_[TRACES_]"
                        "ENDPOINT; neither: no tracing)")
    args, rest = ap.parse_known_args(argv)
    if args.command == "serve":
        if rest:
            ap.error(f"unrecognized arguments: {' '.join(rest)}")
        return _serve(args)
    if args.command == "generate":
        if rest:
            ap.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.model is None:
            from models.loader import default_model_path
            args.model = default_model_path()
        return _generate(args)
    return 1


if __name__ == "__main__":
    sys.exit(main())
