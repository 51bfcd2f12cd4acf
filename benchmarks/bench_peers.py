"""Our engine against llama.cpp's, in one run on this machine: llama-bench and bench_engine.py side by side.

    python benchmarks/bench_peers.py                          # our CPU level (cpu_isa's pick) against llama.cpp
    python benchmarks/bench_peers.py --isa native,avx2        # also our AVX2 kernels against llama.cpp's AVX2 build

llama.cpp's `llama-bench` (built once into .peers/ by benchmarks/llama_cpp_build.py from the llama.cpp source
on PyPI) runs tg128, pp128 and pp512 on the same GGUF with --threads threads: built with this CPU's own
flags for our native level, and limited to AVX2 for our avx2 level (both sides then run the instructions of
an AVX2-only CPU, on this machine's cores and memory); our
benchmarks/bench_engine.py runs batch-1 decode (--decode-steps 128) and prefill 128 / 512 on the stored
format with NUMBA_NUM_THREADS=--threads, once per --isa level (ZEN_CPU_ISA; `native` is the level cpu_isa
picks for this CPU). --rounds repeats the lot, which side goes first alternating; each figure is the median
over the rounds (within a round: llama-bench's mean of -r runs, our median of --repeats runs).

Prints a table (llama.cpp's build, llama.cpp, ours, ratio, the issue's target: 21's for Llama, 23's for Gemma 3)
and writes --out (default bench-results/peers.json): every round's raw output of both, the machine (CPU model,
vector features, our levels), llama.cpp's builds.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: benchmarks/ is a package of the repository

from benchmarks.bench_engine import STORED, print_markdown_table  # noqa: E402
from benchmarks.llama_cpp_build import LEVEL_OPTIONS, LLAMA_CPP_PACKAGE, build  # noqa: E402
from benchmarks.serving_report import fmt_ratio, log, machine_info  # noqa: E402
from engine.backends import cpu_isa  # noqa: E402
from models.loader import read_gguf_fields  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "weights" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = ROOT / "bench-results" / "peers.json"
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
                "avx512_vnni", "avx512_bf16", "amx_int8", "asimd", "asimddp", "sve", "i8mm")
# (measure, llama-bench test, our figure's key in bench_engine's JSON row)
MEASURES = (("decode b=1", "tg128", ("decode_tok_s",)),
            ("prefill 128", "pp128", ("prefill_tok_s", "128")),
            ("prefill 512", "pp512", ("prefill_tok_s", "512")))
DEFAULT_DEPTHS = "1000,2000"   # batch-1 decode also after this many tokens of context (llama-bench -d)
# Targets, ours / llama.cpp. Issue 21's for a Llama model: batch-1 decode by our level, prefill on every
# level. Issue 23's for Gemma 3: at the level this CPU runs ("native"), decode 1.5x and prefill 1x.
DECODE_TARGET = {"avx512vnni": 2.0, "avxvnni": 1.5, "avx2": 1.5}
PREFILL_TARGET = 1.0
NATIVE_TARGETS = {"gemma3": (1.5, 1.0)}   # architecture -> (decode, prefill), native level only


def peer_level(isa: str) -> str:
    """The llama.cpp build our level is measured against: the one limited to the same instructions where
    there is one (avx2), else llama.cpp with this CPU's own flags."""
    return isa if isa in LEVEL_OPTIONS else "native"


def measures(depths: list[int]) -> tuple:
    """MEASURES, and decode after each depth of context."""
    return MEASURES + tuple((f"decode b=1 @ {d}", f"tg128@d{d}", ("decode_depth_tok_s", str(d))) for d in depths)


def target_of(architecture: str, isa: str, level: str, test: str) -> float | None:
    """The target ratio of one row: `isa` as asked (native, avx2, ...), `level` what it resolved to. The
    issues' targets are for an empty context: decode after a depth has none."""
    if "@d" in test:
        return None
    decode = test.startswith("tg")
    if architecture in NATIVE_TARGETS:
        return NATIVE_TARGETS[architecture][0 if decode else 1] if isa == "native" else None
    return DECODE_TARGET.get(level) if decode else PREFILL_TARGET


def cpu_vector_flags() -> list[str]:
    """The vector features /proc/cpuinfo lists for this CPU (x86 `flags` or ARM `Features`)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                have = set(line.split(":", 1)[1].split())
                return [f for f in VECTOR_FLAGS if f in have]
    except OSError:
        pass
    return []


def levels_to_run(requested: list[str], features: set[str]) -> tuple[list[str], list[str]]:
    """The requested levels this CPU runs, `native` first and a level equal to native's pick dropped;
    and those it cannot run (an AVX2 level on ARM64, say), which are reported rather than failed."""
    native = cpu_isa.best_level(features)
    run, cannot = [], []
    for isa in dict.fromkeys(requested):
        if isa != "native" and isa not in cpu_isa.LEVELS:
            raise SystemExit(f"error: --isa {isa}: expected native or one of {', '.join(cpu_isa.LEVELS)}")
        if isa == "native" or (isa != native and cpu_isa.runs(isa, features)):
            run.append(isa)
        elif isa != native:
            cannot.append(isa)
    return sorted(run, key=lambda isa: isa != "native"), cannot


def run_llama_bench(bench: Path, model: Path, threads: int, repetitions: int, depths: list[int]) -> dict:
    """llama-bench's JSON rows for tg128, pp128 and pp512, and tg128 after each depth of context (tg128@d1000),
    keyed by test name."""
    runs = [["-p", "128,512", "-n", "128"]]
    if depths:
        runs.append(["-p", "0", "-n", "128", "-d", ",".join(map(str, depths))])
    rows = {}
    for tests in runs:
        argv = [str(bench), "-m", str(model), "-t", str(threads), *tests, "-r", str(repetitions), "-o", "json"]
        log(f"llama-bench: {' '.join(argv[1:])}")
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"error: llama-bench exited with {proc.returncode}: {proc.stderr.strip()[-800:]}")
        for row in json.loads(proc.stdout):
            name = f"tg{row['n_gen']}" if row["n_gen"] else f"pp{row['n_prompt']}"
            rows[name + (f"@d{row['n_depth']}" if row.get("n_depth") else "")] = row
    return rows


def run_peer_builds(builds: dict, model: Path, threads: int, repetitions: int, depths: list[int]) -> dict:
    """run_llama_bench's rows for each llama.cpp build, keyed by its level."""
    return {level: run_llama_bench(b.bench, model, threads, repetitions, depths) for level, b in builds.items()}


def run_our_engine(model: Path, threads: int, isa: str, repeats: int, depths: list[int]) -> dict:
    """bench_engine.py's JSON for the stored format at one ISA level (`native`: cpu_isa's own pick)."""
    env = {**os.environ, "NUMBA_NUM_THREADS": str(threads)}
    env.pop("ZEN_CPU_ISA", None)
    if isa != "native":
        env["ZEN_CPU_ISA"] = isa
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "engine.json"
        argv = [sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--model", str(model), "--formats",
                STORED, "--prefill", "128,512", "--decode-steps", "128", "--repeats", str(repeats), "--out", str(out),
                "--decode-depth", ",".join(map(str, depths))]
        log(f"bench_engine.py at {isa}: {' '.join(argv[2:])}")
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"error: bench_engine.py ({isa}) exited with {proc.returncode}: "
                             f"{proc.stderr.strip()[-800:]}")
        return json.loads(out.read_text())


def our_figure(engine_json: dict, key: tuple) -> float:
    value = engine_json["results"][0]
    for k in key:
        value = value[k]
    return float(value)


def summarize(rounds: list[dict], isas: list[str], architecture: str = "llama", depths: list[int] = ()) -> list[dict]:
    """Per our level and measure: medians over the rounds of both sides, the ratio and its target."""
    rows = []
    for isa in isas:
        level, peer_build = rounds[0]["ours"][isa]["machine"]["cpu_isa"], peer_level(isa)
        for measure, test, key in measures(list(depths)):
            peer = float(np.median([r["llama_bench"][peer_build][test]["avg_ts"] for r in rounds]))
            ours = float(np.median([our_figure(r["ours"][isa], key) for r in rounds]))
            target = target_of(architecture, isa, level, test)
            rows.append({"isa": level, "measure": measure, "llama_bench_test": test, "llama_cpp_build": peer_build,
                         "llama_cpp_tok_s": peer,
                         "ours_tok_s": ours, "ratio": ours / peer, "target_ratio": target,
                         "met": None if target is None else ours / peer >= target})
    return rows


def print_table(rows: list[dict], threads: int) -> None:
    head = ["our level", "measure", "llama.cpp build", "llama.cpp tok/s", "ours tok/s", "ours / llama.cpp", "target",
            "met"]
    cells = [[r["isa"], f"{r['measure']} ({r['llama_bench_test']})", r["llama_cpp_build"],
              f"{r['llama_cpp_tok_s']:.1f}", f"{r['ours_tok_s']:.1f}", fmt_ratio(r["ratio"]),
              "-" if r["target_ratio"] is None else f">= {r['target_ratio']:g}x",
              "-" if r["met"] is None else ("yes" if r["met"] else "no")] for r in rows]
    print(f"median over the rounds, {threads} threads on both sides")
    print_markdown_table(head, cells)


def _build_info(llama, bench_row: dict) -> dict:
    """What a llama.cpp build is, from the build and one of its llama-bench rows."""
    return {"package": llama.package, "version": llama.version, "level": llama.level,
            "build_commit": bench_row.get("build_commit"), "build_number": bench_row.get("build_number"),
            "cpu_info": bench_row.get("cpu_info"), "backends": bench_row.get("backends")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="the GGUF both sides run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", default="native", help="our levels to run, comma-separated: native (cpu_isa's pick), "
                                                    "avx512vnni, avxvnni, avx2, portable")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of both sides, which goes first alternating")
    ap.add_argument("--repetitions", type=int, default=5, help="llama-bench -r")
    ap.add_argument("--repeats", type=int, default=5, help="bench_engine.py --repeats (prefill)")
    ap.add_argument("--depths", default=DEFAULT_DEPTHS, help="batch-1 decode also after these many tokens of "
                                                              "context, comma-separated ('' for none)")
    ap.add_argument("--package", default=LLAMA_CPP_PACKAGE, help="the PyPI sdist llama.cpp is built from")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    model = Path(args.model)
    if not model.exists():
        log(f"error: {model} is missing: run `make model` first")
        return 2
    depths = [int(d) for d in args.depths.split(",") if d.strip()]
    isas, cannot = levels_to_run([x.strip() for x in args.isa.split(",") if x.strip()], cpu_isa.FEATURES)
    if cannot:
        log(f"note: this CPU cannot run our level(s) {', '.join(cannot)}: not measured")
    llama = {level: build(args.package, level=level) for level in dict.fromkeys(map(peer_level, isas))}
    load_before = os.getloadavg()
    rounds = []
    for k in range(args.rounds):
        this_round: dict = {"first": "llama.cpp" if k % 2 == 0 else "ours", "ours": {}}
        if k % 2 == 0:
            this_round["llama_bench"] = run_peer_builds(llama, model, args.threads, args.repetitions, depths)
        for isa in isas:
            this_round["ours"][isa] = run_our_engine(model, args.threads, isa, args.repeats, depths)
        if k % 2 == 1:
            this_round["llama_bench"] = run_peer_builds(llama, model, args.threads, args.repetitions, depths)
        rounds.append(this_round)
    rows = summarize(rounds, isas, read_gguf_fields(str(model), "general.").get("architecture", "llama"), depths)
    print_table(rows, args.threads)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["bench_peers.py"] + (argv if argv is not None else sys.argv[1:])),
        "model": model.name, "threads": args.threads, "depths": depths,
        "machine": {**machine_info(), "vector_flags": cpu_vector_flags(),
                    "our_levels": {isa: rounds[0]["ours"][isa]["machine"]["cpu_isa"] for isa in isas},
                    "levels_this_cpu_cannot_run": cannot,
                    "load_average_before": list(load_before), "load_average_after": list(os.getloadavg())},
        "llama_cpp": {level: _build_info(b, next(iter(rounds[0]["llama_bench"][level].values())))
                      for level, b in llama.items()},
        "table": rows, "rounds": rounds,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
