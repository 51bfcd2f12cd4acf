"""Engine micro-benchmark: prefill and decode throughput of the CPU forward pass per weight format.

    python benchmarks/bench_engine.py [--model PATH] [--formats q4_1,q8_0,f16,f32] [--out bench-results/engine.json]

The CPU kernels' ISA level is the process's (engine/backends/cpu_isa.py): ZEN_CPU_ISA=avx2 ... measures another.

Drives the model's forward pass directly (models.build: Llama or Gemma 3; no scheduler) with a simple
contiguous block table per sequence (and per sliding-window layer group).
Every figure is the median of several timed runs after a warm-up (the fastest run is kept too: on a
shared machine it is the closer to what the code does alone); the machine's CPU, core count, date and
git commit go into the JSON next to the figures. `run_decode_batch(model, batch_size, steps)` measures
aggregate decode tokens/s at a given batch and is meant to be reused by the engine-level benchmark.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.backends import cpu_isa  # noqa: E402
from engine.backends.cpu import CpuBackend  # noqa: E402
from models.build import build_model  # noqa: E402
from models.gguf_file import read_gguf  # noqa: E402
from models.llama import LlamaModel, StepInput  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "weights" / "SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK_SIZE = 16
STORED = "stored"  # the name under which the model's own formats (as in its file) are benchmarked


# ------------------------------------------------------------------------------------------ harness
class Sequences:
    """KV cache and contiguous block tables for `n` sequences of up to `max_len` tokens each."""

    def __init__(self, model: LlamaModel, n: int, max_len: int):
        self.model = model
        self.blocks_per_seq = -(-max_len // BLOCK_SIZE)
        groups = 1 + model.window_groups   # a sliding-window model's local layer groups have blocks of their own
        self.k_cache, self.v_cache = model.allocate_kv_cache(groups * n * self.blocks_per_seq, BLOCK_SIZE)
        tables = np.arange(groups * n * self.blocks_per_seq, dtype=np.int32).reshape(groups, n, self.blocks_per_seq)
        self.block_tables, self.window_tables = tables[0], tables[1:]
        self.lens = np.zeros(n, np.int64)
        self.rng = np.random.default_rng(0)

    def _slots(self, seq: np.ndarray, pos: np.ndarray, tables=None) -> np.ndarray:
        blk = (self.block_tables if tables is None else tables)[seq, pos // BLOCK_SIZE].astype(np.int64)
        return blk * BLOCK_SIZE + pos % BLOCK_SIZE

    def _step(self, tokens, pos, seqs, logits_indices) -> StepInput:
        step = StepInput(tokens=tokens.astype(np.int32), positions=pos.astype(np.int32),
                         token_seq=seqs.astype(np.int32), slot_mapping=self._slots(seqs, pos),
                         block_tables=self.block_tables, logits_indices=logits_indices)
        if len(self.window_tables):
            step.window_slot_mapping = np.stack([self._slots(seqs, pos, t) for t in self.window_tables])
            step.window_block_tables = self.window_tables
        return step

    def prefill(self, seq: int, n_tokens: int) -> np.ndarray:
        """Appends n_tokens random tokens to sequence `seq` in one step; returns its last logits."""
        pos = np.arange(self.lens[seq], self.lens[seq] + n_tokens, dtype=np.int64)
        seqs = np.full(n_tokens, seq, np.int32)
        step = self._step(self.rng.integers(3, self.model.config.vocab_size, n_tokens), pos, seqs,
                          np.array([n_tokens - 1], np.int32))
        logits = self.model.forward(step, self.k_cache, self.v_cache)
        self.lens[seq] += n_tokens
        return logits

    def decode(self, seqs: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """One decode step: one token for each sequence in `seqs`."""
        pos = self.lens[seqs]
        step = self._step(tokens, pos, seqs, np.arange(len(seqs), dtype=np.int32))
        logits = self.model.forward(step, self.k_cache, self.v_cache)
        self.lens[seqs] += 1
        return logits


def _rates(tokens: int, times: list[float]) -> dict:
    """tokens/s from the median step time, and from the fastest one (on a shared machine the best run is
    the closest to what the code does alone)."""
    return {"median": tokens / float(np.median(times)), "best": tokens / float(np.min(times))}


def measure_prefill(model: LlamaModel, n_tokens: int, repeats: int = 5) -> dict:
    """Prefill tokens/s of one prompt of n_tokens ({'median', 'best'} over `repeats` runs after a warm-up)."""
    times = []
    for i in range(repeats + 1):
        s = Sequences(model, 1, n_tokens)
        t0 = time.perf_counter()
        s.prefill(0, n_tokens)
        if i:
            times.append(time.perf_counter() - t0)
    return _rates(n_tokens, times)


def measure_decode_batch(model: LlamaModel, batch_size: int, steps: int, prompt_len: int = 16,
                         warmup: int = 3) -> dict:
    """Aggregate decode tokens/s with `batch_size` sequences advancing together, one token each per step.

    Each sequence first gets a prompt of `prompt_len` tokens; the rates are batch_size / step time
    (greedy next tokens, so the work is that of real generation)."""
    s = Sequences(model, batch_size, prompt_len + warmup + steps + 1)
    last = np.empty(batch_size, np.int64)
    for q in range(batch_size):
        last[q] = int(np.argmax(s.prefill(q, prompt_len)[0]))
    seqs = np.arange(batch_size)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logits = s.decode(seqs, last)
        last = np.argmax(logits, axis=1)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return _rates(batch_size, times)


def run_prefill(model: LlamaModel, n_tokens: int, repeats: int = 5) -> float:
    """Prefill tokens/s (median) of one prompt of n_tokens."""
    return measure_prefill(model, n_tokens, repeats)["median"]


def run_decode_batch(model: LlamaModel, batch_size: int, steps: int) -> float:
    """Aggregate decode tokens/s (median step) with `batch_size` sequences decoding together."""
    return measure_decode_batch(model, batch_size, steps)["median"]


# ------------------------------------------------------------------------------------------ report
def print_markdown_table(head: list[str], rows: list[list[str]]) -> None:
    """A Markdown table, columns padded to their widest cell (pasted into RESULTS.md as it is)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", False
    import numba
    return {
        "cpu": cpu, "cpu_isa": cpu_isa.ISA, "cores": os.cpu_count(), "numba_threads": numba.config.NUMBA_NUM_THREADS,
        "python": platform.python_version(), "numba": numba.__version__, "numpy": np.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit, "git_dirty": dirty,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--formats", default=f"{STORED},q8_0,f16,f32",
                    help=f"comma-separated; '{STORED}' is the model as stored (its own formats)")
    ap.add_argument("--prefill", default="128,512", help="prompt lengths to time")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--batch", default="", help="also measure aggregate decode at these batch sizes, e.g. 16")
    ap.add_argument("--decode-depth", default="", help="also measure batch-1 decode after a context of these many "
                                                       "tokens, e.g. 1000,2000 (llama-bench's tg -d)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "engine.json"))
    args = ap.parse_args(argv)

    if not Path(args.model).exists():
        print(f"model not found: {args.model} (run `make model`)", file=sys.stderr)
        return 2
    stored, _ = read_gguf(args.model)
    stored_formats = sorted(stored.formats())
    prefill_lens = [int(n) for n in args.prefill.split(",") if n]
    batches = [int(n) for n in args.batch.split(",") if n]
    depths = [int(n) for n in args.decode_depth.split(",") if n]
    results = []
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        t0 = time.perf_counter()
        weights = stored if fmt == STORED else stored.converted(fmt)
        model = build_model(weights, CpuBackend())
        load_s = time.perf_counter() - t0
        # warm-up: compiles (or loads from cache) every kernel this path uses
        measure_prefill(model, max(prefill_lens or [16]), repeats=1)
        measure_decode_batch(model, 1, 4, warmup=1)
        for b in batches:
            measure_decode_batch(model, b, 2, warmup=1)
        prefill = {str(n): measure_prefill(model, n, args.repeats) for n in prefill_lens}
        decode = measure_decode_batch(model, 1, args.decode_steps)
        batched = {str(b): measure_decode_batch(model, b, max(8, args.decode_steps // 4)) for b in batches}
        deep = {str(d): measure_decode_batch(model, 1, args.decode_steps, prompt_len=d) for d in depths}
        r1 = lambda d: {k: round(v, 1) for k, v in d.items()}  # noqa: E731
        row = {
            "format": fmt, "weight_formats": stored_formats if fmt == STORED else [fmt],
            "weight_mb": round(model.nbytes / 1e6, 1), "load_s": round(load_s, 2),
            "prefill_tok_s": {n: round(v["median"], 1) for n, v in prefill.items()},
            "decode_tok_s": round(decode["median"], 1),
            "decode_batch_tok_s": {b: round(v["median"], 1) for b, v in batched.items()},
            "decode_depth_tok_s": {d: round(v["median"], 1) for d, v in deep.items()},
            "best": {"prefill_tok_s": {n: r1(v)["best"] for n, v in prefill.items()},
                     "decode_tok_s": r1(decode)["best"],
                     "decode_batch_tok_s": {b: r1(v)["best"] for b, v in batched.items()},
                     "decode_depth_tok_s": {d: r1(v)["best"] for d, v in deep.items()}},
        }
        results.append(row)
        print(f"  {fmt}: done", file=sys.stderr, flush=True)
        del model, weights

    head = ["format", "weights MB"] + [f"prefill {n} tok/s" for n in prefill_lens] + ["decode b=1 tok/s"]
    head += [f"decode b={b} tok/s" for b in batches] + [f"decode b=1 @ {d} tok/s" for d in depths]

    def cell(median, best):
        return f"{median:.0f} ({best:.0f})"
    rows = [[r["format"], f"{r['weight_mb']:.1f}"]
            + [cell(r["prefill_tok_s"][str(n)], r["best"]["prefill_tok_s"][str(n)]) for n in prefill_lens]
            + [cell(r["decode_tok_s"], r["best"]["decode_tok_s"])]
            + [cell(r["decode_batch_tok_s"][str(b)], r["best"]["decode_batch_tok_s"][str(b)]) for b in batches]
            + [cell(r["decode_depth_tok_s"][str(d)], r["best"]["decode_depth_tok_s"][str(d)]) for d in depths]
            for r in results]
    print("median (best) of the timed runs")
    print_markdown_table(head, rows)

    report = {"model": os.path.basename(args.model), "machine": machine_info(), "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
