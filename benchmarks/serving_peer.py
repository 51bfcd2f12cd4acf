"""The serving benchmark's peer: llama.cpp's own `llama-server` (continuous batching, `-np N` slots for N
streams) on the same GGUF and threads, driven by the same client with the same prompts as our stack, in
passes that alternate between the two; the ratios come from the pooled passes of each side.

The peer is started anew for each concurrency level (its slot count is fixed at start) on a free loopback
port, its log beside the results; a few unmeasured requests warm it up as ours was.

Each pass also reads the CPU time the server's processes and the client used (benchmarks/process_cpu.py):
on a machine whose cores the client shares, how many cores each side took is what explains the ratio.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.process_cpu import CpuMeter
from benchmarks.serving_report import fmt_ratio, log, print_level
from benchmarks.serving_stats import RequestRecord, summarize
from benchmarks.serving_workload import OpenAIDriver, PromptOrder, run_concurrency
from scripts.local_processes import Service, free_port, wait_http

PEER_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class PeerSettings:
    """How the peer runs and how much of the workload each pass sends."""
    server: Path                    # the llama-server binary
    version: str                    # what `llama-server --version` says
    model_path: Path
    threads: int
    ctx_per_stream: int             # context tokens per slot: llama-server splits -c among its slots
    concurrency: list[int]
    rounds: int                     # pass pairs per level
    requests_per_pass: int | None   # None: max(8, 2 x concurrency)


class LlamaServer:
    """`llama-server -np N` on a free loopback port, serving the model under `alias`."""

    def __init__(self, settings: PeerSettings, n_parallel: int, alias: str, log_path: Path):
        self.port = free_port()
        argv = [str(settings.server), "-m", str(settings.model_path), "--alias", alias,
                "--host", "127.0.0.1", "--port", str(self.port),
                "-np", str(n_parallel), "-c", str(settings.ctx_per_stream * n_parallel),
                "-t", str(settings.threads), "-tb", str(settings.threads), "--cont-batching"]
        self.service = Service(f"llama-server -np {n_parallel}", argv, None, log_path)
        try:
            wait_http(f"{self.url}/health", self.service, PEER_START_TIMEOUT_S)
        except RuntimeError:
            self.service.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.service.stop()


def pooled(passes: list[tuple[list[RequestRecord], float, float]], cpu: list[dict] | None = None) -> dict:
    """One side's figures over all its passes: the records together, the durations summed (so tokens/s is
    the total over the time that side was measured); with each pass's CPU seconds, the cores each process
    group used over that time and its CPU milliseconds per output token."""
    records = [r for recs, _, _ in passes for r in recs]
    out = summarize(records, 0.0, sum(t1 - t0 for _, t0, t1 in passes))
    if cpu:
        out["cpu"] = cpu_use({name: sum(c[name] for c in cpu) for name in cpu[0]}, out)
    return out


def cpu_use(cpu_s: dict[str, float], figures: dict) -> dict:
    """CPU seconds per process group, as cores over the measured time and milliseconds per output token."""
    duration, tokens = figures["duration_s"], figures["total_output_tokens"]
    return {name: {"cpu_s": s, "cores": s / duration if duration else None,
                   "ms_per_output_token": s * 1e3 / tokens if tokens else None} for name, s in cpu_s.items()}


def ratio(ours: float | None, peer: float | None) -> float | None:
    return ours / peer if ours is not None and peer else None


async def compare_level(ours: OpenAIDriver, settings: PeerSettings, order: PromptOrder, concurrency: int,
                        args, out_dir: Path, stack_pids: list[int] | None = None) -> dict:
    """At one concurrency: the peer started with that many slots, warmed up, then `rounds` pairs of passes
    (the same prompts to both sides in a pair; which side goes first alternates); pooled figures and ratios.
    stack_pids: our gateway's and nodes' processes, when this script started them (their CPU is then read)."""
    n = settings.requests_per_pass or max(8, 2 * concurrency)
    server = LlamaServer(settings, concurrency, args.model, out_dir / f"llama-server-np{concurrency}.log")
    peer = OpenAIDriver(server.url, "no-key", args.model, args.latency_class, concurrency + 16,
                        args.request_timeout, args.max_tokens)
    sides: dict[str, list] = {"ours": [], "peer": []}
    client = [(os.getpid(), False)]   # alone: the servers this script started are its children
    ours_groups = {"client": client}
    if stack_pids:
        ours_groups["server"] = [(pid, True) for pid in stack_pids]
    meters = {"ours": CpuMeter(ours_groups),
              "peer": CpuMeter({"client": client, "server": [(server.service.proc.pid, True)]})}
    cpu: dict[str, list] = {"ours": [], "peer": []}
    rounds = []
    try:
        warm, _, _ = await run_concurrency(peer, order.take(max(2, min(concurrency, 8))), concurrency,
                                           args.level_timeout)
        if warm and all(not r.ok for r in warm):
            raise SystemExit(f"error: every warm-up request to llama-server failed: {warm[0].error}")
        for k in range(settings.rounds):
            prompts = order.take(n)
            first = ("ours", "peer") if k % 2 == 0 else ("peer", "ours")
            this_round = {"first": first[0]}
            for side in first:
                before = meters[side].read()
                done = await run_concurrency(ours if side == "ours" else peer, prompts, concurrency,
                                             args.level_timeout)
                cpu[side].append(meters[side].since(before))
                sides[side].append(done)
                this_round[side] = summarize(*done)
                this_round[side]["cpu"] = cpu_use(cpu[side][-1], this_round[side])
                print_level(f"{side} c={concurrency} #{k + 1}", this_round[side])
            rounds.append(this_round)
    finally:
        await peer.close()
        server.stop()
    ours_all, peer_all = pooled(sides["ours"], cpu["ours"]), pooled(sides["peer"], cpu["peer"])
    return {
        "concurrency": concurrency, "requests_per_pass": n, "rounds": rounds, "ours": ours_all, "peer": peer_all,
        "output_tokens_per_s_ratio": ratio(ours_all["output_tokens_per_s"], peer_all["output_tokens_per_s"]),
        "ttft_p50_ratio": ratio(ours_all["ttft_s"]["p50"], peer_all["ttft_s"]["p50"]),
    }


async def compare_with_peer(ours: OpenAIDriver, settings: PeerSettings, order: PromptOrder, args,
                            out_dir: Path, stack_pids: list[int] | None = None) -> dict:
    """Every level of settings.concurrency; what the JSON's "peer" holds."""
    log(f"peer: {settings.version} ({settings.server}), {settings.threads} threads, "
        f"{settings.rounds} pass pairs per level")
    started = time.time()
    levels = [await compare_level(ours, settings, order, c, args, out_dir, stack_pids) for c in settings.concurrency]
    for lv in levels:
        o, p = lv["ours"], lv["peer"]
        log(f"vs llama-server c={lv['concurrency']:<3d} | output tok/s {o['output_tokens_per_s']:7.1f} vs "
            f"{p['output_tokens_per_s']:7.1f} ({fmt_ratio(lv['output_tokens_per_s_ratio'])}) | TTFT p50 "
            f"{_ms(o['ttft_s']['p50'])} vs {_ms(p['ttft_s']['p50'])} ms ({fmt_ratio(lv['ttft_p50_ratio'])})")
        log(f"  cores used c={lv['concurrency']:<3d} | ours: server {_cores(o, 'server')}, client "
            f"{_cores(o, 'client')} | llama-server: server {_cores(p, 'server')}, client {_cores(p, 'client')}")
    return {"name": "llama.cpp llama-server", "version": settings.version, "binary": str(settings.server),
            "threads": settings.threads, "ctx_per_stream": settings.ctx_per_stream,
            "wall_s": time.time() - started, "levels": levels}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _cores(figures: dict, group: str) -> str:
    use = figures.get("cpu", {}).get(group)
    return "-" if use is None or use["cores"] is None else f"{use['cores']:.2f}"
