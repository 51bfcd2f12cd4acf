"""Two resident models on one CPU node: decode speed with a step thread per model against one shared.

    python benchmarks/bench_resident_models.py [--model PATH] [--formats q4_1,q8_0] [--tokens 64]
                                               [--rounds 2] [--out bench-results/resident-models.json]

Two engines of the default model (in two weight formats, as a node holds them for two aliases) each
get an EngineLoop, as engine/node/registry.py makes them: either each on a thread of its own (how the node
did it before) or both on one StepThread (how it does now). Both models first answer one request, so
that each stepping thread has launched parallel kernels. Then, timed: requests to the first model alone
(its decode tokens/s while the other sits idle), and one request to each model at once (aggregate
tokens/s). The two set-ups alternate for --rounds rounds; medians are reported.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_engine import machine_info  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.node.loop import EngineLoop, StepThread  # noqa: E402
from engine.request import EngineRequest  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "weights" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Tell me a long story about the sea, the ships that sail on it and the people who sail them."


def generate(loop: EngineLoop, tokens: int, ids: list[int]) -> tuple[int, float]:
    """One request to completion: (tokens, seconds from its first token to its last)."""
    rid = f"bench-{time.monotonic_ns()}-{threading.get_ident()}"
    stream = loop.submit(EngineRequest(rid, loop.engine.model_id, ids,
                                          SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)))
    stamps = []
    for d in stream:
        stamps.extend(time.perf_counter() for _ in d.token_ids)
    return len(stamps), stamps[-1] - stamps[0]


def measure(engines: list[Engine], shared: bool, tokens: int, requests: int) -> dict:
    steps = StepThread("bench-steps") if shared else None
    loops = [EngineLoop(e, name=f"bench-{e.model_id}-{i}", thread=steps) for i, e in enumerate(engines)]
    ids = engines[0].tokenizer.encode(PROMPT)
    try:
        for loop in loops:                       # every stepping thread launches its kernels once
            generate(loop, 8, ids)
        alone = [generate(loops[0], tokens, ids) for _ in range(requests)]
        together: list[tuple[int, float]] = []
        t0 = time.perf_counter()
        workers = [threading.Thread(target=lambda lp=lp: together.append(generate(lp, tokens, ids))) for lp in loops]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - t0
    finally:
        for loop in loops:
            loop.stop()
    return {"alone_tok_s": sum(n - 1 for n, _ in alone) / sum(s for _, s in alone),
            "together_tok_s": sum(n for n, _ in together) / wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--formats", default="q4_1,q8_0", help="two weight formats: the two resident models")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="timed requests to the first model alone")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "resident-models.json"))
    args = ap.parse_args(argv)
    formats = args.formats.split(",")
    if len(formats) != 2:
        ap.error("--formats takes two weight formats")
    engines: list[Engine] = []

    def load() -> None:   # on a thread that then ends, as the node loads: its kernel threads end with it
        engines.extend(Engine(EngineConfig(model=args.model, quantization=f, backend="cpu",
                                           kv_cache_bytes=256 << 20)) for f in formats)

    loader = threading.Thread(target=load)
    loader.start()
    loader.join()
    runs: dict[str, list[dict]] = {"thread per model": [], "one step thread": []}
    for _ in range(args.rounds):
        for name, shared in (("thread per model", False), ("one step thread", True)):
            runs[name].append(measure(engines, shared, args.tokens, args.requests))
    rows = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}

    print(f"two resident models ({formats[0]} and {formats[1]}), {args.tokens} tokens per request, "
          f"medians of {args.rounds} rounds")
    print(f"{'set-up':<18} | {formats[0] + ' alone, tok/s':>20} | {'both at once, tok/s':>20}")
    for name, row in rows.items():
        print(f"{name:<18} | {row['alone_tok_s']:>20.1f} | {row['together_tok_s']:>20.1f}")
    out = {"machine": machine_info(), "model": Path(args.model).name, "formats": formats, "tokens": args.tokens,
           "requests": args.requests, "rounds": args.rounds, "results": rows, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
