"""What the serving benchmark prints and writes: a line per level, the machine, the targets beside the
peer, and the latency/throughput plot."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Issue 21's targets against llama-server -np N measured in the same run (--peer): ours / peer at N streams.
TARGET_VS_PEER_TOKENS_PER_S = {1: 1.2, 16: 2.5}
TARGET_VS_PEER_TTFT_P50 = {16: 1.0}       # our median TTFT no higher than the peer's


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine_info() -> dict:
    # the interpreter itself, not just its version: a build without PGO and LTO runs the gateway's Python
    # slower (docs/serving.md, The interpreter)
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "python_executable": os.path.realpath(sys.executable), "python_build": " ".join(platform.python_build()),
            "cpu_count": os.cpu_count(), "processor": platform.processor()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                            text=True, timeout=10).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=10).stdout.split("\n")
        info["git_uncommitted_changes"] = [line[3:] for line in changed if line.strip()][:50]
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def settings_of(args: Any, leave_out: tuple[str, ...] = ()) -> dict:
    """A run's options for its JSON, paths inside the repository relative to it (the JSON is committed;
    where the checkout lived is no setting)."""
    def portable(value: Any) -> Any:
        if isinstance(value, (str, Path)) and Path(value).is_absolute():
            try:
                return str(Path(value).resolve().relative_to(ROOT))
            except ValueError:
                return Path(value).name
        return value
    return {k: portable(v) for k, v in vars(args).items() if k not in leave_out}


def fmt_ms(d: dict, key: str = "p50") -> str:
    v = d.get(key)
    return "-" if v is None else f"{v * 1e3:8.1f}"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def print_level(name: str, s: dict) -> None:
    log(f"{name:>14} | {s['completed']:4d}/{s['requests']:<4d} err {s['error_rate']:5.1%} | "
        f"{s['requests_per_s']:6.2f} req/s {s['output_tokens_per_s']:8.1f} tok/s | "
        f"TTFT p50/p99 {fmt_ms(s['ttft_s'])}/{fmt_ms(s['ttft_s'], 'p99')} ms | "
        f"ITL p50/p99 {fmt_ms(s['itl_s'])}/{fmt_ms(s['itl_s'], 'p99')} ms | "
        f"E2E p50/p99 {fmt_ms(s['e2e_s'])}/{fmt_ms(s['e2e_s'], 'p99')} ms")


def targets(result: dict) -> dict:
    """Our figures at 16 streams, the gateway overhead, and, when the peer ran, each level's ratios to it
    beside issue 21's targets. No peer figure comes from anywhere but result["peer"]."""
    c16 = next((lv for lv in result["levels"] if lv["mode"] == "concurrency" and lv["concurrency"] == 16), None)
    o = next((x for x in result["overhead"] if x["ttft_diff_ms"]["n"]), None)
    out: dict[str, Any] = {"target_c16_ttft_p50_s": 1.0, "target_overhead_p50_ms": 2.0}
    if c16:
        out["c16_output_tokens_per_s"] = c16["output_tokens_per_s"]
        out["c16_ttft_p50_s"] = c16["ttft_s"]["p50"]
    if o:
        out["overhead_ttft_p50_ms"] = o["ttft_diff_ms"]["p50"]
        out["overhead_ttft_p50_ci95_ms"] = o.get("ttft_diff_p50_ci95_ms")
        out["overhead_e2e_p50_ms"] = o["e2e_diff_ms"]["p50"]
        out["overhead_concurrency"] = o["concurrency"]
    for lv in (result.get("peer") or {}).get("levels", []):
        c, tokens, ttft = lv["concurrency"], lv["output_tokens_per_s_ratio"], lv["ttft_p50_ratio"]
        out[f"c{c}_vs_peer_output_tokens_per_s"] = tokens
        out[f"c{c}_vs_peer_ttft_p50"] = ttft
        if c in TARGET_VS_PEER_TOKENS_PER_S:
            goal = out[f"c{c}_vs_peer_output_tokens_per_s_target"] = TARGET_VS_PEER_TOKENS_PER_S[c]
            out[f"c{c}_vs_peer_output_tokens_per_s_met"] = tokens is not None and tokens >= goal
        if c in TARGET_VS_PEER_TTFT_P50:
            goal = out[f"c{c}_vs_peer_ttft_p50_target"] = TARGET_VS_PEER_TTFT_P50[c]
            out[f"c{c}_vs_peer_ttft_p50_met"] = ttft is not None and ttft <= goal
    return out


def write_plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, metric, title in ((axes[0], "ttft_s", "time to first token"), (axes[1], "e2e_s", "end-to-end latency")):
        for mode, marker in (("concurrency", "o"), ("poisson", "s")):
            levels = [lv for lv in result["levels"] if lv["mode"] == mode and lv[metric]["n"]]
            if not levels:
                continue
            x = [lv["output_tokens_per_s"] for lv in levels]
            for pct, style in (("p50", "-"), ("p99", "--")):
                ax.plot(x, [lv[metric][pct] for lv in levels], style, marker=marker,
                        label=f"{pct}, {'fixed concurrency' if mode == 'concurrency' else 'Poisson rate'}")
            for lv, xi in zip(levels, x):
                label = f"c={lv['concurrency']}" if mode == "concurrency" else f"{lv['request_rate']:.2g}/s"
                ax.annotate(label, (xi, lv[metric]["p50"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens/s (aggregate)")
        ax.set_ylabel(f"{title} (s)")
        ax.set_title(f"{title} vs throughput")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    meta = result["meta"]
    fig.suptitle(f"zen gateway, {result['config']['model']} on {meta['machine'].get('cpu_count')} CPUs "
                 f"({meta['date'][:10]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
